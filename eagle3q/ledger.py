"""The ledger: Redis counters that make every stage exactly-once and every prompt accounted for.

Per run and stage, a sample id is in at most one terminal place: `done` (a sorted set scored by completion time, so
rates come from the same data) or `rejected` (a hash id -> reason). The first terminal mark wins; redelivered tasks
find it and count nothing. Training fires once through `SET fired NX`.

Every id that entered a stage and is not terminal yet is also in the stage's `open` hash (for inference the value is
the task payload, written by the producer before it sends; for hidden states it is empty, a sample ref needs nothing
more). The terminal mark removes it. `eagle3q.reconcile` compares `open` with what the broker really holds and sends
again what the broker lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

STAGES = ("inference", "hidden_states")

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

# Decide the one training trigger. KEYS: meta_h, enqueued_s, inf_done_z, inf_rej_h, hs_done_z, hs_rej_h, fired
_MAYBE_FIRE = """
local hs_done = redis.call('ZCARD', KEYS[5])
if hs_done == 0 then return 0 end
local target = tonumber(redis.call('HGET', KEYS[1], 'train_target') or '0')
local ready = false
if target > 0 and hs_done >= target then ready = true end
if not ready and redis.call('HGET', KEYS[1], 'enqueue_complete') == '1' then
  local inf_done = redis.call('ZCARD', KEYS[3])
  local settled_inf = redis.call('SCARD', KEYS[2]) == inf_done + redis.call('HLEN', KEYS[4])
  local settled_hs = inf_done == hs_done + redis.call('HLEN', KEYS[6])
  ready = settled_inf and settled_hs
