"""The simulator's wire format: streaming and non-streaming agree, fields are where vLLM puts them."""

from __future__ import annotations

import json

import httpx
import pytest

from eagle3q.dev.local import start_sim

BODY = {"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "Explain hash tables."}],
        "max_tokens": 4096, "return_token_ids": True, "chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def sim_url(tiny_tokenizer, tmp_path_factory):  # noqa: ANN001, ANN201
    proc, url = start_sim(str(tiny_tokenizer), tmp_path_factory.mktemp("simlogs"), extra=["--itl", "0"])
    yield url
    proc.kill()


def test_streaming_matches_non_streaming(sim_url):  # noqa: ANN001
    full = httpx.post(f"{sim_url}/chat/completions", json=BODY, timeout=30).json()
    choice = full["choices"][0]
    assert set(full) >= {"id", "object", "created", "model", "choices", "usage", "prompt_token_ids"}
    assert full["object"] == "chat.completion" and choice["finish_reason"] == "stop"
    assert len(choice["token_ids"]) == full["usage"]["completion_tokens"]

    ids, reasoning, content, prompt_ids, usage = [], "", "", None, None
    with httpx.stream("POST", f"{sim_url}/chat/completions", timeout=30,
                      json={**BODY, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert chunk["object"] == "chat.completion.chunk"
            prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
            usage = chunk.get("usage") or usage
            for ch in chunk["choices"]:
                ids += ch.get("token_ids") or []
                reasoning += ch["delta"].get("reasoning") or ""
                content += ch["delta"].get("content") or ""
    assert prompt_ids == full["prompt_token_ids"] and ids == choice["token_ids"]
    assert reasoning.strip() == choice["message"]["reasoning"].strip()
    assert content.strip() == choice["message"]["content"].strip()
    assert usage["completion_tokens"] == full["usage"]["completion_tokens"]


def test_errors_and_endpoints(sim_url):  # noqa: ANN001
    root = sim_url[:-3]
    assert httpx.get(f"{root}/health").status_code == 200
    assert httpx.get(f"{sim_url}/models").json()["data"][0]["id"] == "moonshotai/Kimi-K2.5"
    r = httpx.post(f"{sim_url}/chat/completions", json={**BODY, "model": "other"})
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    r = httpx.post(f"{sim_url}/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400
    no_ids = httpx.post(f"{sim_url}/chat/completions", json={**BODY, "return_token_ids": False}).json()
    assert no_ids["prompt_token_ids"] is None and no_ids["choices"][0]["token_ids"] is None
    metrics = httpx.get(f"{root}/metrics").text
    assert "vllm:num_requests_running" in metrics and "vllm:num_requests_waiting" in metrics


def test_prometheus_exporter_adds_up(tmp_path):  # noqa: ANN001
    from prometheus_client import CollectorRegistry, generate_latest

    from eagle3q.control.ledger import Ledger
    from eagle3q.dev.local import RedisServer
    from eagle3q.metrics import LedgerCollector

    redis = RedisServer(tmp_path / "r").start()
    try:
        ledger = Ledger.from_url(redis.url)
        ledger.set_meta("m")
        ledger.add_enqueued("m", [f"{i:032x}" for i in range(5)])
        ledger.mark_done("m", "inference", f"{0:032x}")
        ledger.mark_rejected("m", "inference", f"{1:032x}", "truncated")
        reg = CollectorRegistry()
        reg.register(LedgerCollector(ledger))
        text = generate_latest(reg).decode()
        assert 'eagle3q_run_done{run="m",stage="inference"} 1.0' in text
        assert 'eagle3q_run_pending{run="m",stage="inference"} 3.0' in text
        assert 'eagle3q_run_rejected{reason="truncated",run="m",stage="inference"} 1.0' in text
    finally:
        redis.stop()
