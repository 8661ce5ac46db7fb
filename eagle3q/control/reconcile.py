"""Send again the tasks the broker lost, so that every prompt still ends as accepted or rejected.

Acks-late and the visibility timeout cover a worker that dies. They do not cover a message that leaves its queue
list and never reaches kombu's `unacked` hash: Redis pops it for a BRPOP and stops (SIGTERM, crash, failover) before
the reply is written, or the worker's `unacked` write fails on the dropped connection. The message is then nowhere,
and its id would stay "queued" forever, with the run never settling and training never firing.

The ledger knows what should exist: each stage's `open` hash holds the ids that entered it and are not terminal
(with the inference payload). A sweep compares it with what the broker holds (the queue lists and `unacked`); an id
seen stranded in two sweeps at least `grace_s` apart is sent again. A wrong guess costs one duplicate execution and
nothing else: every stage is idempotent (the ledger's first terminal mark wins).

One sweep runs at a time across all workers (a lock in Redis); each worker runs one (`eagle3q.celery.bootsteps`).
No Celery here: the caller gives the send function and the broker's key names.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from eagle3q.contract import INFERENCE, SAMPLE_STAGES, STAGE_BY_NAME, TRAIN, message_ref
from eagle3q.control import keys
from eagle3q.control.ledger import Ledger
from eagle3q.control.locks import RunLock
from eagle3q.periodic import Periodic

log = logging.getLogger("eagle3q.reconcile")
CHUNK = 1000

# (stage, run, sample_id); sample_id is "" for the train stage (one task per run).
Ref = tuple[str, str, str]
Send = Callable[[str, str, str, str | None], None]  # (stage, run, sample_id, inference payload or None)


def _json(raw: str) -> object:
    """A queue item decoded, or None: an item that is not JSON (garbage, another app's) is not ours to count."""
    try:
        return json.loads(raw)
    except ValueError:
        return None


def raw_message_ref(raw: dict) -> Ref | None:
    """The (stage, run, id) of one of our kombu messages, read from its body (not from Flower's argsrepr)."""
    try:
        body = raw["body"]
        if raw.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        return message_ref(raw["headers"]["task"], json.loads(body)[0][0])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


@dataclass
class SweepReport:
    checked: int = 0  # open ids compared with the broker
    stranded: int = 0  # not held by the broker in this sweep
    resent: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage, run) -> tasks sent again
    skipped: list[str] = field(default_factory=list)  # what was too large to scan this time, and why


