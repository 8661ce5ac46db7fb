"""The producer: one inference task per prompt, with stable sample ids. A re-run enqueues nothing already finished or
queued; bad rows are counted and reported with their row numbers, and never stop the run.

The backlog is bounded: at most `max_queued` prompts of a run wait for generation (queued or in flight in the
inference stage, each ~2 KB in Redis: its message and its registered payload). The producer waits for room and tops
up as they finish (or, with `wait=False`, stops when the backlog is full; the same command run again continues where
it stopped, since the ledger knows every id already enqueued). Accepted samples waiting for hidden states are not
counted: a deployment that generates everything before it starts extraction (vLLM first, then the GPUs for the
target) must not stall; their messages are ids only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3q.config import Settings
from eagle3q.contract import INFERENCE, InferenceTask, Message, Sampling, send_generate, send_train
from eagle3q.control.ledger import Ledger
from eagle3q.ids import sample_id
from eagle3q.prompt_keys import prompt_key
from eagle3q.sources import BadRow, Prompt, iter_prompts
from eagle3q.store import Rejection, Store

# Batches grow from FIRST_BATCH to BATCH: the first tasks reach the consumers at once, later ones go in bulk.
FIRST_BATCH = 8
BATCH = 500
log = logging.getLogger("eagle3q.producer")
# The rejection reason of a prompt not generated because it repeats an earlier one at temperature 0.
DUPLICATE_PROMPT = "duplicate_prompt"


class SettingsError(ValueError):
    """The producer's settings would make every task fail: refused before anything is sent."""


@dataclass
class EnqueueReport:
    run: str
    enqueued: int = 0
    skipped_known: int = 0
    prompts: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)
    resent_pending: int = 0
    seconds: float = 0.0
    estimate_bytes: int | None = None
    stopped_full: bool = False  # wait=False and the backlog was full: run again to continue
    waited_s: float = 0.0  # time spent waiting for room in the backlog
    first_sent_s: float | None = None  # from the start to the first task on the queue
    duplicate_prompts: int = 0  # prompts that repeat an earlier one of the data set (eagle3q.prompt_keys)
    skipped_duplicates: dict[str, str] = field(default_factory=dict)  # "row:turn" -> the one it repeats (greedy)

    @property
    def rate(self) -> float:
        return self.enqueued / self.seconds if self.seconds > 0 else 0.0


def sampling_of(s: Settings) -> Sampling:
    return Sampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)


def task_for(p: Prompt, run: str, dataset: str, s: Settings, sampling: Sampling) -> InferenceTask:
    sid = sample_id(dataset, p.row, p.turn, s.model, {**sampling.model_dump(), "thinking": s.thinking}, p.messages)
    return InferenceTask(
        run=run, sample_id=sid, dataset=dataset, row=p.row, turn=p.turn, model=s.model, profile=s.profile,
        thinking=s.thinking, sampling=sampling, messages=[Message(**m) for m in p.messages],
    )


@dataclass(frozen=True)
class EnqueueOptions:
    """What `eagle3q enqueue` takes beyond the settings. `on_wait(open, cap)` is called (at most every 30 s) while
    the producer waits for room in the backlog."""

    max_samples: int | None = None
    dataset_name: str | None = None
    split: str = "train"
    resend_pending: bool = False
    max_prompt_chars: int = 200_000
    train_target: int | None = None
    train_on_drain: bool = False
    max_queued: int | None = None  # None: EAGLE3Q_MAX_QUEUED
    wait: bool = True
    poll_s: float = 0.5
    on_wait: Callable[[int, int], None] | None = None


