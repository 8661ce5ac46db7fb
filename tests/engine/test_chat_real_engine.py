"""eagle3q's vLLM client and validation on what vLLM's real engine generates: each family's template and reasoning
parser, the sample's ids against transformers' greedy on the same prompt ids (fp32, the same shaping rule)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from eagle3q.dev.shaped_greedy import ShapedGreedy, hf_generate
from eagle3q.dev.vllm_engine import Engine
from eagle3q.generate.profiles import get_profile, resolve
from eagle3q.generate.templates import render_prompt
from eagle3q.generate.tokenizer import FastTokenizer
from eagle3q.generate.validation import validate
from eagle3q.generate.vllm_client import ChatRequest, VLLMClient
from tests.engine.conftest import MODEL

QUESTIONS = ["why is the sky blue?", "write a haiku about rain", "what is 17 times 23?", "name three prime numbers"]


@pytest.fixture(scope="module")
def hf_model(tiny: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def _chat(engine: Engine, messages: list[dict[str, str]], profile: str, max_tokens: int) -> dict:
    req = ChatRequest(model=MODEL, messages=messages, temperature=0.0, top_p=1.0, max_tokens=max_tokens,
                      chat_template_kwargs=get_profile(profile).chat_template_kwargs(True))
    client = VLLMClient(None, 120, 4)
    try:
        return client.chat(engine.url, req)
    finally:
        client.close()


@pytest.mark.parametrize("profile", ["kimi_k2", "qwen3", "deepseek_r1"])
def test_real_engine_samples_are_accepted_and_equal_hf_greedy(generator: Callable, hf_model, profile: str) -> None:  # noqa: ANN001
    engine, model_dir = generator(profile)
    tok = FastTokenizer(model_dir / "tokenizer.json")
    rp = resolve(get_profile(profile), tok.token_to_id, tok.vocab_size)
    rule = ShapedGreedy.for_profile(profile, str(model_dir / "tokenizer.json"))
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        raw = _chat(engine, messages, profile, 400)
        v = validate(raw, rp, tok, True)
        assert v.ok, (profile, v.reason, v.detail, raw["choices"][0])
        prompt, gen = raw["prompt_token_ids"], raw["choices"][0]["token_ids"]
        # vLLM's rendering of the family's template is ours, token for token (the stored prompt relies on it) ...
        assert prompt == tok.encode(render_prompt(rp.profile, messages, True))
        # ... and what the engine generated is the model's greedy stream on those ids, markers where the rule puts them
        assert gen == hf_generate(hf_model, rule, prompt, 400)
        assert gen.count(rp.close_id) == 1 and gen[-1] == rp.end_id
        # vLLM's parser split the reasoning where our validation does
        assert v.reasoning == raw["choices"][0]["message"]["reasoning"] and v.reasoning


def test_real_engine_truncation_is_rejected_by_name(generator: Callable) -> None:
    engine, model_dir = generator("kimi_k2")
    tok = FastTokenizer(model_dir / "tokenizer.json")
    rp = resolve(get_profile("kimi_k2"), tok.token_to_id, tok.vocab_size)
    raw = _chat(engine, [{"role": "user", "content": QUESTIONS[0]}], "kimi_k2", 5)
    v = validate(raw, rp, tok, True)
    assert raw["choices"][0]["finish_reason"] == "length"
    assert not v.ok and v.reason == "truncated"
