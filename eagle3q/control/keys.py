"""Every Redis key of eagle3q's control plane, by name. ARCHITECTURE.md has the table: type, writer, reader, lifetime.

Nothing outside `eagle3q.control` builds a key: callers ask the ledger (or the lock, limiter, sweep) by meaning.
The broker's own keys (queue lists, kombu's `unacked` hash and index) are kombu's; `eagle3q.celery.transport.broker_key`
names them.
"""

from __future__ import annotations

PREFIX = "e3q"


def _k(*parts: str) -> str:
    return ":".join((PREFIX, *parts))


# --- across runs ---
RUNS = _k("runs")  # set of run names
RECONCILE_LOCK = _k("reconcile", "lock")  # string with a PX lease: one lost-message sweep at a time
RECONCILE_SEEN = _k("reconcile", "seen")  # hash "stage|run|id" -> when the sweep first saw it stranded
DEAD_LETTER_COUNTS = _k("dead", "counts")  # hash queue -> items set aside (not messages)
WORKERS_REFUSED = _k("workers", "refused")  # hash "queues@host" -> JSON {cause, at}: workers that would not start


def dead_letters(queue: str) -> str:
    """list of JSON {queue, why, at, raw}: items found on `queue` that are not messages (newest first, capped)"""
    return _k("dead", queue)


def meta(run: str) -> str:
    """hash: model, profile, dataset, train_target, enqueue_complete, started, bad_rows, duplicate_prompts,
    skipped_duplicates"""
    return _k(run, "meta")


def enqueued(run: str) -> str:
    """set of every sample id the producer enqueued (the inference stage's incoming)"""
    return _k(run, "enqueued")


def bad_rows(run: str) -> str:
    """hash data-set row -> why it was not enqueued"""
    return _k(run, "bad_rows")


def duplicate_prompts(run: str) -> str:
    """hash "row:turn" -> the earlier "row:turn" whose prompt it repeats (not enqueued: generated at temperature 0)"""
    return _k(run, "duplicate_prompts")


def done(run: str, stage: str) -> str:
    """sorted set id -> completion time"""
    return _k(run, "done", stage)


def rejected(run: str, stage: str) -> str:
    """hash id -> reason"""
    return _k(run, "rejected", stage)


def reasons(run: str, stage: str) -> str:
    """hash reason -> count"""
    return _k(run, "reasons", stage)


def stats(run: str, stage: str) -> str:
    """hash counter -> value (tokens, bytes, retries, store and task errors, resent_lost, last_reject_ts)"""
    return _k(run, "stats", stage)


def open_ids(run: str, stage: str) -> str:
    """hash id -> payload ('' where the id is enough): entered the stage, not terminal yet"""
    return _k(run, "open", stage)


def hs_pending(run: str) -> str:
    """sorted set id -> token count: accepted samples a hidden-state worker may batch with its own"""
    return _k(run, "hs_pending")


def train_fired(run: str) -> str:
    """string (when): training was triggered, once"""
    return _k(run, "fired", "train")


def train_progress(run: str) -> str:
    """hash: state, step, total_steps, loss, acc, error, ..."""
    return _k(run, "train")


def train_lock(run: str) -> str:
    """string with a TTL: the trainer holding the run"""
    return _k(run, "train_lock")


# --- the shared in-flight budget (per pool of vLLM endpoints) ---
def inflight_holders(pool: str) -> str:
    """sorted set slot token -> lease expiry"""
    return _k("inflight", pool, "holders")


def inflight_limit(pool: str) -> str:
    """string: the current limit"""
    return _k("inflight", pool, "limit")


def inflight_guard(pool: str) -> str:
    """string with a PX lease: one adjustment per period"""
    return _k("inflight", pool, "guard")