end
if not ready then return 0 end
if redis.call('SET', KEYS[7], tostring(ARGV[1]), 'NX') then return 1 end
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
    def __init__(self, client: redis.Redis, prefix: str = "e3q"):
        self.r = client
        self.prefix = prefix
        self._mark = self.r.register_script(_MARK)
        self._fire = self.r.register_script(_MAYBE_FIRE)

    @classmethod
    def from_url(cls, url: str) -> Ledger:
        # Commands retry through a Redis restart (about five minutes of backoff) instead of failing the task.
        client = redis.Redis.from_url(
            url,
            decode_responses=True,
            health_check_interval=30,
            socket_connect_timeout=5,
            socket_timeout=60,
            retry=Retry(ExponentialBackoff(cap=5.0, base=0.2), 60),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
        return cls(client)

    def k(self, run: str, *parts: str) -> str:
        return ":".join((self.prefix, run, *parts))

    # --- runs ---
    def runs(self) -> list[str]:
        return sorted(self.r.smembers(f"{self.prefix}:runs"))

    def set_meta(self, run: str, **fields: str | int | float) -> None:
        self.r.sadd(f"{self.prefix}:runs", run)
        if fields:
            self.r.hset(self.k(run, "meta"), mapping={k: str(v) for k, v in fields.items()})

    def meta(self, run: str) -> dict[str, str]:
        return self.r.hgetall(self.k(run, "meta"))

    # --- enqueue ---
    def known(self, run: str, ids: list[str]) -> list[bool]:
        """Which ids were enqueued before (queued or finished)."""
        if not ids:
            return []
        return [bool(x) for x in self.r.smismember(self.k(run, "enqueued"), ids)]

    def add_enqueued(self, run: str, ids: list[str]) -> int:
        return int(self.r.sadd(self.k(run, "enqueued"), *ids)) if ids else 0

    # --- open ids (entered a stage, not terminal yet) ---
    def open_tasks(self, run: str, payloads: dict[str, str]) -> None:
        """The producer records each inference payload before sending it, so a message the broker loses can be sent
        again from Redis alone (the data set may live on another machine)."""
        if payloads:
            self.r.hset(self.k(run, "open", "inference"), mapping=payloads)

    def open_count(self, run: str, stage: str) -> int:
        return int(self.r.hlen(self.k(run, "open", stage)))

    def open_ids(self, run: str, stage: str) -> set[str]:
        return set(self.r.hkeys(self.k(run, "open", stage)))

    def open_payload(self, run: str, stage: str, sample_id: str) -> str | None:
        return self.r.hget(self.k(run, "open", stage), sample_id)

    def pending_ids(self, run: str, stage: str = "inference") -> set[str]:
        incoming = (
            self.r.smembers(self.k(run, "enqueued"))
            if stage == "inference"
            else set(self.r.zrange(self.k(run, "done", "inference"), 0, -1))
        )
        done = set(self.r.zrange(self.k(run, "done", stage), 0, -1))
        rejected = set(self.r.hkeys(self.k(run, "rejected", stage)))
        return incoming - done - rejected

    # --- terminal marks ---
    def is_terminal(self, run: str, stage: str, sample_id: str) -> bool:
        p = self.r.pipeline(transaction=False)
        p.zscore(self.k(run, "done", stage), sample_id)
        p.hexists(self.k(run, "rejected", stage), sample_id)
        score, rejected = p.execute()
        return score is not None or bool(rejected)

    def rejection_reason(self, run: str, stage: str, sample_id: str) -> str | None:
        return self.r.hget(self.k(run, "rejected", stage), sample_id)

    def _terminal(self, run: str, stage: str, sample_id: str, kind: str, reason: str, stats: dict[str, int]) -> bool:
        keys = [
            self.k(run, "done", stage),
            self.k(run, "rejected", stage),
            self.k(run, "reasons", stage),
            self.k(run, "stats", stage),
            # An id finished before the producer recorded it (the producer records after sending) still counts.
            self.k(run, "enqueued") if stage == "inference" else "",
            self.k(run, "open", stage),
            self.k(run, "open", STAGES[STAGES.index(stage) + 1]) if stage != STAGES[-1] else "",
        ]
        argv: list[str | int | float] = [sample_id, time.time(), kind, reason]
        for name, inc in stats.items():
            argv += [name, int(inc)]
        return bool(self._mark(keys=keys, args=argv))

    def mark_done(self, run: str, stage: str, sample_id: str, **stats: int) -> bool:
        return self._terminal(run, stage, sample_id, "done", "", stats)

    def mark_rejected(self, run: str, stage: str, sample_id: str, reason: str, **stats: int) -> bool:
        return self._terminal(run, stage, sample_id, "rejected", reason, stats)

    def incr(self, run: str, stage: str, name: str, by: int = 1) -> None:
        self.r.hincrby(self.k(run, "stats", stage), name, by)

    # --- training trigger ---
    def maybe_fire_train(self, run: str) -> bool:
        keys = [
            self.k(run, "meta"),
            self.k(run, "enqueued"),
            self.k(run, "done", "inference"),
            self.k(run, "rejected", "inference"),
            self.k(run, "done", "hidden_states"),
            self.k(run, "rejected", "hidden_states"),
            self.k(run, "fired", "train"),
        ]
        return bool(self._fire(keys=keys, args=[time.time()]))

    def train_fired(self, run: str) -> bool:
        return bool(self.r.exists(self.k(run, "fired", "train")))

    def set_train_progress(self, run: str, **fields: str | int | float) -> None:
        self.r.hset(self.k(run, "train"), mapping={k: str(v) for k, v in fields.items()})

    def train_progress(self, run: str) -> dict[str, str]:
        return self.r.hgetall(self.k(run, "train"))

    # --- hidden-state batching: accepted samples waiting for extraction, scored by token count ---
    def add_hs_pending(self, run: str, sample_id: str, num_tokens: int) -> None:
        self.r.zadd(self.k(run, "hs_pending"), {sample_id: num_tokens})

    def claim_hs_batch(self, run: str, anchor: str, anchor_len: int, budget: int) -> list[str]:
        """Claim the anchor plus pending samples of similar length (padding stays small) within the token budget.

        Claims are removals from the pending set; a claimed sample whose worker dies still has its own queue message,
        which is redelivered, so batching never loses a sample."""
        key = self.k(run, "hs_pending")
        self.r.zrem(key, anchor)
        max_rows = max(0, budget // max(anchor_len, 1) - 1)
        if max_rows == 0:
            return [anchor]
        lo, hi = anchor_len // 2, anchor_len
        got: list[str] = []
        for cand in self.r.zrevrangebyscore(key, hi, lo, start=0, num=max_rows):
            if self.r.zrem(key, cand):
                got.append(cand)
        return [anchor, *got]

    # --- counts ---
    def counts(self, run: str, stage: str, window_s: float = 60.0) -> StageCounts:
        now = time.time()
        p = self.r.pipeline(transaction=False)
        if stage == "inference":
            p.scard(self.k(run, "enqueued"))
        else:
            p.zcard(self.k(run, "done", "inference"))
        p.zcard(self.k(run, "done", stage))
        p.hlen(self.k(run, "rejected", stage))
        p.hgetall(self.k(run, "reasons", stage))
        p.zcount(self.k(run, "done", stage), now - window_s, now)
        p.hgetall(self.k(run, "stats", stage))
        p.zrange(self.k(run, "done", stage), 0, 0, withscores=True)
        p.zrange(self.k(run, "done", stage), -1, -1, withscores=True)
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
