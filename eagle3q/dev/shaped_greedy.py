"""Greedy decoding with the reasoning structure placed: how a random tiny target is made to answer like a reasoning
model (`<think>` reasoning `</think>` answer end-of-turn), in the simulator's plan (`eagle3q.sim.engine`) and in
vLLM's real engine (`eagle3q.dev.vllm_shaping`, a logits processor).

A random model never closes its reasoning or ends its turn on its own. This rule forces the markers at lengths drawn
from the prompt's ids (about 70/30 around a mean, as the simulator does) and keeps the model from emitting them
anywhere else; every other token is the model's own greedy choice. It serves thinking-mode requests (the prompt
either opened `<think>` or the model opens it first) and thinking-off ones (the prompt closed the block: an answer
only, as `deploy/first-contact.sh` asks for). Pure and deterministic, so a test computes the expected
tokens with transformers' greedy and the same rule (`hf_generate`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle3q.sim.textgen import output_lengths


@dataclass(frozen=True)
class ShapedGreedy:
    open_id: int
    close_id: int
    end_id: int
    prompt_opens_think: bool
    mean_tokens: int = 48

    @classmethod
    def for_profile(cls, profile: str, tokenizer_json: str, mean_tokens: int = 48) -> ShapedGreedy:
        from tokenizers import Tokenizer

        from eagle3q.generate.profiles import get_profile, resolve

        prof, tok = get_profile(profile), Tokenizer.from_file(tokenizer_json)
        ids = resolve(prof, tok.token_to_id, tok.get_vocab_size())
        return cls(ids.open_id, ids.close_id, ids.end_id, prof.prompt_opens_think, mean_tokens)

    @property
    def suppressed(self) -> list[int]:
        """Never chosen by the model itself: the markers, the end of turn and id 0 (the tokenizer's unknown)."""
        return sorted({self.open_id, self.close_id, self.end_id, 0})

    def lengths(self, prompt: Sequence[int]) -> tuple[int, int]:
        return output_lengths(",".join(map(str, prompt)), self.mean_tokens)

    def thinking_off(self, prompt: Sequence[int]) -> bool:
        """The generation prompt ends in a closed, empty reasoning block (Kimi-K2.5's `<think></think>`, Qwen3's
        `<think>\n\n</think>\n\n`): thinking is off for this request. Only the prompt's last tokens count: an
        earlier turn's closed block in the history says nothing about this one."""
        tail = list(prompt)[-4:]
        if self.close_id not in tail:
            return False
        close = len(tail) - 1 - tail[::-1].index(self.close_id)
        return self.open_id not in tail[close:]

    def forced(self, prompt: Sequence[int], out: Sequence[int]) -> int | None:
        """The token this position must be, or None where the model chooses (greedy, `suppressed` masked)."""
        n_reason, n_answer = self.lengths(prompt)
        n = len(out)
        if self.thinking_off(prompt):  # the template closed the reasoning: an answer, then the end of turn
            return self.end_id if n == n_answer else None
        lead = 0 if self.prompt_opens_think else 1
        if lead and n == 0:
            return self.open_id
        if n == lead + n_reason:
            return self.close_id
        if n == lead + n_reason + 1 + n_answer:
            return self.end_id
        return None


def hf_generate(model, rule: ShapedGreedy, prompt: list[int], max_tokens: int) -> list[int]:  # noqa: ANN001
    """The reference: transformers' greedy (fp32) under the rule, up to the end of turn or `max_tokens`."""
    import torch

    out: list[int] = []
    with torch.inference_mode():
        res = model(torch.tensor([prompt]), use_cache=True)
        while len(out) < max_tokens:
            forced = rule.forced(prompt, out)
            if forced is None:
                logits = res.logits[0, -1].clone()
                logits[rule.suppressed] = float("-inf")
                forced = int(logits.argmax())
            out.append(forced)
            if forced == rule.end_id:
                break
            res = model(torch.tensor([[forced]]), cache=res.past_key_values, use_cache=True)
    return out