def enqueue(app, ledger: Ledger, settings: Settings, dataset_path: Path, run: str,  # noqa: ANN001 - the Celery app
            options: EnqueueOptions | None = None, **kw: object) -> EnqueueReport:
    """rows -> prompts -> duplicates set aside -> tasks -> sent through the bounded backlog; then the run is marked
    complete (unless the backlog stopped it) and the training trigger checked. `kw`: EnqueueOptions' fields."""
    opts = options or EnqueueOptions(**kw)  # type: ignore[arg-type]
    if settings.max_tokens > settings.max_tokens_limit:
        raise SettingsError(f"EAGLE3Q_MAX_TOKENS {settings.max_tokens} is over EAGLE3Q_MAX_TOKENS_LIMIT "
                            f"{settings.max_tokens_limit}: the workers would reject every task")
    store = Store.from_settings(settings)
    store.check()  # a bucket that does not exist or a wrong key: refused before a prompt is registered
    dataset = opts.dataset_name or dataset_path.name
    sampling = sampling_of(settings)
    report = EnqueueReport(run=run)
    ledger.set_meta(run, model=settings.model, profile=settings.profile, dataset=dataset, enqueue_complete=0,
                    train_target=settings.train_target if opts.train_target is None else opts.train_target,
                    train_on_drain=int(opts.train_on_drain), started=time.time())
    t0 = time.monotonic()
    sender = ThrottledSender(app, ledger, run, settings.max_queued if opts.max_queued is None else opts.max_queued,
                             opts, report, t0)
    duplicates = Duplicates(sampling.temperature == 0, report)
    for prompt in _prompts(dataset_path, opts, report):
        task = task_for(prompt, run, dataset, settings, sampling)
        original = duplicates.skip(prompt)
        if original is not None:
            if not ledger.known(run, [task.sample_id])[0]:
                reject_duplicate(store, ledger, task, original)
            continue
        if not sender.add(task):
            break
    sender.flush()
    ledger.record_skipped_duplicates(run, report.skipped_duplicates)
    ledger.set_meta(run, duplicate_prompts=report.duplicate_prompts,
                    skipped_duplicates=len(report.skipped_duplicates))
    # A backlog that stopped the producer is not the end of the data set: the run cannot drain until a later call
    # gets there, so it is neither re-sent nor marked complete.
    if opts.resend_pending and not report.stopped_full:
        report.resent_pending = resend(app, ledger, settings, dataset_path, run, dataset, opts.split,
                                       opts.max_prompt_chars)
    ledger.record_bad_rows(run, {b.row: b.reason for b in report.bad_rows})
    if not report.stopped_full:
        ledger.set_meta(run, enqueue_complete=1, bad_rows=len(report.bad_rows))
        # Every task may have finished before this point (fast workers, a re-run of a drained run): check the trigger.
        if ledger.maybe_fire_train(run):
            send_train(app, run)
    report.seconds = time.monotonic() - t0
    return report


def _prompts(path: Path, opts: EnqueueOptions, report: EnqueueReport) -> Iterator[Prompt]:
    """The data set's prompts (one a turn to generate), up to `max_samples`; bad rows go to the report."""
    for item in iter_prompts(path, max_prompt_chars=opts.max_prompt_chars, split=opts.split):
        if isinstance(item, BadRow):
            report.bad_rows.append(item)
            continue
        if opts.max_samples is not None and report.prompts >= opts.max_samples:
            return
        report.prompts += 1
        yield item


class Duplicates:
    """Exact duplicate prompts (eagle3q.prompt_keys): at temperature 0 the same prompt gives the same completion, so
    only its first row is generated; each repeat ends at once as rejected `duplicate_prompt` in the inference stage
    (every prompt in exactly one place: the counts still add up) and the ledger names the row it repeats. Sampling,
    each repeat is more data and is sent. Either way the split keeps repeats on one side. One 32-hex digest a
    prompt in memory (~100 B: 10 MB for 100k prompts); ids need none (they include the row, and Redis answers
    "already known")."""

    def __init__(self, greedy: bool, report: EnqueueReport):
        self.greedy, self.report = greedy, report
        self.first_of: dict[str, str] = {}

    def skip(self, prompt: Prompt) -> str | None:
        """The "row:turn" this prompt repeats when it is not to be sent, else None."""
        key, where = prompt_key(prompt.messages), f"{prompt.row}:{prompt.turn}"
        original = self.first_of.setdefault(key, where)
        if original == where:
            return None
        self.report.duplicate_prompts += 1
        if not self.greedy:
            return None
        self.report.skipped_duplicates[where] = original
        return original


