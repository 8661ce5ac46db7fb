"""The shared in-flight budget on a real redis-server (threads as consumers, an injected clock for leases)."""

from __future__ import annotations

import threading
import time

from eagle3q.control.inflight import InflightLimiter
from eagle3q.dev.local import RedisServer


def test_global_budget_is_never_exceeded_and_leases_expire(tmp_path):  # noqa: ANN001
    redis = RedisServer(tmp_path / "r").start()
    try:
        import redis as redis_lib

        peak, current, lock = [0], [0], threading.Lock()

        def consumer() -> None:
            lim = InflightLimiter(redis_lib.Redis(port=redis.port), "fixed", 5, 1, 50, lease_s=30)
            for _ in range(10):
                tok = lim.acquire(poll_s=0.002)
                with lock:
                    current[0] += 1
                    peak[0] = max(peak[0], current[0])
                time.sleep(0.005)
                with lock:
                    current[0] -= 1
                lim.release(tok)

        threads = [threading.Thread(target=consumer) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert peak[0] == 5  # saturated, never above the shared limit

        client = redis_lib.Redis(port=redis.port)
        lim = InflightLimiter(client, "fixed", 2, 1, 50, lease_s=0.3)
        lim.acquire()
        lim.acquire()  # a consumer that dies holding two slots ...
        assert lim.in_flight() == 2
        time.sleep(0.4)
        assert lim.in_flight() == 0  # ... loses them when the lease ends
    finally:
        redis.stop()


def test_adaptive_limit_follows_vllm_queue(tmp_path):  # noqa: ANN001
    redis = RedisServer(tmp_path / "r").start()
    try:
        import redis as redis_lib

        lim = InflightLimiter(redis_lib.Redis(port=redis.port), "adaptive", 64, 8, 256, lease_s=30, period_s=0.01)
        lim.observe([40.0])  # vLLM has a queue: back off
        time.sleep(0.02)
        assert lim.limit() < 64
        shrunk = lim.limit()
        lim.on_overload("http_429")
        time.sleep(0.02)
        assert lim.limit() < shrunk
        low = lim.limit()
        lim.observe([0.0])  # nothing waiting but the budget is not in use: no reason to grow
        time.sleep(0.02)
        assert lim.limit() == low
        tokens = [lim.acquire() for _ in range(low)]
        lim.observe([0.0])  # budget used up and vLLM idle: grow
        assert lim.limit() > low
        for t in tokens:
            lim.release(t)
        for _ in range(100):
            lim.observe([500.0])
            time.sleep(0.011)
        assert lim.limit() == 8  # bounded below
    finally:
        redis.stop()


class Clock:
    def __init__(self) -> None:
        self.t = 5_000.0

    def __call__(self) -> float:
        return self.t


def test_slots_are_leases_on_the_clock(ledger):  # noqa: ANN001
    clock = Clock()
    lim = InflightLimiter(ledger.client, "fixed", 2, 1, 50, lease_s=30, clock=clock)
    a = lim.acquire()
    lim.acquire()
    assert lim.in_flight() == 2 == lim.limit()
    lim.release(a)
    assert lim.in_flight() == 1
    clock.t += 31  # the holder of the other slot died: its lease ends, the slot comes back
    assert lim.in_flight() == 0
    lim.acquire()
    lim.acquire()
    assert lim.in_flight() == 2
