"""The simulator against vLLM 0.33's real frontend, probe for probe: the same prompts give the same token streams
(the engine double generates what the simulator generates), so whole responses are compared: fields, types, values,
finish reasons, reasoning/content splits, streaming chunks, error statuses and messages, and the side routes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3q.dev.local import start_sim
from tests.conformance.vllm_server import MAX_MODEL_LEN, MODEL, VLLMServer

VOLATILE = {"id", "created", "system_fingerprint"}  # differ between any two responses, compared by type only
PROFILES = [("kimi_k2", "kimi_k2"), ("qwen3", "qwen3"), ("deepseek_r1", "deepseek_r1")]


def normalise(x: Any, key: str = "") -> Any:
    if key in VOLATILE:
        return f"<{type(x).__name__}>"
    if isinstance(x, dict):
        return {k: normalise(v, k) for k, v in x.items()}
    if isinstance(x, list):
        return [normalise(v) for v in x]
    return x


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where a (vLLM) and b (the simulator) differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in vLLM ({a[k]!r})" for k in a.keys() - b.keys()]
        out += [f"{path}.{k}: only in the simulator ({b[k]!r})" for k in b.keys() - a.keys()]
        for k in a.keys() & b.keys():
            out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b and type(a) is type(b) else [f"{path}: vLLM {a!r} vs simulator {b!r}"]


@pytest.fixture(scope="module", params=PROFILES, ids=[p for p, _ in PROFILES])
def pair(request: pytest.FixtureRequest, vllm_factory: Callable[..., VLLMServer], tiny: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(profile, vLLM's url, the simulator's url), both serving the tiny target with the same template."""
    template, parser = request.param
    server = vllm_factory(template, parser)
    proc, sim_url = start_sim(str(server.model_dir), tmp_path_factory.mktemp("sim"), extra=[
        "--profile", template, "--target-model", str(tiny), "--max-model-len", str(MAX_MODEL_LEN),
        "--mean-output-tokens", "16", "--ttft", "0.001", "--itl", "0.0005"])
    yield template, server.url, sim_url
    proc.kill()


def chat_body(profile: str, text: str, thinking: bool = True, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 64,
                            "temperature": 0.6, "top_p": 0.95, "return_token_ids": True,
                            "skip_special_tokens": False}
    switch = {"kimi_k2": "thinking", "qwen3": "enable_thinking"}.get(profile)
    if switch:
        body["chat_template_kwargs"] = {switch: thinking}
    return {**body, **kw}


def both(method: str, path: str, vllm_url: str, sim_url: str, **kw: Any) -> tuple[httpx.Response, httpx.Response]:
    return (httpx.request(method, vllm_url + path, timeout=60, **kw),
            httpx.request(method, sim_url + path, timeout=60, **kw))


def stream_chunks(resp: httpx.Response) -> list[Any]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else normalise(json.loads(data)))
    return out


@pytest.mark.parametrize("thinking", [True, False])
def test_whole_responses_agree(pair: tuple[str, str, str], thinking: bool) -> None:
    profile, vllm_url, sim_url = pair
    if profile == "deepseek_r1" and not thinking:
        pytest.skip("R1 has no thinking switch")
    for i, text in enumerate(["hello", "why is the sky blue?", "write a poem about the sea", "2+2"]):
        kw = {"max_tokens": 6} if i == 3 else {}  # a generation cut by max_tokens: finish_reason length
        body = chat_body(profile, text, thinking, **kw)
        real, sim = both("POST", "/chat/completions", vllm_url, sim_url, json=body)
        assert real.status_code == sim.status_code == 200
        d = diff(normalise(real.json()), normalise(sim.json()))
        assert not d, "\n".join(d)


@pytest.mark.parametrize("thinking", [True, False])
def test_streams_agree_chunk_for_chunk(pair: tuple[str, str, str], thinking: bool) -> None:
    profile, vllm_url, sim_url = pair
    if profile == "deepseek_r1" and not thinking:
        pytest.skip("R1 has no thinking switch")
    for usage in (True, False):
        body = chat_body(profile, "stream me an answer", thinking, stream=True,
                         **({"stream_options": {"include_usage": True}} if usage else {}))
        real, sim = both("POST", "/chat/completions", vllm_url, sim_url, json=body)
        assert real.status_code == sim.status_code == 200
        assert real.headers["content-type"].split(";")[0] == sim.headers["content-type"].split(";")[0]
        d = diff(stream_chunks(real), stream_chunks(sim))
        assert not d, "\n".join(d)


