"""Validation of a chat completion before it becomes a training sample.

The sample is the exact token stream (`prompt_token_ids + token_ids`); the text fields (`reasoning`, `content`) are
only used to check that the stream is wrapped the way the model really emits it. Each failure has a named reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3q.generate.profiles import ResolvedProfile
from eagle3q.generate.tokenizer import TokenizerLike

# Every reason a response can be rejected for; `eagle3q status` and the tests use these names.
REASONS = (
    "malformed_response",  # no choices / message, wrong types
    "null_token_ids",  # return_token_ids ignored or lost (old reasoning-parser paths)
    "usage_mismatch",  # len(token_ids) != completion_tokens or len(prompt_token_ids) != prompt_tokens
    "truncated",  # finish_reason == "length" (with truncation_policy=reject)
    "aborted",  # finish_reason == "abort": the engine gave up on the request (a partial generation is no sample)
    "engine_error",  # finish_reason == "error"
    "repetition",  # finish_reason == "repetition" (vLLM's repetition detection stopped it)
    "unknown_finish",  # any other finish reason: only "stop" (and "length" kept by policy) is a sample
    "empty_generation",
    "missing_reasoning",  # thinking on, but no reasoning came back
    "missing_think_close",  # thinking on, no </think> in the token stream
    "multiple_think_close",
    "misplaced_think_open",  # <think> generated where the template already opened it, or after </think>
    "unexpected_reasoning",  # thinking off, but markers or reasoning are present
    "marker_in_content",  # a <think>/</think> marker leaked into the content text
    "reasoning_mismatch",  # decoded reasoning tokens differ from the reasoning text
    "content_mismatch",  # decoded content tokens differ from the content text
)


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    detail: str = ""
    prompt_ids: list[int] | None = None
    gen_ids: list[int] | None = None
    reasoning: str | None = None
    content: str | None = None
    finish_reason: str = ""
    truncated: bool = False


def _reject(reason: str, detail: str, **kw: Any) -> Verdict:
    assert reason in REASONS, reason
    return Verdict(ok=False, reason=reason, detail=detail, **kw)


def _norm(text: str | None) -> str:
    # vLLM's reasoning parsers strip surrounding whitespace of the parts; token decoding keeps it.
    return (text or "").strip()


def _int_list(v: Any) -> bool:
    # `type(x) is int` also refuses bools; one pass in C for the type, one for the sign (thousands of ids a sample).
    return isinstance(v, list) and all(type(x) is int for x in v) and (not v or min(v) >= 0)


def validate(
    resp: dict[str, Any],
    rp: ResolvedProfile,
    tok: TokenizerLike,
    thinking: bool,
    truncation_policy: str = "reject",
) -> Verdict:
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return _reject("malformed_response", "no choices in the response")
    choice = choices[0]
    msg = choice.get("message")
    if not isinstance(msg, dict):
        return _reject("malformed_response", "choice has no message object")
    # New vLLM: `reasoning`; older: `reasoning_content`. Read both.
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    content = msg.get("content")
    if not isinstance(reasoning, str | None) or not isinstance(content, str | None):
        return _reject("malformed_response", "reasoning/content are not strings")
    finish = str(choice.get("finish_reason") or "")
    gen, prompt = choice.get("token_ids"), resp.get("prompt_token_ids")
    base = {"reasoning": reasoning, "content": content, "finish_reason": finish}
    if gen is None or prompt is None:
        which = "token_ids" if gen is None else "prompt_token_ids"
        return _reject("null_token_ids", f"{which} is null: the server ignored return_token_ids", **base)
    if not _int_list(gen) or not _int_list(prompt):
        return _reject("malformed_response", "token ids are not lists of non-negative integers", **base)
    base.update(prompt_ids=prompt, gen_ids=gen)

    usage = resp.get("usage") or {}
    if usage.get("completion_tokens") != len(gen) or usage.get("prompt_tokens") != len(prompt):
        return _reject(
            "usage_mismatch",
            f"ids {len(prompt)}+{len(gen)} vs usage {usage.get('prompt_tokens')}+{usage.get('completion_tokens')}",
            **base,
        )
    if not gen:
        return _reject("empty_generation", "no tokens were generated", **base)
    if finish not in ("stop", "length"):
        named = {"abort": "aborted", "error": "engine_error", "repetition": "repetition"}.get(finish, "unknown_finish")
        return _reject(named, f"finish_reason={finish!r} after {len(gen)} tokens", **base)
    truncated = finish == "length"
    if truncated and truncation_policy == "reject":
        return _reject("truncated", f"finish_reason=length after {len(gen)} tokens", truncated=True, **base)

    markers = (rp.profile.think_open, rp.profile.think_close)
    if any(m in (content or "") for m in markers):
        return _reject("marker_in_content", "a reasoning marker appears in the content text", **base)

    n_open, n_close = gen.count(rp.open_id), gen.count(rp.close_id)
    # The stop token is in token_ids but not in the text: the end-of-turn id, or whichever stop token vLLM reports.
    stop = choice.get("stop_reason")
    body = gen[:-1] if gen[-1] == rp.end_id or (isinstance(stop, int) and gen[-1] == stop) else gen
    if not thinking:
        if n_open or n_close:
            return _reject("unexpected_reasoning", "thinking is off but the model emitted reasoning markers", **base)
        if _norm(reasoning) and not _norm(content):
            # vLLM versions where `kimi_k2` is the deepseek_r1 parser's alias: with no </think> in the stream the
            # whole answer comes back as `reasoning`, content null. The ids are the answer; the text is checked.
            verdict = _check_text(tok.decode(body), reasoning, "content_mismatch", truncated, base)
            if verdict.ok:
                verdict.content, verdict.reasoning = reasoning, None
            return verdict
        if _norm(reasoning):
            return _reject("unexpected_reasoning", "thinking is off but reasoning came back", **base)
        return _check_text(tok.decode(body), content, "content_mismatch", truncated, base)

    if not _norm(reasoning):
        return _reject("missing_reasoning", "thinking is on but the response has no reasoning", **base)
    if n_close == 0:
        if truncated:  # kept by policy: the stream was cut inside the reasoning
            return Verdict(ok=True, truncated=True, **base)
        return _reject("missing_think_close", "no </think> in the generated tokens", **base)
    if n_close > 1:
        return _reject("multiple_think_close", f"{n_close} </think> tokens in the generation", **base)
    close_at = gen.index(rp.close_id)
    # Who opens <think> is read from this request's prompt, not fixed per profile: Kimi-K2.5's template pre-fills it,
    # Kimi-K2-Thinking's does not (the model generates it), under the same parser.
    prompt_opened = rp.open_id in prompt[-3:]
    allowed_open = 0 if prompt_opened else 1
    if n_open > allowed_open or (n_open == 1 and gen[0] != rp.open_id):
        return _reject("misplaced_think_open", f"{n_open} <think> tokens, expected {allowed_open} at the start", **base)
    if allowed_open and n_open == 0:
        return _reject("misplaced_think_open", "the stream has no <think> and the prompt did not open one", **base)

    reason_ids = [t for t in gen[:close_at] if t != rp.open_id]
    verdict = _check_text(tok.decode(reason_ids), reasoning, "reasoning_mismatch", truncated, base)
    if not verdict.ok:
        return verdict
    return _check_text(tok.decode(body[close_at + 1 :]), content, "content_mismatch", truncated, base)


def _check_text(decoded: str, text: str | None, reason: str, truncated: bool, base: dict[str, Any]) -> Verdict:
    # vLLM's detokenizer holds back a trailing incomplete UTF-8 sequence (a CJK character or an emoji cut by the end
    # of the generation); decoding the ids gives U+FFFD there instead.
    decoded = decoded.rstrip("\ufffd") if not (text or "").endswith("\ufffd") else decoded
    if _norm(decoded) != _norm(text):
        a, b = _norm(decoded), _norm(text)
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return _reject(reason, f"tokens and text differ at char {i}: {a[i:i + 40]!r} vs {b[i:i + 40]!r}", **base)
    return Verdict(ok=True, truncated=truncated, **base)
