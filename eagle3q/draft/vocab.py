"""The draft vocabulary: the N target tokens seen most often where the loss applies, sorted by id.

`d2t[i] = selected[i] - i` (offsets: vLLM adds them to draft ids to get target ids) and `t2d` is a bool mask over the
target vocabulary. Both go into the checkpoint: without `d2t`, vLLM reads draft ids as target ids and acceptance
silently collapses."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from eagle3q.store import Store
from eagle3q.store.run_store import VOCAB


def count_tokens(store: Store, run: str, ids: Iterable[str], vocab_size: int) -> torch.Tensor:
    """Where the loss applies, how often each target token occurs in the samples `ids` (their ids and masks only,
    read from the store in parallel)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tok, mask in store.map_samples(lambda sid: store.hidden_tokens(run, sid), ids):
        picked = torch.from_numpy(tok.astype("int64"))[torch.from_numpy(mask.astype(bool))]
        counts += torch.bincount(picked, minlength=vocab_size)[:vocab_size]
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


def load_vocab(store: Store, run: str) -> dict[str, torch.Tensor] | None:
    """The run's frozen vocabulary (d2t, t2d, counts, coverage), None before it was built."""
    from safetensors.torch import load

    if not store.has_artifact(run, VOCAB):
        return None
    return load(store.get_artifact(run, VOCAB))


def build_vocab(store: Store, run: str, ids: list[str], vocab_size: int,
                n: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """d2t, t2d and coverage, computed once per run from the samples `ids` and kept in the store (train/
    vocab.safetensors: a resumed trainer reads them back)."""
    from safetensors.torch import save

    t = load_vocab(store, run)
    if t is not None:
        return t["d2t"], t["t2d"].bool(), float(t["coverage"])
    counts = count_tokens(store, run, ids, vocab_size)
    d2t, t2d = build_mapping(counts, n)
    cov = coverage(counts, t2d)
    store.put_artifact(run, VOCAB, save({"d2t": d2t, "t2d": t2d, "counts": counts, "coverage": torch.tensor(cov)}))
    return d2t, t2d, cov
