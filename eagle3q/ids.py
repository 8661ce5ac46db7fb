"""Stable sample ids: the same prompt of the same data set, model and sampling settings always gets the same id."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def sample_id(dataset: str, row: int, turn: int, model: str, sampling: dict[str, Any], prompt: Any) -> str:
    # The prompt's digest is in the key too: an edited data set with the same row numbers gets new ids instead of
    # silently reusing finished samples of other prompts.
    key = json.dumps(
        {"dataset": dataset, "row": row, "turn": turn, "model": model, "sampling": sampling, "prompt": prompt},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
