"""The ledger: Redis counters that make every stage exactly-once and every prompt accounted for.

Per run and stage, a sample id is in at most one terminal place: `done` (a sorted set scored by completion time, so
rates come from the same data) or `rejected` (a hash id -> reason). The first terminal mark wins; redelivered tasks
find it and count nothing. Training fires once through `SET fired NX`.

Every id that entered a stage and is not terminal yet is also in the stage's `open` hash (for inference the value is
the task payload, written by the producer before it sends; for hidden states it is empty, a sample ref needs nothing
more). The terminal mark removes it. `eagle3q.control.reconcile` compares `open` with what the broker really holds
and sends again what the broker lost. Key names: `eagle3q.control.keys`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from eagle3q.contract import SAMPLE_STAGES, next_stage
from eagle3q.control import connect, keys

STAGES = SAMPLE_STAGES

# Mark one id terminal in one stage, once. KEYS: done_z, rejected_h, reasons_h, stats_h, enqueued_s, open_h,
# next_open_h ('' for the last stage). ARGV: id, ts, kind ("done"|"rejected"), reason, then stat-name, increment pairs.
# An accepted id leaves this stage's open hash and enters the next stage's in the same step: it is never in neither.
_MARK = """
redis.call('HDEL', KEYS[6], ARGV[1])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
if ARGV[3] == 'done' then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  if KEYS[7] ~= '' then redis.call('HSET', KEYS[7], ARGV[1], '') end
else
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
  redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
  redis.call('HSET', KEYS[4], 'last_reject_ts', ARGV[2])
