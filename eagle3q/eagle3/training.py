"""EAGLE-3 draft training from stored hidden states: the training-time test (TTT) loss, the LR schedule and the
loop that turns a list of hidden-state files into an exported draft. No Redis, no Celery: `eagle3q.stages.train`
holds the run lock, the idempotence and the progress reports, and calls `train_draft`.

- Streaming: the file list is read up front (names only); each sample is loaded when its turn comes.
- Loss: soft cross-entropy against the target's distribution restricted to the draft vocabulary, per TTT step k,
  weighted 0.8**k. The target's logits are computed from the stored final state with the target's LM head rows of
  the draft vocabulary only (no 160k-wide softmax).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3q.config import Settings
from eagle3q.eagle3.checkpoint import load_checkpoint, save_checkpoint
from eagle3q.eagle3.model import DraftConfig, Eagle3Draft
from eagle3q.eagle3.target import final_norm, load_target_tensors, target_config
from eagle3q.eagle3.vocab import build_vocab

log = logging.getLogger("eagle3q.train")
Progress = Callable[..., None]  # progress(state=..., step=..., ...): reported to the ledger by the stage


@dataclass
class TrainResult:
    run: str
    steps: int
    final_loss: float
    acc: list[float]
    export_dir: str
    resumed_from: int = 0
    skipped: bool = False
    vocab_coverage: float = 0.0
    history: list[float] = field(default_factory=list)

    def summary(self) -> str:
        return (f"run {self.run}: {self.steps} steps, loss {self.final_loss:.4f}, acc/step "
                f"{[round(a, 3) for a in self.acc]}, export {self.export_dir}")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T]
    aux: torch.Tensor  # [T, 3H]
    final: torch.Tensor  # [T, H]
    final_is_normed: bool


def load_batch(path: Path, max_len: int) -> Batch:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k) for k in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_state")}
    final_state = json.loads(meta.get("final_state", '"post_norm"'))
    n = min(max_len, t["input_ids"].numel())
    return Batch(t["input_ids"][:n].long(), t["loss_mask"][:n].float(), t["aux_hidden_states"][:n].float(),
                 t["hidden_state"][:n].float(), final_state == "post_norm")


class TargetHead:
    """The target's LM head restricted to the draft vocabulary (+ its final norm for pre-norm states)."""

    def __init__(self, tensors: dict[str, torch.Tensor], t2d: torch.Tensor, eps: float):
        self.w = tensors["lm_head"][t2d]  # [N, H]
        self.norm = tensors.get("norm")
        self.eps = eps

    def probs(self, b: Batch) -> torch.Tensor:
        h = b.final
        if not b.final_is_normed:
            if self.norm is None:
                raise ValueError("pre-norm final states need the target's final norm weight")
            h = final_norm(h, self.norm, self.eps)
        return torch.softmax(h @ self.w.T, -1)


def _shift(x: torch.Tensor, k: int, fill: float = 0) -> torch.Tensor:
    """x[t + k] at row t, padded with `fill` past the end."""
    if k == 0:
        return x
    pad = torch.full((k, *x.shape[1:]), fill, dtype=x.dtype)
    return torch.cat([x[k:], pad], 0)


def ttt_loss(model: Eagle3Draft, b: Batch, target_p: torch.Tensor, steps: int) -> tuple[torch.Tensor, list, list]:
    """Sum over k of 0.8**k x masked soft CE; also per-step loss and top-1 accuracy against the target."""
    T = b.input_ids.numel()
    rows = T - 1  # row t starts from the target's state at t and the known next token x[t+1]
    pos = torch.arange(rows)
    h = model.fc(b.aux[:rows]).unsqueeze(0)
    cache: list = []
    total = torch.zeros(())
    losses, accs = [], []
    for k in range(steps):
        tokens = _shift(b.input_ids[1:], k).unsqueeze(0)  # x[t+1+k]
        logits, h = model.step(tokens, h, pos + k, cache)
        p = _shift(target_p[1:], k)  # target distribution at t+1+k (predicts x[t+2+k])
        # Trained where the input token x[t+1+k] is generated: at inference the draft starts from the target's
        # state at the last accepted token and the token the target sampled, so it never predicts the first
        # generated token from inside the prompt. The convention of speculators' trainer (mask on the input token).
        mask = _shift(b.loss_mask[1:], k)
        logp = torch.log_softmax(logits[0].float(), -1)
        ce = -(p * logp).sum(-1)
        denom = mask.sum().clamp(min=1)
        loss_k = (ce * mask).sum() / denom
        total = total + (0.8**k) * loss_k
        with torch.no_grad():
            acc = ((logits[0].argmax(-1) == p.argmax(-1)).float() * mask).sum() / denom
        losses.append(float(loss_k.detach()))
        accs.append(float(acc))
    return total, losses, accs


