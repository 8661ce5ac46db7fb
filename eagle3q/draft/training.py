"""EAGLE-3 draft training from stored hidden states: the training-time test (TTT) loss, the schedule, and the loop
that turns a run's manifest (`eagle3q.draft.manifest`) into an exported draft. No Redis, no Celery:
`eagle3q.stages.train` holds the run lock, the idempotence and the progress reports, and calls `train_draft`.

- Batches: each epoch the training samples are shuffled (seeded by the epoch) and packed into batches of at most
  `train_batch_tokens` tokens (a longer sample goes alone). One optimizer step per batch; each sample's backward
  accumulates into it (gradient accumulation), scaled so the loss is token-weighted over the whole batch, not a mean
  of per-sample means.
- Loss: soft cross-entropy against the target's distribution restricted to the draft vocabulary, per TTT step k,
  weighted 0.8**k. Positions count where the token fed to the draft is generated (speculators' convention) and the
  target's top token is in the draft vocabulary (SpecForge/EAGLE mask the others: the draft cannot propose them).
- Metrics per epoch, on the training batches and on the held-out rows: pooled per-step top-1 accuracy and prefix
  accuracy (right at this step and every step before), in the log, the progress report, `result.json` and
  TensorBoard (`train/tensorboard` in the store, when the tensorboard package is installed: written in a local
  scratch directory as the events come, copied to the store after each epoch), and drawn after each epoch as
  `train/curves.png` (when matplotlib is).
- Data: every sample's object is read from the store (a directory or a bucket) with read-ahead: the whole schedule
  is known in advance, so the samples of the coming steps are fetched on threads while this one computes.
- Resume: the schedule follows from the manifest, the seed and the step, so a resumed trainer, on this machine or
  another one, continues the same batches in the same order from the store's checkpoint; the checkpoint carries
  the epoch's running metrics.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3q.config import Settings
from eagle3q.draft.checkpoint import checkpoint_bytes, restore_checkpoint
from eagle3q.draft.collectives import all_reduce_floats, all_reduce_grads, rank_and_world
from eagle3q.draft.manifest import Entry, Manifest
from eagle3q.draft.model import DraftConfig, Eagle3Draft
from eagle3q.draft.vocab import build_vocab
from eagle3q.evaluation.plots import training_curves
from eagle3q.store import Store
from eagle3q.store.hidden_format import decode, loss_positions
from eagle3q.store.read_ahead import read_ahead
from eagle3q.store.run_store import CHECKPOINT, CURVES, EXPORT, TENSORBOARD
from eagle3q.target import final_norm, load_target_tensors, target_config

log = logging.getLogger("eagle3q.train")
Progress = Callable[..., None]  # progress(state=..., step=..., ...): reported to the ledger by the stage
STEP_DECAY = 0.8


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
    epochs: list[dict] = field(default_factory=list)  # per epoch: train and validation loss / acc / prefix_acc
    samples: int = 0
    val_samples: int = 0
    split: dict = field(default_factory=dict)  # eagle3q.draft.manifest.split_report: prompts per side, repeats
    curves: str | None = None  # the loss / accuracy PNG (eagle3q.evaluation.plots), None without matplotlib

    def summary(self) -> str:
        last = self.epochs[-1] if self.epochs else {}
        val = last.get("val") or {}
        return (f"run {self.run}: {self.steps} steps over {self.samples} samples, loss {self.final_loss:.4f}, "
                f"acc/step {[round(a, 3) for a in self.acc]}"
                + (f", held-out acc/step {val.get('acc')}" if val else "") + f", export {self.export_dir}")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T]
    aux: torch.Tensor  # [T, 3H]
    final: torch.Tensor  # [T, H]
    final_is_normed: bool


def load_batch(data: bytes, max_len: int) -> Batch:
    """A sample's object (its bytes from the store) as the tensors training reads."""
    t, final_state = decode(data)
    n = min(max_len, t["input_ids"].numel())
    return Batch(t["input_ids"][:n].long(), t["loss_mask"][:n].float(), t["aux_hidden_states"][:n].float(),
                 t["hidden_state"][:n].float(), final_state == "post_norm")