end
for i = 5, #ARGV, 2 do redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1]) end
if KEYS[5] ~= '' then redis.call('SADD', KEYS[5], ARGV[1]) end
return 1
"""

# Decide the one training trigger. KEYS: meta_h, fired, enqueued_s, then (done_z, rejected_h) per stage in pipeline
# order. Ready when the last stage's done count reaches the run's train_target (> 0), or when the run drained (the
# producer finished and every stage is settled: what entered it = done + rejected; a stage's incoming is the previous
# one's done) and it trains on drain: train_target 0, or train_on_drain set (`enqueue --train-on-drain`).
_MAYBE_FIRE = """
local n = (#KEYS - 3) / 2
local last_done = redis.call('ZCARD', KEYS[3 + 2 * n - 1])
if last_done == 0 then return 0 end
local target = tonumber(redis.call('HGET', KEYS[1], 'train_target') or '0')
local ready = target > 0 and last_done >= target
local on_drain = target == 0 or redis.call('HGET', KEYS[1], 'train_on_drain') == '1'
if not ready and on_drain and redis.call('HGET', KEYS[1], 'enqueue_complete') == '1' then
  ready = true
  local incoming = redis.call('SCARD', KEYS[3])
  for i = 1, n do
    local done = redis.call('ZCARD', KEYS[3 + 2 * i - 1])
    if incoming ~= done + redis.call('HLEN', KEYS[3 + 2 * i]) then ready = false end
    incoming = done
  end
end
if not ready then return 0 end
if redis.call('SET', KEYS[2], tostring(ARGV[1]), 'NX') then return 1 end
return 0
"""


@dataclass
class StageCounts:
    stage: str
    incoming: int  # what entered the stage: enqueued prompts, or samples accepted by the stage before
    done: int
    rejected: int
    reasons: dict[str, int]
    done_last_window: int
    window_s: float
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return self.incoming - self.done - self.rejected

    @property
    def rate(self) -> float:
        return self.done_last_window / self.window_s

    @property
    def eta_s(self) -> float | None:
        if self.pending <= 0:
            return 0.0
        return self.pending / self.rate if self.rate > 0 else None


class Ledger:
    """The run-wide counts and marks. Callers name runs, stages and ids; the keys and the client stay in here."""

    def __init__(self, client: redis.Redis):
        self._r = client
        self._mark = client.register_script(_MARK)
        self._fire = client.register_script(_MAYBE_FIRE)

    @classmethod
    def from_url(cls, url: str) -> Ledger:
        return cls(connect(url))

    @property
    def client(self) -> redis.Redis:
        """For the rest of the control plane (locks, the in-flight budget, the sweep) to share the connection."""
        return self._r

    def dead_letters(self) -> dict[str, int]:
        """queue -> items set aside because they were not messages (eagle3q.celery.transport)."""
        from eagle3q.control.dead_letters import counts

        return counts(self._r)

    # --- workers that refused to start (eagle3q.celery.bootsteps) ---
    def worker_refused(self, worker: str, cause: str) -> None:
        self._r.hset(keys.WORKERS_REFUSED, worker, json.dumps({"cause": cause, "at": time.time()}))

    def worker_started(self, worker: str) -> None:
        self._r.hdel(keys.WORKERS_REFUSED, worker)

    def refused_workers(self) -> dict[str, dict]:
        """worker ("queues@host") -> {cause, at}: the last refusal of each worker that has not started since."""
        return {k.decode() if isinstance(k, bytes) else k: json.loads(v)
                for k, v in self._r.hgetall(keys.WORKERS_REFUSED).items()}

    def ping(self) -> bool:
        return bool(self._r.ping())

    # --- runs ---
    def runs(self) -> list[str]:
        return sorted(self._r.smembers(keys.RUNS))

    def set_meta(self, run: str, **fields: str | int | float) -> None:
        self._r.sadd(keys.RUNS, run)
        if fields:
            self._r.hset(keys.meta(run), mapping={k: str(v) for k, v in fields.items()})

    def meta(self, run: str) -> dict[str, str]:
        return self._r.hgetall(keys.meta(run))

    def run_exists(self, run: str) -> bool:
        return bool(self._r.sismember(keys.RUNS, run))

    # --- enqueue ---
    def known(self, run: str, ids: list[str]) -> list[bool]:
        """Which ids were enqueued before (queued or finished)."""
        if not ids:
            return []
        return [bool(x) for x in self._r.smismember(keys.enqueued(run), ids)]

    def add_enqueued(self, run: str, ids: list[str]) -> int:
        return int(self._r.sadd(keys.enqueued(run), *ids)) if ids else 0

    def enqueued_ids(self, run: str) -> set[str]:
        return set(self._r.smembers(keys.enqueued(run)))

    def record_bad_rows(self, run: str, rows: dict[int, str]) -> None:
        if rows:
            self._r.hset(keys.bad_rows(run), mapping={str(k): v for k, v in rows.items()})

    def bad_rows(self, run: str) -> dict[int, str]:
        return {int(k): v for k, v in self._r.hgetall(keys.bad_rows(run)).items()}

    def record_skipped_duplicates(self, run: str, prompts: dict[str, str]) -> None:
        if prompts:
            self._r.hset(keys.duplicate_prompts(run), mapping=prompts)

    def skipped_duplicates(self, run: str) -> dict[str, str]:
        """"row:turn" -> the "row:turn" it repeats, for the prompts `enqueue` did not send (temperature 0)."""
        return dict(self._r.hgetall(keys.duplicate_prompts(run)))

    # --- open ids (entered a stage, not terminal yet) ---
    def open_tasks(self, run: str, payloads: dict[str, str]) -> None:
        """The producer records each inference payload before sending it, so a message the broker loses can be sent
        again from Redis alone (the data set may live on another machine)."""
        if payloads:
            self._r.hset(keys.open_ids(run, STAGES[0]), mapping=payloads)

    def open_count(self, run: str, stage: str) -> int:
        return int(self._r.hlen(keys.open_ids(run, stage)))

    def open_ids(self, run: str, stage: str) -> set[str]:
        return set(self._r.hkeys(keys.open_ids(run, stage)))

    def is_open(self, run: str, stage: str, sample_id: str) -> bool:
        return bool(self._r.hexists(keys.open_ids(run, stage), sample_id))

    def open_payload(self, run: str, stage: str, sample_id: str) -> str | None:
        return self._r.hget(keys.open_ids(run, stage), sample_id)

    def _incoming_ids(self, run: str, stage: str) -> set[str]:
        i = STAGES.index(stage)
        if i == 0:
            return self.enqueued_ids(run)
        return self.done_ids(run, STAGES[i - 1])

    def pending_ids(self, run: str, stage: str = STAGES[0]) -> set[str]:
        return self._incoming_ids(run, stage) - self.done_ids(run, stage) - set(self.rejected(run, stage))

    # --- terminal marks ---
    def done_ids(self, run: str, stage: str) -> set[str]:
        return set(self._r.zrange(keys.done(run, stage), 0, -1))

    def rejected(self, run: str, stage: str) -> dict[str, str]:
        """id -> reason"""
        return self._r.hgetall(keys.rejected(run, stage))

    def is_terminal(self, run: str, stage: str, sample_id: str) -> bool:
        p = self._r.pipeline(transaction=False)
        p.zscore(keys.done(run, stage), sample_id)
        p.hexists(keys.rejected(run, stage), sample_id)
        score, rejected = p.execute()
        return score is not None or bool(rejected)

    def rejection_reason(self, run: str, stage: str, sample_id: str) -> str | None:
        return self._r.hget(keys.rejected(run, stage), sample_id)

    def _terminal(self, run: str, stage: str, sample_id: str, kind: str, reason: str, stats: dict[str, int]) -> bool:
        nxt = next_stage(stage)
        ks = [
            keys.done(run, stage),
            keys.rejected(run, stage),
            keys.reasons(run, stage),
            keys.stats(run, stage),
            # An id finished before the producer recorded it (the producer records after sending) still counts.
            keys.enqueued(run) if stage == STAGES[0] else "",
            keys.open_ids(run, stage),
            keys.open_ids(run, nxt) if nxt else "",
        ]
        argv: list[str | int | float] = [sample_id, time.time(), kind, reason]
        for name, inc in stats.items():
            argv += [name, int(inc)]
        return bool(self._mark(keys=ks, args=argv))

    def mark_done(self, run: str, stage: str, sample_id: str, **stats: int) -> bool:
        return self._terminal(run, stage, sample_id, "done", "", stats)

    def mark_rejected(self, run: str, stage: str, sample_id: str, reason: str, **stats: int) -> bool:
        return self._terminal(run, stage, sample_id, "rejected", reason, stats)

    def incr(self, run: str, stage: str, name: str, by: int = 1) -> None:
        self._r.hincrby(keys.stats(run, stage), name, by)

    def stat(self, run: str, stage: str, name: str) -> int:
        return int(float(self._r.hget(keys.stats(run, stage), name) or 0))

    # --- training trigger ---
    def maybe_fire_train(self, run: str, now: float | None = None) -> bool:
        """True exactly once per run: the call that decided the trigger (the caller then sends the train task)."""
        ks = [keys.meta(run), keys.train_fired(run), keys.enqueued(run)]
        for stage in STAGES:
            ks += [keys.done(run, stage), keys.rejected(run, stage)]
        return bool(self._fire(keys=ks, args=[time.time() if now is None else now]))

    def train_fired(self, run: str) -> bool:
        return bool(self._r.exists(keys.train_fired(run)))

    def train_fired_at(self, run: str) -> float | None:
        """When the trigger fired (the ledger's clock), or None."""
        v = self._r.get(keys.train_fired(run))
        return float(v) if v is not None else None

    def set_train_progress(self, run: str, **fields: str | int | float) -> None:
        self._r.hset(keys.train_progress(run), mapping={k: str(v) for k, v in fields.items()})

    def train_progress(self, run: str) -> dict[str, str]:
        return self._r.hgetall(keys.train_progress(run))

    # --- hidden-state batching: accepted samples waiting for extraction, scored by token count ---
    def add_hs_pending(self, run: str, sample_id: str, num_tokens: int) -> None:
        self._r.zadd(keys.hs_pending(run), {sample_id: num_tokens})

    def claim_hs_batch(self, run: str, anchor: str, anchor_len: int, budget: int) -> list[str]:
        """Claim the anchor plus pending samples of similar length (padding stays small) within the token budget.

        Claims are removals from the pending set; a claimed sample whose worker dies still has its own queue message,
        which is redelivered, so batching never loses a sample."""
        key = keys.hs_pending(run)
        self._r.zrem(key, anchor)
        max_rows = max(0, budget // max(anchor_len, 1) - 1)
        if max_rows == 0:
            return [anchor]
        lo, hi = anchor_len // 2, anchor_len
        got: list[str] = []
        for cand in self._r.zrevrangebyscore(key, hi, lo, start=0, num=max_rows):
            if self._r.zrem(key, cand):
                got.append(cand)
        return [anchor, *got]

    # --- counts ---
    def counts(self, run: str, stage: str, window_s: float = 60.0, now: float | None = None) -> StageCounts:
        now = time.time() if now is None else now
        i = STAGES.index(stage)
        p = self._r.pipeline(transaction=False)
        if i == 0:
            p.scard(keys.enqueued(run))
        else:
            p.zcard(keys.done(run, STAGES[i - 1]))
        p.zcard(keys.done(run, stage))
        p.hlen(keys.rejected(run, stage))
        p.hgetall(keys.reasons(run, stage))
        p.zcount(keys.done(run, stage), now - window_s, now)
        p.hgetall(keys.stats(run, stage))
        p.zrange(keys.done(run, stage), 0, 0, withscores=True)
        p.zrange(keys.done(run, stage), -1, -1, withscores=True)
        incoming, done, rejected, reasons, recent, stats, first, last = p.execute()
        # The window starts no earlier than the first completion, and a drained stage's window ends at its last one:
        # the rate of a finished stage is its rate while it ran, not a number decaying to zero.
        window = window_s
        if first:
            if int(incoming) == int(done) + int(rejected):  # drained: its rate while it ran
                start, end, recent = first[0][1], last[0][1], int(done)
            else:
                start, end = max(first[0][1], now - window_s), now
            window = max(end - start, 1.0)
        return StageCounts(
            stage=stage,
            incoming=int(incoming),
            done=int(done),
            rejected=int(rejected),
            reasons={k: int(v) for k, v in reasons.items()},
            done_last_window=int(recent),
            window_s=window,
            stats={k: int(float(v)) for k, v in stats.items()},
        )
