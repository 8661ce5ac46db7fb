"""Deterministic "model output": reasoning and answer text derived from the prompt, so that the same prompt always
gives the same tokens (like greedy decoding), with lengths drawn around a configured mean."""

from __future__ import annotations

import hashlib
import random
import re

_FILLER = tuple(
    "first let me restate the question so the answer stays on track . "
    "the key facts are given in the prompt and i should check each one . "
    "so the result follows step by step and i will verify it at the end . "
    "wait , i should double check the edge cases before answering . "
    "therefore the answer is clear and i can write it down now .".split(" ")
)

_WORD = re.compile(r"[A-Za-z][A-Za-z']{1,14}")


def _rng(prompt: str, salt: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(f"{salt}|{prompt}".encode()).digest()[:8], "big"))


def words_for(prompt: str, n_words: int, salt: str) -> str:
    """A word stream mixing the prompt's own words with a fixed reasoning vocabulary."""
    rng = _rng(prompt, salt)
    bank = [w.lower() for w in _WORD.findall(prompt)][:200] or ["answer"]
    out = []
    for _ in range(n_words):
        out.append(rng.choice(bank) if rng.random() < 0.35 else rng.choice(_FILLER))
    return " ".join(out)


def output_lengths(prompt: str, mean_tokens: int) -> tuple[int, int]:
    """(reasoning tokens, answer tokens) for this prompt: about 70/30, total within +-50% of the mean."""
    rng = _rng(prompt, "len")
    total = max(4, int(mean_tokens * rng.uniform(0.5, 1.5)))
    reasoning = max(2, int(total * 0.7))
    return reasoning, max(2, total - reasoning)
