"""What makes two prompts "the same", for the held-out split and for duplicates (issue 22.1).

- `prompt_key`: the whole prompt (every message up to the turn generated), whitespace collapsed. Two rows with the
  same key render the same token ids: at temperature 0 their completions are the same text, so `enqueue` sends the
  first and marks the others rejected `duplicate_prompt` in the inference stage (generation wasted otherwise; the
  ledger names the row each repeats); when sampling, each is more data and all are sent.
- `split_key`: the conversation's opening (its system message and first user message), case-folded and whitespace
  collapsed. The held-out split hashes it, so every turn of a conversation, every repeat of a prompt, and any two
  conversations that open alike fall on the same side: no held-out prompt equals (or starts as) a training prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping


def _norm(text: str) -> str:
    return " ".join(str(text).split())


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()[:32]


def _pairs(messages: Iterable[Mapping[str, str] | object]) -> list[tuple[str, str]]:
    out = []
    for m in messages:
        role = m["role"] if isinstance(m, Mapping) else m.role  # dicts (sources) or Message models (samples)
        content = m["content"] if isinstance(m, Mapping) else m.content
        out.append((str(role), str(content or "")))
    return out


def prompt_key(messages: Iterable[Mapping[str, str] | object]) -> str:
    return _digest([[r, _norm(c)] for r, c in _pairs(messages)])


def split_key(messages: Iterable[Mapping[str, str] | object]) -> str:
    pairs = _pairs(messages)
    system = [_norm(c).casefold() for r, c in pairs if r == "system"][:1]
    first_user = next((_norm(c).casefold() for r, c in pairs if r == "user"), "")
    return "prompt:" + _digest([system, first_user])
