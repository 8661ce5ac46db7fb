"""eagle3q's vLLM client and validation against vLLM 0.33's own OpenAI server (engine core swapped for the test
double): every profile, thinking on and off, and each way a real run goes wrong (issue 11's list)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from eagle3q.generate.endpoints import check_version
from eagle3q.generate.profiles import get_profile, resolve
from eagle3q.generate.templates import render_prompt
from eagle3q.generate.tokenizer import FastTokenizer
from eagle3q.generate.validation import Verdict, validate
from eagle3q.generate.vllm_client import ChatRequest, PermanentError, TransientError, VLLMClient
from tests.conformance.vllm_server import MAX_MODEL_LEN, MODEL, VLLMServer, start_vllm


def ask(server: VLLMServer, text: str, profile: str, thinking: bool = True, max_tokens: int = 200,
        policy: str = "reject", **overrides: Any) -> tuple[dict[str, Any], Verdict]:
    """One request through eagle3q's client, validated as the inference stage validates it."""
    tok = FastTokenizer(server.model_dir / "tokenizer.json")
    rp = resolve(get_profile(profile), tok.token_to_id, tok.vocab_size)
    req = ChatRequest(model=MODEL, messages=[{"role": "user", "content": text}], temperature=0.6, top_p=0.95,
                      max_tokens=max_tokens, chat_template_kwargs=rp.profile.chat_template_kwargs(thinking))
    client = VLLMClient(None, 30, 4)
    try:
        if overrides:
            body = {**req.body(), **overrides}
            raw = client.http.post(server.url + "/chat/completions", json=body).json()
        else:
            raw = client.chat(server.url, req)
    finally:
        client.close()
    return raw, validate(raw, rp, tok, thinking, policy)


def directive(**kw: Any) -> str:
    return "[[e3q " + " ".join(f"{k}={urllib.parse.quote(str(v))}" for k, v in kw.items()) + "]]"


@pytest.mark.parametrize(("template", "parser", "profile"), [
    ("kimi_k2", "kimi_k2", "kimi_k2"),
    ("kimi_k2_thinking", "kimi_k2", "kimi_k2"),  # Kimi-K2-Thinking: no <think> prefill, the model opens it
    ("qwen3", "qwen3", "qwen3"),
    ("deepseek_r1", "deepseek_r1", "deepseek_r1"),
])
def test_thinking_on_is_accepted_with_the_exact_stream(vllm_factory: Callable[..., VLLMServer], template: str,
                                                       parser: str, profile: str) -> None:
    server = vllm_factory(template, parser)
    tok = FastTokenizer(server.model_dir / "tokenizer.json")
    rp = resolve(get_profile(profile), tok.token_to_id, tok.vocab_size)
    for i in range(4):
        raw, v = ask(server, f"question {i}: why is the sky blue?", profile)
        assert v.ok, (v.reason, v.detail, raw["choices"][0])
        gen = raw["choices"][0]["token_ids"]
        assert gen.count(rp.close_id) == 1 and gen[-1] == rp.end_id
        assert raw["choices"][0]["finish_reason"] == "stop"
        # The sample is vLLM's own ids, and its prompt is what our template renders (the context sizing relies on it)
        messages = [{"role": "user", "content": f"question {i}: why is the sky blue?"}]
        assert raw["prompt_token_ids"] == tok.encode(render_prompt(rp.profile, messages, True)) or \
            template == "kimi_k2_thinking"
        assert v.reasoning and v.reasoning == raw["choices"][0]["message"]["reasoning"]


@pytest.mark.parametrize(("template", "parser", "profile"), [
    ("kimi_k2", "kimi_k2", "kimi_k2"),
    ("qwen3", "qwen3", "qwen3"),
])
def test_thinking_off_is_accepted_as_content(vllm_factory: Callable[..., VLLMServer], template: str, parser: str,
                                             profile: str) -> None:
    server = vllm_factory(template, parser)
    for i in range(3):
        raw, v = ask(server, f"plain answer {i}", profile, thinking=False)
        assert v.ok, (v.reason, v.detail, raw["choices"][0])
        msg = raw["choices"][0]["message"]
        assert msg["reasoning"] is None and msg["content"]


