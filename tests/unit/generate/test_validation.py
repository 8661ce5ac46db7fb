"""The wrapping checks, on responses built by the simulator's own generator (the same code its server runs)."""

from __future__ import annotations

import copy

import pytest

from eagle3q.generate.profiles import KIMI_K2, QWEN3, ProfileMismatch, get_profile, resolve
from eagle3q.generate.tokenizer import load_tokenizer
from eagle3q.generate.validation import REASONS, validate
from eagle3q.sim.server import SimConfig, Simulator

MESSAGES = [{"role": "user", "content": "Explain binary search to a high school student."}]


def make(tok_dir, profile="kimi_k2", faults=None, **kw):  # noqa: ANN001, ANN003, ANN201
    sim = Simulator(SimConfig(tokenizer=str(tok_dir), profile=profile, faults=faults or {}, **kw))
    return sim, resolve(get_profile(profile), sim.tok.token_to_id, sim.tok.vocab_size)


def respond(sim: Simulator, thinking: bool = True, max_tokens: int = 4096, messages=MESSAGES) -> dict:  # noqa: ANN001
    return sim._response({"return_token_ids": True}, sim.generate(messages, thinking, max_tokens))


@pytest.mark.parametrize("profile", ["kimi_k2", "qwen3", "deepseek_r1"])
def test_clean_response_is_accepted_token_exact(tiny_tokenizer, profile):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer, profile)
    resp = respond(sim)
    v = validate(resp, rp, sim.tok, thinking=True)
    assert v.ok, v
    assert v.prompt_ids == resp["prompt_token_ids"] and v.gen_ids == resp["choices"][0]["token_ids"]
    assert v.gen_ids.count(rp.close_id) == 1
    # Kimi's template opens <think> in the prompt: the stream starts inside the reasoning.
    assert (v.gen_ids[0] == rp.open_id) is (not get_profile(profile).prompt_opens_think)


def test_thinking_off_has_no_markers_and_is_accepted(tiny_tokenizer):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer)
    resp = respond(sim, thinking=False)
    assert resp["choices"][0]["message"]["reasoning"] is None
    assert validate(resp, rp, sim.tok, thinking=False).ok
    # ... and a thinking-on sample presented as thinking off is caught
    assert validate(respond(sim), rp, sim.tok, thinking=False).reason == "unexpected_reasoning"


def test_old_reasoning_content_field_is_read(tiny_tokenizer):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer, expose_reasoning_content=True)
    resp = respond(sim)
    msg = resp["choices"][0]["message"]
    msg.pop("reasoning")
    assert msg["reasoning_content"]
    assert validate(resp, rp, sim.tok, thinking=True).ok


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("missing_close", "missing_think_close"), ("leak", "marker_in_content"), ("null_ids", "null_token_ids"),
     ("truncate", "truncated")],
)
def test_each_simulated_fault_has_its_reason(tiny_tokenizer, fault, reason):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer, faults={fault: 1.0})
    v = validate(respond(sim), rp, sim.tok, thinking=True)
    assert not v.ok and v.reason == reason, v


def test_truncation_kept_by_policy_is_flagged(tiny_tokenizer):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer)
    resp = respond(sim, max_tokens=5)
    assert resp["choices"][0]["finish_reason"] == "length"
    assert validate(resp, rp, sim.tok, True, "reject").reason == "truncated"
    kept = validate(resp, rp, sim.tok, True, "keep")
    assert kept.ok and kept.truncated


def test_tampered_responses_are_rejected(tiny_tokenizer):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer)
    base = respond(sim)

    def variant(fn):  # noqa: ANN001, ANN202
        r = copy.deepcopy(base)
        fn(r)
        return validate(r, rp, sim.tok, thinking=True).reason

    ch = lambda r: r["choices"][0]  # noqa: E731
    assert variant(lambda r: r["usage"].update(completion_tokens=1)) == "usage_mismatch"
    assert variant(lambda r: r.update(prompt_token_ids=None)) == "null_token_ids"

    def insert(r: dict, tid: int) -> None:
        ch(r)["token_ids"].insert(3, tid)
        r["usage"]["completion_tokens"] += 1

    assert variant(lambda r: insert(r, rp.close_id)) == "multiple_think_close"
    assert variant(lambda r: insert(r, rp.open_id)) == "misplaced_think_open"
    assert variant(lambda r: ch(r)["message"].update(reasoning="")) == "missing_reasoning"
    assert variant(lambda r: ch(r)["message"].update(reasoning="something else")) == "reasoning_mismatch"
    assert variant(lambda r: ch(r)["message"].update(content="another answer")) == "content_mismatch"
    assert variant(lambda r: r.update(choices=[])) == "malformed_response"
    assert variant(lambda r: ch(r).update(token_ids=["x"])) == "malformed_response"
    assert all(x in REASONS for x in ("usage_mismatch", "marker_in_content"))


def test_profile_ids_are_checked_against_a_real_sized_tokenizer(tiny_tokenizer):  # noqa: ANN001
    tok = load_tokenizer(str(tiny_tokenizer))
    # The tiny tokenizer is too small to be Kimi's: ids are looked up, not assumed.
    rp = resolve(KIMI_K2, tok.token_to_id, tok.vocab_size)
    assert rp.close_id == tok.token_to_id("</think>")
    # A tokenizer as large as Kimi's with other ids is refused at start-up.
    with pytest.raises(ProfileMismatch):
        resolve(KIMI_K2, tok.token_to_id, 200_000)
    assert resolve(QWEN3, tok.token_to_id, tok.vocab_size).open_id == tok.token_to_id("<think>")