class Reconciler:
    def __init__(self, ledger: Ledger, send: Send, grace_s: float = 60.0, scan_limit: int = 20000,
                 queue_key: Callable[[str], str] = str, unacked_key: str = "unacked", lock_s: float = 20.0,
                 clock: Callable[[], float] = time.time):
        # The broker is the ledger's Redis: its queue lists and `unacked` hash are read on the same connection.
        self.ledger, self.r, self.send, self.clock = ledger, ledger.client, send, clock
        self.grace_s, self.scan_limit, self.lock_s = grace_s, scan_limit, lock_s
        self.queue_key, self.unacked_key = queue_key, unacked_key  # Redis key names, as kombu names them
        self.token = uuid.uuid4().hex

    # --- what the broker holds ---
    def _queue_key(self, stage: str) -> str:
        return self.queue_key(STAGE_BY_NAME[stage].queue)

    def _queued(self, stage: str) -> Iterator[dict]:
        key = self._queue_key(stage)
        n = self.r.llen(key)
        for start in range(0, n, CHUNK):
            for raw in self.r.lrange(key, start, start + CHUNK - 1):
                if (msg := _json(raw)) is not None:
                    yield msg

    def _unacked(self) -> Iterator[dict]:
        for _, raw in self.r.hscan_iter(self.unacked_key, count=CHUNK):
            entry = _json(raw)  # [message, exchange, routing key]
            if isinstance(entry, list) and entry:
                yield entry[0]

    def held(self, stages: list[str]) -> set[Ref]:
        """Everything waiting in a queue list or delivered and unacknowledged. Lists before `unacked`: a message
        moves from a list to `unacked` (delivery) far more often than back (restore), so it is seen in one of them."""
        out: set[Ref] = set()
        for stage in stages:
            out.update(ref for raw in self._queued(stage) if (ref := raw_message_ref(raw)))
        out.update(ref for raw in self._unacked() if (ref := raw_message_ref(raw)))
        return out

    # --- what the ledger says should exist ---
    def _expected(self, report: SweepReport) -> tuple[set[Ref], list[str]]:
        """The refs the broker should hold, and the stages whose queues must be scanned for them."""
        expected: set[Ref] = set()
        stages: list[str] = []
        runs = self.ledger.runs()
        for stage in SAMPLE_STAGES:
            qlen = self.r.llen(self._queue_key(stage))
            if qlen > self.scan_limit:  # a backlog still draining: nothing of this stage can be stalled yet
                report.skipped.append(f"{stage}: {qlen} queued > scan limit {self.scan_limit}")
                continue
            stages.append(stage)
            for run in runs:
                n = self.ledger.open_count(run, stage)
                if n > self.scan_limit:
                    report.skipped.append(f"{run}/{stage}: {n} open > scan limit {self.scan_limit}")
                elif n:
                    expected.update((stage, run, sid) for sid in self.ledger.open_ids(run, stage))
        trains = {(TRAIN.name, run, "") for run in runs if self._train_outstanding(run)}
        if trains:
            expected |= trains
            stages.append(TRAIN.name)
        return expected, stages

    def _fire_drained(self) -> None:
        """A run whose trigger condition holds but that nobody checked (its last event a mark whose worker died
        before checking, say) is triggered here."""
        for run in self.ledger.runs():
            if not self.ledger.train_fired(run) and self.ledger.maybe_fire_train(run):
                log.warning("run %s was ready to train but not triggered: training triggered by the sweep", run)
                self.send(TRAIN.name, run, "", None)

    def _train_outstanding(self, run: str) -> bool:
        """Fired, not finished or failed, and no trainer holding the run's lease."""
        if not self.ledger.train_fired(run):
            return False
        if self.ledger.train_progress(run).get("state") in ("done", "failed"):
            return False
        return not RunLock.held(self.ledger, run)

    def _still_open(self, ref: Ref) -> bool:
        stage, run, sid = ref
        if stage == TRAIN.name:
            return self._train_outstanding(run)
        return self.ledger.is_open(run, stage, sid)  # the terminal mark deletes it

    # --- one sweep ---
    def sweep(self, now: float | None = None) -> SweepReport | None:
        """Returns None when another worker holds the sweep lock."""
        if not self.r.set(keys.RECONCILE_LOCK, self.token, nx=True, px=int(self.lock_s * 1000)):
            return None
        now = self.clock() if now is None else now
        report = SweepReport()
        self._fire_drained()
        expected, stages = self._expected(report)  # the ledger first: an id terminal since then is filtered below
        report.checked = len(expected)
        stranded = {ref for ref in expected - self.held(stages) if self._still_open(ref)} if expected else set()
        report.stranded = len(stranded)
        seen = {tuple(k.split("|", 2)): float(v) for k, v in self.r.hgetall(keys.RECONCILE_SEEN).items()}
        first_seen: dict[str, float] = {}
        for ref in stranded:
            since = seen.get(ref)
            if since is None or now - since < self.grace_s:
                first_seen["|".join(ref)] = now if since is None else since
                continue
            stage, run, sid = ref
            payload = self.ledger.open_payload(run, stage, sid) if stage == INFERENCE.name else None
            if stage == INFERENCE.name and not payload:
                log.error("%s/%s is open in inference without a payload: cannot send it again "
                          "(`eagle3q enqueue --resend-pending` can, from the data set)", run, sid)
                continue
            self.send(stage, run, sid, payload)
            report.resent[stage, run] = report.resent.get((stage, run), 0) + 1
        p = self.r.pipeline()
        p.delete(keys.RECONCILE_SEEN)
        if first_seen:
            p.hset(keys.RECONCILE_SEEN, mapping=first_seen)
        p.execute()
        for (stage, run), n in report.resent.items():
            self.ledger.incr(run, stage, "resent_lost", n)
            log.warning("run %s: sent %d %s task(s) again that the broker lost", run, n, stage)
        return report


    def sweep_and_log(self) -> None:
        report = self.sweep()
        if report is not None and report.skipped:
            log.debug("reconcile sweep did not scan: %s", "; ".join(report.skipped))


def sweeper(rec: Reconciler, period_s: float) -> Periodic:
    """Not started: the worker's bootstep starts it, and stops it at shutdown."""
    return Periodic("eagle3q-reconcile", period_s, rec.sweep_and_log, jitter=0.1)
