"""`eagle3q check-extraction`: before a long run, one sample through the extraction server, printed raw, and the
checks that decide whether its hidden states will be right (issue 21.5; `deploy/first-contact.sh` does the same for
generation):
  - the generation server answers one greedy request with its token ids (the sample: the target's own text), or
    with `--run RUN` one accepted sample of that run is taken from the store (the generation server stopped);
  - the extraction server's /version, and whether it is new enough for this target's final layer;
  - the file holds one state per configured layer id (the target's L and the aux ids), finite, one row per token;
  - the consistency check: the final state predicts the sample's next tokens (greedy: >= EAGLE3Q_HS_CHECK_MIN_GREEDY),
    best at the stored alignment. A wrong layer or a shifted state fails here, before 10,000 prompts are spent.
Returns False (the command exits 1) when a check fails."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from eagle3q.config import Settings

PROMPT = "Explain in three sentences why the sky is blue."


def _generate(s: Settings, headers: dict[str, str]) -> tuple[list[int], list[int]]:
    """One greedy chat completion from the first generation server: (prompt ids, generated ids)."""
    base = s.vllm_base_urls[0].rstrip("/")
    body = {"model": s.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 128,
            "temperature": 0, "return_token_ids": True, "skip_special_tokens": False,
            "chat_template_kwargs": {"thinking": s.thinking, "enable_thinking": s.thinking}}
    r = httpx.post(f"{base}/chat/completions", json=body, headers=headers, timeout=s.request_timeout_s)
    r.raise_for_status()
    resp = r.json()
    prompt, gen = resp.get("prompt_token_ids"), resp["choices"][0].get("token_ids")
    if prompt is None or gen is None:
        raise ValueError(f"{base} returned no token ids (needs vLLM >= 0.10.2 with return_token_ids): {resp}")
    return prompt, gen


def _stored(s: Settings, run: str) -> tuple[list[int], list[int], bool]:
    """One accepted sample of `run` from the store: (prompt ids, generated ids, generated greedily). For the hand-off
    on one GPU box, where the generation server is stopped before the extraction server starts."""
    from eagle3q.contract import INFERENCE
    from eagle3q.control.ledger import Ledger
    from eagle3q.store import Store

    ids = sorted(Ledger.from_url(s.broker_url()).done_ids(run, INFERENCE.name))
    if not ids:
        raise ValueError(f"run {run} has no accepted sample yet")
    sample = Store.from_settings(s).read_sample(run, ids[0])
    n = sample.num_prompt_tokens
    return sample.input_ids[:n], sample.input_ids[n:], sample.sampling.temperature == 0


def check_extraction(s: Settings, say: Callable[[str], None], run: str | None = None) -> bool:
    import torch

    from eagle3q.extraction.consistency import ConsistencyCheck
    from eagle3q.extraction.transformers_backend import check_tensors
    from eagle3q.extraction.vllm_backend import VllmExtractor

    key = s.vllm_api_key.get_secret_value() if s.vllm_api_key else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ok = True

    def check(name: str, passed: bool, detail: str = "") -> None:
        nonlocal ok
        ok = ok and passed
        say(f"  [{'ok' if passed else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))

    if run is None:
        say(f"== generation server {s.vllm_base_urls[0]} (model {s.model}): one greedy sample")
        prompt, gen = _generate(s, headers)
        greedy = True
    else:
        prompt, gen, greedy = _stored(s, run)
        say(f"== one accepted sample of run {run} from the store ({'greedy' if greedy else 'sampled'})")
    say(f"prompt_token_ids ({len(prompt)}): {prompt}")
    say(f"token_ids ({len(gen)}): {gen}")
    root = s.hs_vllm_base_url.rstrip("/").removesuffix("/v1")
    say(f"== extraction server {s.hs_vllm_base_url}")
    try:
        say(f"/version: {httpx.get(f'{root}/version', headers=headers, timeout=10).text.strip()}")
    except httpx.HTTPError as e:
        say(f"/version: unreachable ({e})")
    ex = VllmExtractor(s.hs_vllm_base_url, s.model, s.target_model, s.aux_layer_ids, 1, s.hs_vllm_timeout_s, key)
    try:
        say(f"target {s.target_model}: L={ex.num_layers} H={ex.hidden_size}; layer ids asked "
            f"{[*ex.aux_ids, ex.num_layers]} (aux, then the final layer's output)")
        ids = prompt + gen
        try:
            out = ex.extract([ids])[0]
        except Exception as e:  # noqa: BLE001 - printed raw: a refusal (server too old) or a failure to reach it
            check("the extraction server answered", False, f"{type(e).__name__}: {e}")
            return False
        if out.reason is not None:
            check("the extraction server returned the states", False, f"{out.reason}: {out.detail}")
            return False
        say(f"aux_hidden_states {tuple(out.aux.shape)} {out.aux.dtype}, final {tuple(out.final.shape)}")
        reason = check_tensors(ids, out, ex.hidden_size)
        check(f"{len(ex.aux_ids) + 1} states of {ex.hidden_size} for each of the {len(ids)} tokens, finite",
              reason is None, reason or "")
        if reason is not None:
            return False
    finally:
        ex.close()
    cc = ConsistencyCheck(s.target_model, s.hs_check_positions or 32, s.hs_check_min, s.hs_check_min_greedy,
                          tokenizer=s.tokenizer or None)
    a = cc.agreement("first-contact", ids, [0] * len(prompt) + [1] * len(gen),
                     out.final.to(torch.bfloat16), ex.final_state)
    say("consistency: " + json.dumps({**a.as_meta(), "by_offset(-1,0,+1)": list(a.by_offset)}))
    threshold = cc.min_greedy if greedy else cc.min_agreement
    check(f"the final state predicts the next token ({'greedy ' if greedy else ''}threshold {threshold}) at the "
          "stored alignment", cc.passes(a, greedy=greedy), f"top-1 {a.top1:.3f}, best offset {a.offset}")
    say("== all checks passed" if ok else "== a check failed: fix it before enqueueing")
    return ok
