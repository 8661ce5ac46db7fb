"""A draft with random weights over the tiny target, exported as eagle3q exports it: what the peers' and vLLM's
readers are given in tests/peers and tests/conformance."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from eagle3q.draft.export import draft_files
from eagle3q.draft.model import DraftConfig, Eagle3Draft
from eagle3q.draft.vocab import build_mapping
from eagle3q.store import write_atomic
from eagle3q.target import load_target_tensors, target_config


def random_export(tiny: Path, out: Path, aux: list[int], draft_vocab: int = 256,  # noqa: ANN201
                  norms: str | dict[str, bool] = "speculators"):
    """-> (target config, target tensors, draft config, draft, d2t, t2d), the draft exported to `out`; `norms`:
    the draft layout (Settings.draft_norms), or each norm switch by name."""
    tc, tensors = target_config(tiny), load_target_tensors(tiny)
    torch.manual_seed(0)
    if isinstance(norms, str):
        c = DraftConfig.from_target(tc, draft_vocab, norms)
    else:
        c = dataclasses.replace(DraftConfig.from_target(tc, draft_vocab, "eagle3"), **norms)
    draft = Eagle3Draft(c, tensors["embed"])
    for p in draft.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    d2t, t2d = build_mapping(torch.randint(0, 100, (tc["vocab_size"],)), draft_vocab)
    for name, data in draft_files(draft, c, d2t, t2d, aux).items():
        write_atomic(out / name, data)
    return tc, tensors, c, draft, d2t, t2d