class ThrottledSender:
    """Tasks in batches growing from FIRST_BATCH to BATCH, ids the ledger already knows dropped, sent only while
    the run's backlog has room (at most `cap` prompts open in the inference stage; 0: no cap). `add` returns False
    once the backlog is full and `wait` is off: the report says `stopped_full`, and a re-run continues."""

    def __init__(self, app, ledger: Ledger, run: str, cap: int, opts: EnqueueOptions,  # noqa: ANN001
                 report: EnqueueReport, t0: float):
        self.app, self.ledger, self.run, self.cap, self.opts, self.report, self.t0 = (
            app, ledger, run, cap, opts, report, t0)
        self.batch: list[InferenceTask] = []
        self.batch_size = FIRST_BATCH

    def add(self, task: InferenceTask) -> bool:
        self.batch.append(task)
        if len(self.batch) >= self.batch_size:
            self.flush()
        return not self.report.stopped_full

    def flush(self) -> None:
        if not self.batch or self.report.stopped_full:
            return
        self.batch_size = min(BATCH, self.batch_size * 4)
        known = self.ledger.known(self.run, [t.sample_id for t in self.batch])
        fresh = [t for t, k in zip(self.batch, known, strict=True) if not k]
        self.report.skipped_known += len(self.batch) - len(fresh)
        self.batch = []
        while fresh:
            n = self.room()
            if n == 0:
                self.report.stopped_full = True
                return
            self.send(fresh[:n])
            fresh = fresh[n:]

    def room(self) -> int:
        """How many more prompts the backlog takes now (waiting for some unless wait=False); 0: stop."""
        if self.cap <= 0:
            return BATCH
        t_wait, last_note = time.monotonic(), 0.0
        while (free := self.cap - self.ledger.open_count(self.run, INFERENCE.name)) <= 0:
            if not self.opts.wait:
                return 0
            if self.opts.on_wait is not None and time.monotonic() - last_note >= 30:
                last_note = time.monotonic()
                self.opts.on_wait(self.cap - free, self.cap)
            time.sleep(self.opts.poll_s)
        self.report.waited_s += time.monotonic() - t_wait
        return free

    def send(self, tasks: list[InferenceTask]) -> None:
        # Payloads first: a message the broker loses after this point can be sent again (eagle3q.control.reconcile).
        self.ledger.open_tasks(self.run, {t.sample_id: t.model_dump_json() for t in tasks})
        with self.app.producer_or_acquire() as producer:
            for t in tasks:
                send_generate(self.app, t, producer)
        # Recorded after sending: a crash in between re-sends on the next run (harmless, tasks are idempotent)
        # instead of leaving ids recorded that were never sent.
        self.ledger.add_enqueued(self.run, [t.sample_id for t in tasks])
        self.report.enqueued += len(tasks)
        if self.report.first_sent_s is None:
            self.report.first_sent_s = time.monotonic() - self.t0


def reject_duplicate(store: Store, ledger: Ledger, task: InferenceTask, original: str) -> None:
    """A repeat not generated: its rejection in the store, then in the ledger (the order every stage uses), so the
    files and the counts agree."""
    row, turn = original.split(":")
    store.write_rejection(Rejection(
        sample_id=task.sample_id, run=task.run, stage=INFERENCE.name, reason=DUPLICATE_PROMPT,
        detail=f"the same messages as row {row} turn {turn}, sent once: temperature 0 gives the same completion"))
    ledger.mark_rejected(task.run, INFERENCE.name, task.sample_id, DUPLICATE_PROMPT)


def resend(app, ledger: Ledger, settings: Settings, path: Path, run: str, dataset: str, split: str,  # noqa: ANN001
           max_prompt_chars: int) -> int:
    """Send again the tasks of ids enqueued but in no terminal place (e.g. a broker that lost its queue)."""
    pending = ledger.pending_ids(run, INFERENCE.name)
    if not pending:
        return 0
    sampling = sampling_of(settings)
    n = 0
    for item in iter_prompts(path, max_prompt_chars=max_prompt_chars, split=split):
        if isinstance(item, Prompt):
            task = task_for(item, run, dataset, settings, sampling)
            if task.sample_id in pending:
                ledger.open_tasks(run, {task.sample_id: task.model_dump_json()})  # registered again, then sent
                send_generate(app, task)
                pending.discard(task.sample_id)
                n += 1
    return n
