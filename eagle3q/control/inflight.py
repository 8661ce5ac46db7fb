"""A global in-flight budget shared by every inference consumer through Redis, fixed or adapted to vLLM's signals.

Slots are leases in a sorted set (member -> expiry): a consumer that dies loses its slots when their lease ends, so
the budget never leaks. In adaptive mode the limit follows AIMD on what vLLM reports: while requests wait in vLLM's
queue (`vllm:num_requests_waiting`), or it answers 429/503, the limit shrinks; while nothing waits and the budget is
used up, it grows. One adjustment per period across all consumers (a `SET NX PX` guard), whoever observes first.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable

import redis

from eagle3q.config import Settings
from eagle3q.control import keys
from eagle3q.control.ledger import Ledger

_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local limit = tonumber(redis.call('GET', KEYS[2]) or ARGV[4])
if redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  return 1
end
return 0
"""

# KEYS: holders_z, limit, guard. ARGV: now, factor, add, min, max, period_ms, start, need_full(0/1)
_ADJUST = """
if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[6]) then return -1 end
local limit = tonumber(redis.call('GET', KEYS[2]) or ARGV[7])
if ARGV[8] == '1' then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  if redis.call('ZCARD', KEYS[1]) < limit * 0.9 then return limit end
end
local new = math.floor(limit * tonumber(ARGV[2]) + tonumber(ARGV[3]))
new = math.max(tonumber(ARGV[4]), math.min(tonumber(ARGV[5]), new))
redis.call('SET', KEYS[2], new)
return new
"""


class InflightLimiter:
    def __init__(self, client: redis.Redis, mode: str, start: int, lo: int, hi: int, lease_s: float,
                 pool: str = "vllm", period_s: float = 2.0, clock: Callable[[], float] = time.time):
        self.r = client
        self.clock = clock
        self.mode = mode
        self.start, self.lo, self.hi = start, lo, hi
        self.lease_s = lease_s
        self.period_ms = int(period_s * 1000)
        self.k_holders = keys.inflight_holders(pool)
        self.k_limit = keys.inflight_limit(pool)
        self.k_guard = keys.inflight_guard(pool)
        self._acquire = self.r.register_script(_ACQUIRE)
        self._adjust = self.r.register_script(_ADJUST)
        if mode == "fixed":
            self.r.set(self.k_limit, start)
        else:
            self.r.set(self.k_limit, start, nx=True)

    @classmethod
    def from_settings(cls, ledger: Ledger, s: Settings) -> InflightLimiter:
        """The budget lives beside the run counts, on the ledger's connection."""
        return cls(ledger.client, s.inflight_mode, s.inflight_limit, s.inflight_min, s.inflight_max,
                   lease_s=s.request_timeout_s + 60, period_s=s.inflight_period_s)

    def limit(self) -> int:
        return int(self.r.get(self.k_limit) or self.start)

    def in_flight(self) -> int:
        self.r.zremrangebyscore(self.k_holders, "-inf", self.clock())
        return int(self.r.zcard(self.k_holders))

    def acquire(self, poll_s: float = 0.02) -> str:
        token = uuid.uuid4().hex
        while True:
            now = self.clock()
            if self._acquire(keys=[self.k_holders, self.k_limit], args=[now, now + self.lease_s, token, self.start]):
                return token
            time.sleep(poll_s * (0.5 + random.random()))

    def release(self, token: str) -> None:
        self.r.zrem(self.k_holders, token)

    def _step(self, factor: float, add: float, need_full: bool) -> int:
        return int(self._adjust(keys=[self.k_holders, self.k_limit, self.k_guard],
                                args=[self.clock(), factor, add, self.lo, self.hi, self.period_ms, self.start,
                                      1 if need_full else 0]))

    def observe(self, waiting: list[float]) -> None:
        """vLLM's waiting queues (one per endpoint), polled every few seconds."""
        if self.mode != "adaptive":
            return
        total = sum(waiting)
        if total > max(1.0, 0.02 * self.limit()):
            self._step(0.9, 0, need_full=False)  # vLLM is queueing: we send more than it runs
        elif total == 0:
            self._step(1.0, max(1, self.limit() // 16), need_full=True)  # room left and budget used: probe up

    def on_overload(self, kind: str) -> None:
        if self.mode == "adaptive" and kind in {"http_429", "http_503"}:
            self._step(0.7, 0, need_full=False)
