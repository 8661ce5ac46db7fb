"""Endpoint selection across several vLLM servers (real simulators)."""

from __future__ import annotations

import threading
import time

import httpx

from eagle3q.dev.local import free_port, start_sim
from eagle3q.generate.endpoints import EndpointPool, parse_waiting


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
