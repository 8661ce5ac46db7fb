"""Fault injection by rate. Transient faults (5xx, 429, timeouts, dropped connections) are drawn per attempt, so a
retry can succeed; output faults (truncation, missing `</think>`, reasoning leaked into content, null token ids) are
drawn per prompt, so they are as deterministic as a greedy model and a retry gives the same answer."""

from __future__ import annotations

import hashlib
import random

TRANSIENT_FAULTS = ("5xx", "429", "timeout", "drop")
OUTPUT_FAULTS = ("truncate", "missing_close", "leak", "null_ids")
FAULTS = TRANSIENT_FAULTS + OUTPUT_FAULTS


def parse_faults(spec: str) -> dict[str, float]:
    """`"5xx=0.1,missing_close=0.05"` -> {"5xx": 0.1, "missing_close": 0.05}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rate = part.partition("=")
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        value = float(rate)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"fault rate for {name} must be within [0, 1], got {value}")
        out[name] = value
    return out


def prompt_fault(faults: dict[str, float], seed: int, prompt: str, name: str) -> bool:
    """Whether output fault `name` hits this prompt (a hash of the prompt: the same every time it is asked)."""
    rate = faults.get(name, 0.0)
    if rate <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(f"{name}|{seed}|{prompt}".encode()).digest()[:8], "big")
    return h / 2**64 < rate


def draw_transient(faults: dict[str, float], rng: random.Random) -> str | None:
    """The transient fault of this attempt, if any."""
    for name in TRANSIENT_FAULTS:
        rate = faults.get(name, 0.0)
        if rate and rng.random() < rate:
            return name
    return None