def lr_lambda(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return order


def init_head_from_target(model: Eagle3Draft, tensors: dict[str, torch.Tensor], t2d: torch.Tensor) -> None:
    """The draft's output head starts as the target's, restricted to the draft vocabulary: its LM head rows and its
    final norm (speculators does the same for the rows). The draft then only has to learn to predict the target's
    next final state, not also a readout from scratch."""
    with torch.no_grad():
        model.lm_head.weight.copy_(tensors["lm_head"][t2d])
        if "norm" in tensors and tensors["norm"].shape == model.norm.weight.shape:
            model.norm.weight.copy_(tensors["norm"])


def make_model(s: Settings, target_dir: str) -> tuple[Eagle3Draft, DraftConfig, dict]:
    tcfg = target_config(target_dir)
    cfg = DraftConfig.from_target(tcfg, s.draft_vocab_size)
    tensors = load_target_tensors(target_dir)
    torch.manual_seed(s.seed)
    return Eagle3Draft(cfg, tensors["embed"]), cfg, tensors


def train_draft(files: list[Path], s: Settings, out: Path, target_dir: str, progress: Progress,
                log_every: int = 10, run: str = "") -> TrainResult:
    """Vocab mapping, then training (resuming from `out`'s checkpoint), then the export under `out/export`."""
    export_dir = out / "export"
    if not files:
        raise RuntimeError(f"run {run} has no hidden-state files to train on")
    progress(state="vocab", step=0, total_steps=s.epochs * len(files))
    model, cfg, tensors = make_model(s, target_dir)
    d2t, t2d, cov = build_vocab(files, cfg.vocab_size, cfg.draft_vocab_size, out / "vocab.safetensors")
    log.info("run %s: %d files, draft vocab %d covers %.1f%% of loss tokens", run, len(files), d2t.numel(), 100 * cov)
    head = TargetHead(tensors, t2d, cfg.rms_norm_eps)
    if s.init_lm_head:
        init_head_from_target(model, tensors, t2d)  # a checkpoint, if there is one, overwrites it below
    meta0 = json.loads((load_meta(files[0])).get("aux_layer_ids", "null")) or []

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    total = s.epochs * len(files)
    warmup = max(1, int(s.warmup_ratio * total))
    ckpt = out / "checkpoint.safetensors"
    step, resumed = 0, 0
    if ckpt.is_file():
        state = load_checkpoint(ckpt, model, opt)
        step = resumed = int(state["step"])
        log.info("run %s: resumed from step %d", run, step)

    history: list[float] = []
    accs: list[float] = []
    t0 = time.monotonic()
    model.train()
    while step < total:
        epoch, pos = divmod(step, len(files))
        path = files[epoch_order(len(files), s.seed, epoch)[pos]]
        b = load_batch(path, s.max_len)
        if b.input_ids.numel() < 3:
            step += 1
            continue
        with torch.no_grad():
            target_p = head.probs(b)
        loss, losses, accs = ttt_loss(model, b, target_p, s.ttt_steps)
        lr = s.lr * lr_lambda(step, total, warmup)  # cosine with warmup, derived from the step: resumes exactly
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        step += 1
        history.append(float(loss.detach()))
        if step % log_every == 0 or step == total:
            log.info("step %d/%d loss %.4f per-step %s acc %s lr %.2e", step, total, history[-1],
                     [round(x, 3) for x in losses], [round(a, 3) for a in accs], lr)
            progress(state="training", step=step, total_steps=total, loss=history[-1],
                     acc=[round(a, 3) for a in accs], loss_per_step=[round(x, 3) for x in losses],
                     steps_per_s=round((step - resumed) / max(time.monotonic() - t0, 1e-6), 2))
        if step % s.checkpoint_every == 0 and step < total:
            save_checkpoint(ckpt, model, opt, {"step": step})

    from eagle3q.eagle3.export import export_draft

    export_draft(export_dir, model, cfg, d2t, t2d, meta0)
    return TrainResult(run=run, steps=step, final_loss=history[-1] if history else float("nan"), acc=accs,
                       export_dir=str(export_dir), resumed_from=resumed, vocab_coverage=cov, history=history[-50:])


def load_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