class TargetHead:
    """The target's LM head (+ its final norm for pre-norm states): its distribution over the draft vocabulary and,
    per position, whether its top token over the whole vocabulary is in the draft vocabulary."""

    CHUNK = 16384  # vocabulary rows per matmul when looking for the full-vocabulary maximum

    def __init__(self, tensors: dict[str, torch.Tensor], t2d: torch.Tensor, eps: float):
        self.full = tensors["lm_head"]  # [V, H]
        self.w = self.full[t2d]  # [N, H]
        self.norm = tensors.get("norm")
        self.eps = eps

    def __call__(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        h = b.final
        if not b.final_is_normed:
            if self.norm is None:
                raise ValueError("pre-norm final states need the target's final norm weight")
            h = final_norm(h, self.norm, self.eps)
        logits = h @ self.w.T
        best = torch.full((h.shape[0],), -math.inf)
        for i in range(0, self.full.shape[0], self.CHUNK):
            best = torch.maximum(best, (h @ self.full[i:i + self.CHUNK].T).max(-1).values)
        draft_best = logits.max(-1).values
        in_vocab = draft_best >= best - 1e-5 * best.abs().clamp(min=1.0)
        return torch.softmax(logits, -1), in_vocab


def _shift(x: torch.Tensor, k: int, fill: float = 0) -> torch.Tensor:
    """x[t + k] at row t, padded with `fill` past the end."""
    if k == 0:
        return x
    pad = torch.full((k, *x.shape[1:]), fill, dtype=x.dtype)
    return torch.cat([x[k:], pad], 0)


@dataclass
class StepStats:
    """Per TTT step: masked loss sum, positions, top-1 hits, hits with every earlier step right too."""

    loss: list[float]
    count: list[float]
    correct: list[float]
    prefix: list[float]

    @classmethod
    def zeros(cls, steps: int) -> StepStats:
        return cls([0.0] * steps, [0.0] * steps, [0.0] * steps, [0.0] * steps)

    def add(self, other: StepStats) -> None:
        for mine, theirs in ((self.loss, other.loss), (self.count, other.count), (self.correct, other.correct),
                             (self.prefix, other.prefix)):
            for k, v in enumerate(theirs):
                mine[k] += v

    def reduced(self) -> StepStats:
        """Summed over the data-parallel ranks (itself with one process)."""
        n = len(self.loss)
        r = all_reduce_floats(self.loss + self.count + self.correct + self.prefix)
        return StepStats(r[:n], r[n:2 * n], r[2 * n:3 * n], r[3 * n:])

    def summary(self) -> dict:
        def ratio(xs: list[float]) -> list[float]:
            return [round(x / c, 4) if c else 0.0 for x, c in zip(xs, self.count, strict=True)]

        weights = [STEP_DECAY**k for k in range(len(self.loss))]
        loss = sum(w * lk / c for w, lk, c in zip(weights, self.loss, self.count, strict=True) if c)
        return {"loss": round(loss, 4), "acc": ratio(self.correct), "prefix_acc": ratio(self.prefix),
                "positions": int(self.count[0]) if self.count else 0}


def ttt_loss(model: Eagle3Draft, b: Batch, target_p: torch.Tensor, in_vocab: torch.Tensor,
             steps: int) -> tuple[torch.Tensor, StepStats]:
    """Sum over TTT steps k of 0.8**k x the masked soft-CE *sum* (the caller divides by the batch's positions), and
    the step statistics. Row t starts from the target's state at t and the known next token x[t+1]; at step k it
    is fed x[t+1+k] and predicts x[t+2+k], whose target distribution comes from the target's state at t+1+k."""
    T = b.input_ids.numel()
    rows = T - 1
    pos = torch.arange(rows)
    h = model.combine(b.aux[:rows]).unsqueeze(0)
    cache: list = []
    total = torch.zeros(())
    stats = StepStats.zeros(steps)
    prev_right = torch.ones(rows, dtype=torch.bool)
    # Counted where the input token is generated and the target's choice is one the draft can make.
    gate = (b.loss_mask[1:] > 0) & in_vocab[1:]
    for k in range(steps):
        tokens = _shift(b.input_ids[1:], k).unsqueeze(0)  # x[t+1+k]
        logits, h = model.step(tokens, h, pos + k, cache)
        p = _shift(target_p[1:], k)  # target distribution at t+1+k
        mask = _shift(gate, k, fill=False)
        logp = torch.log_softmax(logits[0].float(), -1)
        ce = -(p * logp).sum(-1)
        m = mask.float()
        loss_k = (ce * m).sum()
        total = total + (STEP_DECAY**k) * loss_k
        with torch.no_grad():
            right = logits[0].argmax(-1) == p.argmax(-1)
            prev_right = prev_right & right
            stats.loss[k] = float(loss_k.detach())
            stats.count[k] = float(m.sum())
            stats.correct[k] = float((right & mask).sum())
            stats.prefix[k] = float((prev_right & mask).sum())
    return total, stats


def lr_lambda(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def plan_epoch(entries: tuple[Entry, ...], budget: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's batches: indices into `entries`, shuffled by (seed, epoch), packed in order up to `budget`
    tokens (a sample longer than the budget is a batch of its own)."""
    order = list(range(len(entries)))
    random.Random(seed * 1000 + epoch).shuffle(order)
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = entries[i].tokens
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


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
    cfg = DraftConfig.from_target(tcfg, s.draft_vocab_size, s.draft_norms)
    tensors = load_target_tensors(target_dir)
    torch.manual_seed(s.seed)
    return Eagle3Draft(cfg, tensors["embed"]), cfg, tensors


def _tensorboard(scratch: Path):  # noqa: ANN202 - a SummaryWriter, or None without the tensorboard package
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed: no curves written (pip install tensorboard)")
        return None
    return SummaryWriter(log_dir=str(scratch))


def sample_loss(model: Eagle3Draft, head: TargetHead, data: bytes,
                s: Settings) -> tuple[torch.Tensor, StepStats] | None:
    """One sample's TTT loss sum and step statistics (None for a sample too short to predict anything)."""
    b = load_batch(data, s.max_len)
    if b.input_ids.numel() < 3:
        return None
    with torch.no_grad():
        target_p, in_vocab = head(b)
    return ttt_loss(model, b, target_p, in_vocab, s.ttt_steps)


class Samples:
    """The rank's samples, in the order the schedule will read them, from the store with read-ahead."""

    def __init__(self, store: Store, run: str, order: Iterator[str], depth: int):
        self.stream = read_ahead(lambda sid: store.hidden_bytes(run, sid), order, depth)

    def take(self, sample_id: str) -> bytes:
        got, data = next(self.stream)
        if got != sample_id:  # the schedule and its reader disagree: a bug, never a silent wrong sample
            raise RuntimeError(f"read-ahead gave {got}, the schedule wants {sample_id}")
        return data


@torch.no_grad()
def evaluate_samples(model: Eagle3Draft, head: TargetHead, ids: list[str], samples: Samples,
                     s: Settings) -> StepStats:
    """The step statistics over `ids` (shared out between data-parallel ranks: this rank reads ids[rank::world],
    summed)."""
    was_training = model.training
    model.eval()
    stats = StepStats.zeros(s.ttt_steps)
    rank, world = rank_and_world()
    for sid in ids[rank::world]:
        scored = sample_loss(model, head, samples.take(sid), s)
        if scored is not None:
            stats.add(scored[1])
    model.train(was_training)
    return stats.reduced()


def reading_order(plans: list[list[list[int]]], starts: list[int], step: int, train: tuple[Entry, ...],
                  val_ids: list[str]) -> Iterator[str]:
    """The sample ids this rank reads from `step` on, in order: its share of each batch, and its share of the
    held-out samples after each epoch's last batch (what the training loop below takes, one by one)."""
    rank, world = rank_and_world()
    for epoch, plan in enumerate(plans):
        for i, batch in enumerate(plan):
            if starts[epoch] + i < step:
                continue
            yield from (train[j].sample_id for j in batch[rank::world])
            if i == len(plan) - 1:
                yield from val_ids[rank::world]


def train_draft(manifest: Manifest, store: Store, s: Settings, target_dir: str, progress: Progress,
                log_every: int = 10) -> TrainResult:
    """Vocab mapping (from the training split), then training (resuming from the store's checkpoint), then the
    export under the run's train/export in the store. Under torchrun (`eagle3q.draft.distributed`) each rank runs
    its share of every batch and rank 0 alone writes and reports."""
    run = manifest.run
    rank, world = rank_and_world()
    main = rank == 0
    if not main:
        progress = _quiet
    train, val = manifest.train, manifest.val
    if not train:
        raise RuntimeError(f"run {run} has no hidden-state files to train on")
    plans = [plan_epoch(train, s.train_batch_tokens, s.seed, e) for e in range(s.epochs)]
    total = sum(len(p) for p in plans)
    progress(state="vocab", step=0, total_steps=total)
    model, cfg, tensors = make_model(s, target_dir)
    train_ids = [e.sample_id for e in train]
    if world > 1 and not main:
        _barrier()  # rank 0 builds the vocab file, the others read it
    d2t, t2d, cov = build_vocab(store, run, train_ids, cfg.vocab_size, cfg.draft_vocab_size)
    if world > 1 and main:
        _barrier()
    log.info("run %s: %d training samples, %d held out; %d steps over %d epochs; draft vocab %d covers %.1f%% of "
             "loss tokens", run, len(train), len(val), total, s.epochs, d2t.numel(), 100 * cov)
    head = TargetHead(tensors, t2d, cfg.rms_norm_eps)
    if s.init_lm_head:
        init_head_from_target(model, tensors, t2d)  # a checkpoint, if there is one, overwrites it below
    meta0 = list(store.hidden_header(run, train_ids[0]).meta("aux_layer_ids") or [])

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    warmup = max(1, int(s.warmup_ratio * total))
    step = resumed = 0
    epochs: list[dict] = []
    running = StepStats.zeros(s.ttt_steps)
    if store.has_artifact(run, CHECKPOINT):
        state = restore_checkpoint(store.get_artifact(run, CHECKPOINT), model, opt, store.artifact_url(run, CHECKPOINT))
        step = resumed = int(state["step"])
        epochs = state.get("epochs", [])
        if "running" in state:
            running = StepStats(**state["running"])
        log.info("run %s: resumed from step %d", run, step)
    scratch = Path(tempfile.mkdtemp(prefix=f"eagle3q-tensorboard-{run}-")) if main else None
    tb = _tensorboard(scratch) if scratch is not None else None
    val_ids = [e.sample_id for e in val]

    history: list[float] = []
    accs: list[float] = []
    t0 = time.monotonic()
    model.train()
    starts = [sum(len(p) for p in plans[:e]) for e in range(s.epochs)]
    samples = Samples(store, run, reading_order(plans, starts, step, train, val_ids), s.train_read_ahead)
    while step < total:
        epoch = max(e for e in range(s.epochs) if starts[e] <= step)
        batch = [train[i] for i in plans[epoch][step - starts[epoch]]]
        mine = [(e, samples.take(e.sample_id)) for e in batch[rank::world]]
        # The batch's loss positions, summed over the ranks' shares: every rank divides by the same total.
        denom = sum(all_reduce_floats([float(sum(loss_positions(data, s.max_len) for _, data in mine))])) or 1
        lr = s.lr * lr_lambda(step, total, warmup)  # cosine with warmup, derived from the step: resumes exactly
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        stats = StepStats.zeros(s.ttt_steps)
        for _e, data in mine:
            scored = sample_loss(model, head, data, s)  # (loss, step stats), None for an empty one
            if scored is None:
                continue
            (scored[0] / denom).backward()  # accumulates: the step's loss is token-weighted over the whole batch
            stats.add(scored[1])
        all_reduce_grads(params)  # the sum over ranks: the gradient one process would get on the whole batch
        stats = stats.reduced()
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        opt.step()
        step += 1
        running.add(stats)
        summary = stats.summary()
        history.append(summary["loss"])
        accs = summary["acc"]
        if tb is not None:
            tb.add_scalar("train/loss", summary["loss"], step)
            tb.add_scalar("train/lr", lr, step)
        if main and (step % log_every == 0 or step == total):
            log.info("step %d/%d loss %.4f acc %s prefix %s lr %.2e", step, total, summary["loss"], summary["acc"],
                     summary["prefix_acc"], lr)
            progress(state="training", step=step, total_steps=total, loss=summary["loss"], acc=summary["acc"],
                     epoch=epoch + 1, steps_per_s=round((step - resumed) / max(time.monotonic() - t0, 1e-6), 2))
        if step == starts[epoch] + len(plans[epoch]):  # the epoch's last batch: its metrics, then validation
            record = {"epoch": epoch + 1, "train": running.summary(),
                      "val": evaluate_samples(model, head, val_ids, samples, s).summary() if val_ids else None}
            epochs.append(record)
            running = StepStats.zeros(s.ttt_steps)
            if main:
                _report_epoch(record, progress, tb)
                _put_curves(store, run, epochs, history, resumed)
                _sync_tensorboard(store, run, tb, scratch)
        if main and step % s.checkpoint_every == 0 and step < total:
            store.put_artifact(run, CHECKPOINT, checkpoint_bytes(model, opt, {"step": step, "epochs": epochs,
                                                                             "running": running.__dict__}))
    if tb is not None:
        tb.close()

    from eagle3q.draft.export import export_draft

    curves = None
    if main:
        export_draft(store, run, model, cfg, d2t, t2d, meta0)
        curves = _put_curves(store, run, epochs, history, resumed)
        _sync_tensorboard(store, run, None, scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    return TrainResult(run=run, steps=step, final_loss=history[-1] if history else float("nan"), acc=accs,
                       export_dir=store.artifact_url(run, EXPORT), resumed_from=resumed, vocab_coverage=cov,
                       history=history[-50:], epochs=epochs, samples=len(train), val_samples=len(val), curves=curves)


def _put_curves(store: Store, run: str, epochs: list[dict], history: list[float], resumed: int) -> str | None:
    png = training_curves(epochs, history, first_step=resumed + 1)
    if png is None:
        return None
    store.put_artifact(run, CURVES, png)
    return store.artifact_url(run, CURVES)


def _sync_tensorboard(store: Store, run: str, tb, scratch: Path | None) -> None:  # noqa: ANN001 - a SummaryWriter
    """The event files, written locally as they grow, copied to the store's train/tensorboard."""
    if scratch is None:
        return
    if tb is not None:
        tb.flush()
    store.put_dir(run, TENSORBOARD, scratch)


def _report_epoch(record: dict, progress: Progress, tb) -> None:  # noqa: ANN001 - tb: a SummaryWriter or None
    epoch, train, val = record["epoch"], record["train"], record["val"] or {}
    log.info("epoch %d: train acc %s prefix %s | held-out acc %s prefix %s", epoch, train["acc"],
             train["prefix_acc"], val.get("acc"), val.get("prefix_acc"))
    progress(epoch=epoch, train_acc=train["acc"], train_prefix_acc=train["prefix_acc"], val_acc=val.get("acc", []),
             val_prefix_acc=val.get("prefix_acc", []))
    if tb is None:
        return
    for split, stats in (("train", train), ("val", val)):
        if not stats:
            continue
        for k, (a, pa) in enumerate(zip(stats["acc"], stats["prefix_acc"], strict=True)):
            tb.add_scalar(f"{split}/acc_step{k}", a, epoch)
            tb.add_scalar(f"{split}/prefix_acc_step{k}", pa, epoch)
        tb.add_scalar(f"{split}/epoch_loss", stats["loss"], epoch)
    tb.flush()


def _quiet(**_: object) -> None:
    """The progress report of ranks other than 0."""


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()