def test_thinking_off_under_the_r1_alias_takes_the_reasoning_as_the_answer(
        vllm_factory: Callable[..., VLLMServer]) -> None:
    """vLLM versions where `kimi_k2` was the deepseek_r1 parser's alias: with thinking off (no </think> in the stream)
    the whole answer comes back as `reasoning`, content null. Reproduced with the real deepseek_r1 parser."""
    server = vllm_factory("kimi_k2", "deepseek_r1")
    raw, v = ask(server, "alias answer", "kimi_k2", thinking=False)
    msg = raw["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning"]  # what the real parser does
    assert v.ok and v.content == msg["reasoning"] and v.reasoning is None


def test_close_marker_in_thinking_off_output_is_a_named_rejection(kimi: VLLMServer) -> None:
    """The dedicated kimi_k2 parser, thinking off: a generated `</think>` is not parsed, it shows up as content."""
    raw, v = ask(kimi, "think anyway " + directive(think=1), "kimi_k2", thinking=False)
    assert "</think>" in (raw["choices"][0]["message"]["content"] or "")
    assert not v.ok and v.reason in ("unexpected_reasoning", "marker_in_content")


def test_skip_special_tokens_true_would_lose_every_r1_sample(vllm_factory: Callable[..., VLLMServer]) -> None:
    """Why the client sends skip_special_tokens=false: deepseek_r1 honours true, and a special `</think>` is stripped
    before the split (content null)."""
    server = vllm_factory("deepseek_r1", "deepseek_r1")
    raw, v = ask(server, "special tokens", "deepseek_r1")
    assert v.ok
    raw_true, v_true = ask(server, "special tokens", "deepseek_r1", skip_special_tokens=True)
    assert raw_true["choices"][0]["message"]["content"] is None
    assert not v_true.ok


@pytest.mark.parametrize("text", ["答案是🙂", "emoji 🙂🙂", "日本語"])
def test_a_character_cut_in_its_bytes_at_the_end_is_held_back_and_accepted(kimi: VLLMServer, text: str) -> None:
    raw, v = ask(kimi, "cjk " + directive(text=text, cut=1), "kimi_k2")
    content = raw["choices"][0]["message"]["content"]
    assert "\ufffd" not in content  # vLLM's detokenizer held the incomplete character back
    assert v.ok, (v.reason, v.detail)


def test_a_character_cut_by_max_tokens_is_kept_under_the_keep_policy(kimi: VLLMServer) -> None:
    tok = FastTokenizer(kimi.model_dir / "tokenizer.json")
    assert len(tok.encode("🙂")) > 2  # the cut below really falls inside a character
    for n in (2, 5):  # reasoning, </think>, then the first n tokens of "🙂🙂🙂"
        raw, v = ask(kimi, "cut " + directive(reason=2, text="🙂🙂🙂", eos=0), "kimi_k2", max_tokens=3 + n,
                     policy="keep")
        assert raw["choices"][0]["finish_reason"] == "length"
        assert "\ufffd" not in (raw["choices"][0]["message"]["content"] or "")
        assert v.ok and v.truncated, (v.reason, v.detail)


def test_reasoning_then_end_of_turn_with_no_answer_is_accepted(kimi: VLLMServer) -> None:
    raw, v = ask(kimi, "no answer " + directive(answer=0), "kimi_k2")
    assert raw["choices"][0]["message"]["content"] in (None, "")
    assert v.ok and v.reasoning


@pytest.mark.parametrize(("kw", "reason"), [
    ({"close": 0}, "missing_think_close"),  # no </think>, runs to eos: the parser returns it all as reasoning
    ({"close": 2}, "multiple_think_close"),
    ({"open": 1}, "misplaced_think_open"),
])
def test_broken_wrapping_gets_its_named_reason(kimi: VLLMServer, kw: dict[str, int], reason: str) -> None:
    raw, v = ask(kimi, "broken " + directive(**kw), "kimi_k2")
    assert not v.ok and v.reason == reason, (v.reason, v.detail, raw["choices"][0])


