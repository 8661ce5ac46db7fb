"""Training checkpoints without pickle: safetensors for the weights and the optimizer's moments, JSON metadata for
the step and the rest of the schedule, as one object in the store (train/checkpoint.safetensors). A redelivered
training task resumes where the lost one stopped, on whichever machine it lands."""

from __future__ import annotations

import json

import torch

from eagle3q.draft.model import NORM_LAYOUTS, Eagle3Draft
from eagle3q.store.safetensors_format import parse_header


def checkpoint_bytes(model: Eagle3Draft, opt: torch.optim.Optimizer, state: dict) -> bytes:
    from safetensors.torch import save

    state = {**state, "draft_norms": model.c.norms()}
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items() if not k.startswith("embed")}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        st = opt.state.get(p, {})
        for name in ("exp_avg", "exp_avg_sq"):
            if name in st:
                tensors[f"opt.{i}.{name}"] = st[name].contiguous()
        if "step" in st:
            state.setdefault("opt_steps", {})[str(i)] = float(st["step"])
    return save(tensors, metadata={"state": json.dumps(state)})


def restore_checkpoint(data: bytes, model: Eagle3Draft, opt: torch.optim.Optimizer, where: str) -> dict:
    """Load a checkpoint's bytes into the model and optimizer; the saved schedule state. `where`: for messages."""
    from safetensors.torch import load

    state = json.loads(parse_header(data).metadata["state"])
    tensors = load(data)
    # A checkpoint of another draft layout would load in part (its optimizer moments shifted onto other
    # parameters) and resume a different model: refuse it by name. Checkpoints from before the flags were
    # recorded are EAGLE-3's original layout.
    saved = state.get("draft_norms", NORM_LAYOUTS["eagle3"])
    if saved != model.c.norms():
        layout = next((name for name, flags in NORM_LAYOUTS.items() if flags == saved), None)
        fix = f"set EAGLE3Q_DRAFT_NORMS={layout}" if layout else "train with the layout it was trained with"
        raise ValueError(f"checkpoint {where} holds a draft with norms {saved}, the settings build {model.c.norms()}: "
                         f"{fix}, or delete the checkpoint to start over")
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=False)
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if f"opt.{i}.exp_avg" in tensors:
            opt.state[p] = {"step": torch.tensor(state.get("opt_steps", {}).get(str(i), 0.0)),
                            "exp_avg": tensors[f"opt.{i}.exp_avg"], "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"]}
    return state
