"""The shared in-flight budget (real Redis, threads as consumers) and endpoint selection (real simulators)."""

from __future__ import annotations

import threading
import time

import httpx

from eagle3q.endpoints import EndpointPool, parse_waiting
from eagle3q.inflight import InflightLimiter
from eagle3q.local import RedisServer, free_port, start_sim


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


def test_endpoint_pool_prefers_least_waiting_and_recovers(tmp_path, tiny_tokenizer):  # noqa: ANN001
    busy, busy_url = start_sim(str(tiny_tokenizer), tmp_path / "logs", extra=["--max-num-seqs", "1", "--ttft", "3"])
    idle, idle_url = start_sim(str(tiny_tokenizer), tmp_path / "logs")
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}/v1"
    procs = [busy, idle]
    try:
        http = httpx.Client()
        body = {"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        threads = [threading.Thread(target=lambda: httpx.post(f"{busy_url}/chat/completions", json=body, timeout=30))
                   for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert parse_waiting(http.get(busy_url[:-3] + "/metrics").text) == 2.0

        pool = EndpointPool([busy_url, idle_url, late_url], cooldown_s=0.5)
        pool.probe(http)
        # vLLM's own queue steers the choice; the endpoint that does not answer /health is set aside
        picks = [pool.acquire() for _ in range(2)]
        assert picks == [idle_url, idle_url]
        for u in picks:
            pool.release(u, ok=True)

        late, _ = start_sim(str(tiny_tokenizer), tmp_path / "logs", port=late_port)
        procs.append(late)
        pool.probe(http)  # /health answers again: it is back
        assert late_url in {pool.acquire() for _ in range(4)}
        for t in threads:
            t.join()
    finally:
        for p in procs:
            p.kill()
