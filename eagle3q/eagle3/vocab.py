"""The draft vocabulary: the N target tokens seen most often where the loss applies, sorted by id.

`d2t[i] = selected[i] - i` (offsets: vLLM adds them to draft ids to get target ids) and `t2d` is a bool mask over the
target vocabulary. Both go into the checkpoint: without `d2t`, vLLM reads draft ids as target ids and acceptance
silently collapses."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from eagle3q.store import write_atomic


def count_tokens(files: Iterable[Path], vocab_size: int) -> torch.Tensor:
    from safetensors import safe_open

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            ids = st.get_tensor("input_ids")
            mask = st.get_tensor("loss_mask").bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def build_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [N] int64, t2d [V] bool). Ties broken by lower id; unseen tokens fill up to N so shapes are fixed."""
    vocab = counts.numel()
    n = min(draft_vocab_size, vocab)
    order = torch.argsort(-counts, stable=True)[:n]  # by count, ties by lower id
    selected = torch.sort(order).values
    d2t = selected - torch.arange(n, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(d2t.numel(), dtype=torch.long)


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def build_vocab(files: list[Path], vocab_size: int, n: int, out: Path) -> tuple[torch.Tensor, torch.Tensor, float]:
    """d2t, t2d and coverage, computed once per run and kept in `out` (a resumed trainer reads them back)."""
    from safetensors.torch import load_file, save

    if out.is_file():
        t = load_file(str(out))
        return t["d2t"], t["t2d"].bool(), float(t["coverage"])
    counts = count_tokens(files, vocab_size)
    d2t, t2d = build_mapping(counts, n)
    cov = coverage(counts, t2d)
    write_atomic(out, save({"d2t": d2t, "t2d": t2d, "counts": counts, "coverage": torch.tensor(cov)}))
    return d2t, t2d, cov