def test_errors_agree(pair: tuple[str, str, str]) -> None:
    profile, vllm_url, sim_url = pair
    cases = {
        "max_tokens over max_model_len": chat_body(profile, "hi", max_tokens=MAX_MODEL_LEN + 1),
        "prompt over the context": chat_body(profile, " ".join(["word"] * (2 * MAX_MODEL_LEN))),
        "unknown model": {**chat_body(profile, "hi"), "model": "no-such-model"},
    }
    compared = 0
    for name, body in cases.items():
        real, sim = both("POST", "/chat/completions", vllm_url, sim_url, json=body)
        compared += 1
        assert (name, real.status_code) == (name, sim.status_code)
        d = diff(real.json(), sim.json())
        assert not d, name + ":\n" + "\n".join(d)
    assert compared == 3


def test_side_routes_agree(pair: tuple[str, str, str]) -> None:
    _, vllm_url, sim_url = pair
    real, sim = both("GET", "/models", vllm_url, sim_url)
    r, s = real.json()["data"][0], sim.json()["data"][0]
    assert (r["id"], r["object"], r["owned_by"], r["max_model_len"]) == (s["id"], s["object"], s["owned_by"],
                                                                         s["max_model_len"])
    root_real, root_sim = vllm_url.removesuffix("/v1"), sim_url.removesuffix("/v1")
    for path in ("/health", "/version"):
        a, b = httpx.get(root_real + path), httpx.get(root_sim + path)
        assert a.status_code == b.status_code == 200
    assert set(httpx.get(root_real + "/version").json()) == set(httpx.get(root_sim + "/version").json())
    metrics_real, metrics_sim = httpx.get(root_real + "/metrics").text, httpx.get(root_sim + "/metrics").text
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert gauge in metrics_real and gauge in metrics_sim
    for body in ({"model": MODEL, "prompt": "hello world"},
                 # the chat form: what the consumers ask to size max_tokens near the context limit
                 {"model": MODEL, "add_generation_prompt": True,
                  "messages": [{"role": "user", "content": "hello world"}]}):
        tok_real = httpx.post(root_real + "/tokenize", json=body).json()
        tok_sim = httpx.post(root_sim + "/tokenize", json=body).json()
        d = diff(tok_real, tok_sim)
        assert not d, "\n".join(d)


def test_overload_answer_agrees(vllm_factory: Callable[..., VLLMServer], tmp_path: Path) -> None:
    """The simulator's `5xx` fault is the 503 vLLM sends when its queue is full (`--max-num-queued-reqs`)."""
    server = vllm_factory("kimi_k2", "kimi_k2", "--max-num-queued-reqs", "0")
    proc, sim_url = start_sim(str(server.model_dir), tmp_path, extra=["--faults", "5xx=1.0"])
    try:
        real, sim = both("POST", "/chat/completions", server.url, sim_url, json=chat_body("kimi_k2", "hi"))
    finally:
        proc.kill()
    assert real.status_code == sim.status_code == 503
    d = diff(real.json(), sim.json())
    assert not d, "\n".join(d)


def test_completions_with_token_ids_agree_in_shape(pair: tuple[str, str, str]) -> None:
    """`/v1/completions` with a token-id prompt (the hidden-state extraction call): the same fields and types."""

    def shape(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, list):
            return [shape(x[0])] if x else []
        return type(x).__name__

    _, vllm_url, sim_url = pair
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 1, "return_token_ids": True}
    real, sim = both("POST", "/completions", vllm_url, sim_url, json=body)
    assert real.status_code == sim.status_code == 200
    assert real.json()["choices"][0]["prompt_token_ids"] == sim.json()["choices"][0]["prompt_token_ids"]
    d = diff(shape(normalise(real.json())), shape(normalise(sim.json())))
    assert not d, "\n".join(d)