def test_only_stop_and_kept_length_are_samples(tiny_tokenizer):  # noqa: ANN001
    """vLLM's other finish reasons end a generation that is no sample, even when </think> was already emitted."""
    sim, rp = make(tiny_tokenizer)
    base = respond(sim)
    for finish, reason in (("abort", "aborted"), ("error", "engine_error"), ("repetition", "repetition"),
                           ("cancelled", "unknown_finish")):
        r = copy.deepcopy(base)
        r["choices"][0]["finish_reason"] = finish
        assert validate(r, rp, sim.tok, thinking=True).reason == reason, finish
    assert validate(base, rp, sim.tok, thinking=True).ok


def test_the_stop_token_vllm_reports_is_not_part_of_the_content(tiny_tokenizer):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer)
    r = respond(sim, thinking=False)
    stop_id = sim.tok.encode("Q")[0]  # a custom stop token (`stop_token_ids`), not the end-of-turn id
    ch = r["choices"][0]
    assert ch["token_ids"][-1] == rp.end_id
    ch["token_ids"][-1] = stop_id
    assert validate(r, rp, sim.tok, thinking=False).reason == "content_mismatch"  # its text is not in content
    ch["stop_reason"] = stop_id  # what vLLM reports when a stop token ended the generation
    assert validate(r, rp, sim.tok, thinking=False).ok


def test_a_character_cut_by_the_end_of_the_generation_is_held_back_like_vllm(tiny_tokenizer):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer)
    r = respond(sim, thinking=False)
    ch = r["choices"][0]
    text = "answer: 你好"
    ids = sim.tok.encode(text)
    assert "\ufffd" in sim.tok.decode(ids[:-1])  # the byte-level tokenizer splits the character: the cut is real
    ch["token_ids"] = ids[:-1]
    ch["finish_reason"] = "length"
    ch["message"]["content"] = "answer: 你"  # vLLM's detokenizer holds the incomplete bytes back
    r["usage"]["completion_tokens"] = len(ids) - 1
    v = validate(r, rp, sim.tok, thinking=False, truncation_policy="keep")
    assert v.ok and v.truncated, v
    ch["message"]["content"] = "answer: 你X"
    assert validate(r, rp, sim.tok, thinking=False, truncation_policy="keep").reason == "content_mismatch"


def test_every_context_error_is_prompt_too_long(tiny_tokenizer, tmp_path):  # noqa: ANN001
    """max_tokens over max_model_len is vLLM's 400 "cannot be greater than max_model_len": the same named rejection
    as a prompt over the context (the inference stage sizes max_tokens so that it does not happen)."""
    from eagle3q.dev.local import start_sim
    from eagle3q.generate.vllm_client import ChatRequest, PermanentError, VLLMClient

    proc, url = start_sim(str(tiny_tokenizer), tmp_path / "logs", extra=["--max-model-len", "300"])
    client = VLLMClient(None, 10, 4)
    try:
        for max_tokens, msg in ((5000, "hi"), (10, "tell me more " * 400)):
            req = ChatRequest(model="moonshotai/Kimi-K2.5", messages=[{"role": "user", "content": msg}],
                              temperature=0.6, top_p=0.95, max_tokens=max_tokens, chat_template_kwargs={})
            with pytest.raises(PermanentError) as e:
                client.chat(url, req)
            assert e.value.reason == "prompt_too_long", e.value.detail
    finally:
        client.close()
        proc.kill()


def test_who_opens_think_is_read_from_the_prompt(tiny_tokenizer):  # noqa: ANN001
    """Kimi-K2.5 pre-fills <think> in the prompt; Kimi-K2-Thinking (same profile, same parser) generates it."""
    sim, rp = make(tiny_tokenizer)
    r = respond(sim)
    assert r["prompt_token_ids"][-1] == rp.open_id  # K2.5: the template opened it
    assert validate(r, rp, sim.tok, thinking=True).ok
    k2t = copy.deepcopy(r)  # K2-Thinking: the prompt ends before <think>, the stream starts with it
    k2t["prompt_token_ids"] = k2t["prompt_token_ids"][:-1]
    k2t["choices"][0]["token_ids"].insert(0, rp.open_id)
    k2t["usage"]["prompt_tokens"] -= 1
    k2t["usage"]["completion_tokens"] += 1
    assert validate(k2t, rp, sim.tok, thinking=True).ok
    both = copy.deepcopy(r)  # opened twice: in the prompt and again in the stream
    both["choices"][0]["token_ids"].insert(0, rp.open_id)
    both["usage"]["completion_tokens"] += 1
    assert validate(both, rp, sim.tok, thinking=True).reason == "misplaced_think_open"


def test_thinking_off_answer_returned_as_reasoning_by_the_r1_alias_is_the_answer(tiny_tokenizer):  # noqa: ANN001
    sim, rp = make(tiny_tokenizer)
    r = respond(sim, thinking=False)
    msg = r["choices"][0]["message"]
    msg["reasoning"], msg["content"] = msg["content"], None  # what the deepseek_r1 alias returns without </think>
    v = validate(r, rp, sim.tok, thinking=False)
    assert v.ok and v.content and v.reasoning is None
    msg["reasoning"] = "something else entirely"
    assert validate(r, rp, sim.tok, thinking=False).reason == "content_mismatch"
