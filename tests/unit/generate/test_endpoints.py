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


def test_a_server_too_old_for_the_profile_is_refused(tiny_tokenizer, tmp_path):  # noqa: ANN001
    import httpx
    import pytest

    from eagle3q.dev.local import start_sim
    from eagle3q.generate.endpoints import ServerTooOld, check_version, parse_version
    from eagle3q.generate.profiles import get_profile

    assert parse_version("v0.15.1rc1") == (0, 15, 1) and parse_version("0.11.0+cu128") == (0, 11, 0)
    assert parse_version("main") is None
    with httpx.Client() as http:
        old, old_url = start_sim(str(tiny_tokenizer), tmp_path / "logs", extra=["--vllm-version", "0.11.0"])
        new, new_url = start_sim(str(tiny_tokenizer), tmp_path / "logs")
        try:
            with pytest.raises(ServerTooOld, match="older than 0.15.0"):
                check_version(http, old_url, get_profile("kimi_k2").min_vllm, "kimi_k2")
            assert check_version(http, old_url, get_profile("qwen3").min_vllm, "qwen3") == "0.11.0"
            assert check_version(http, new_url, get_profile("kimi_k2").min_vllm, "kimi_k2") == "0.17.0"
            assert check_version(http, "http://127.0.0.1:9/v1", (0, 15, 0), "kimi_k2") is None  # unreachable
        finally:
            old.kill()
            new.kill()