def test_finish_reasons_other_than_stop_are_never_samples(kimi: VLLMServer) -> None:
    raw, v = ask(kimi, "long " + directive(eos=0), "kimi_k2", max_tokens=12)
    assert raw["choices"][0]["finish_reason"] == "length"
    assert not v.ok and v.reason == "truncated"
    raw, v = ask(kimi, "long " + directive(eos=0), "kimi_k2", max_tokens=12, policy="keep")
    assert v.ok and v.truncated

    raw, v = ask(kimi, "abort " + directive(finish="abort", at=6), "kimi_k2")
    assert raw["choices"][0]["finish_reason"] == "abort"
    assert not v.ok and v.reason == "aborted"


def test_an_engine_error_is_a_500_and_retried(kimi: VLLMServer) -> None:
    client = VLLMClient(None, 30, 2)
    req = ChatRequest(MODEL, [{"role": "user", "content": "err " + directive(finish="error", at=3)}], 0.6, 0.95, 50,
                      {"thinking": True})
    with pytest.raises(TransientError) as e:
        client.chat(kimi.url, req)
    assert e.value.kind == "http_500"


def test_context_errors_are_all_prompt_too_long(kimi: VLLMServer) -> None:
    client = VLLMClient(None, 30, 2)
    over = ChatRequest(MODEL, [{"role": "user", "content": "hi"}], 0.6, 0.95, MAX_MODEL_LEN + 1, {"thinking": True})
    with pytest.raises(PermanentError) as e:
        client.chat(kimi.url, over)
    assert e.value.reason == "prompt_too_long", e.value.detail
    long_prompt = " ".join(["word"] * (MAX_MODEL_LEN * 2))
    with pytest.raises(PermanentError) as e:
        client.chat(kimi.url, ChatRequest(MODEL, [{"role": "user", "content": long_prompt}], 0.6, 0.95, 16,
                                          {"thinking": True}))
    assert e.value.reason == "prompt_too_long", e.value.detail
    # prompt + max_tokens over the context: vLLM caps the generation silently (finish_reason=length)
    raw, v = ask(kimi, "cap " + directive(eos=0), "kimi_k2", max_tokens=MAX_MODEL_LEN - 5)
    assert raw["choices"][0]["finish_reason"] == "length"
    assert len(raw["prompt_token_ids"]) + len(raw["choices"][0]["token_ids"]) == MAX_MODEL_LEN
    assert v.reason == "truncated"


def test_models_reports_max_model_len_and_version_passes_the_floor(kimi: VLLMServer) -> None:
    models = httpx.get(kimi.url + "/models").json()
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    with httpx.Client() as http:
        assert check_version(http, kimi.url, get_profile("kimi_k2").min_vllm, "kimi_k2") == "0.33.0"


def test_a_second_stop_token_reported_in_stop_reason_is_accepted(tiny, tmp_path) -> None:  # noqa: ANN001
    """A model with two stop tokens in its generation_config (Qwen3 lists `<|im_end|>` and `<|endoftext|>`): vLLM
    stops on the second too and reports its id in `stop_reason`; it is in token_ids, not in the text."""
    server = start_vllm(tiny, tmp_path, "qwen3", "qwen3", extra_eos=("<|im_start|>",))
    try:
        tok = FastTokenizer(server.model_dir / "tokenizer.json")
        second = tok.token_to_id("<|im_start|>")
        raw, v = ask(server, "two stops " + directive(end="<|im_start|>"), "qwen3")
        choice = raw["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == second
        assert choice["token_ids"][-1] == second and "<|im_start|>" not in (choice["message"]["content"] or "")
        assert v.ok, (v.reason, v.detail)
        raw, v = ask(server, "one stop", "qwen3")  # the usual end of turn: no stop_reason
        assert raw["choices"][0]["stop_reason"] is None and v.ok
    finally:
        server.stop()
