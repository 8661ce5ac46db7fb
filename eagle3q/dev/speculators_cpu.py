"""speculators' own EAGLE-3 trainer (0.9, `python -m speculators.train`) run on the CPU, on an `export-data --format
speculators` directory: the peer column of the learning-curve bench and a check in tests/peers. Its training maths
is untouched; it needs three changes to run without an accelerator:

1. its `Trainer` moves the model and every batch with `.to(local_rank)`, an accelerator index: here "cpu";
2. its step timer calls `torch.accelerator.synchronize()`, which raises without an accelerator: a no-op here;
3. CPU kernels through its own flags: `--draft-attn-impl sdpa` (its default FlexAttention has no backward on the
   CPU), `--loss-implementation eager` (the fused loss needs Triton) and `--hidden-states-dtype float32` (its
   autocast falls back to a "cuda" device type that is disabled here, so bf16 states would meet fp32 weights).

    python -m eagle3q.dev.speculators_cpu --verifier-name-or-path TARGET --data-path EXPORT --save-path OUT ...
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

CPU_FLAGS = ("--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32")


def train(data: Path, verifier: Path, out: Path, *, epochs: int, lr: float, draft_vocab_size: int,
          ttt_steps: int = 7, step_decay: float = 0.8, seq_len: int = 1024, seed: int = 0,
          log: Path | None = None) -> Path:
    """Train with eagle3q's settings where the two trainers share one (AdamW without weight decay, cosine with
    1.5% warm-up, the TTT steps and their loss decay, tokens per step) on every sample of `data`; returns the last
    epoch's checkpoint directory (a speculators `Eagle3DraftModel`, which vLLM and `eval-draft` read). Its data
    loader insists on a validation split (`--train-data-ratio` below 1): the last sample is it."""
    n = len(json.loads((data / "eagle3q-export.json").read_text())["ids"])
    args = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(verifier), "--data-path", str(data),
            "--save-path", str(out), "--draft-vocab-size", str(draft_vocab_size), "--epochs", str(epochs),
            "--lr", str(lr), "--optimizer", "adamw", "--weight-decay", "0", "--scheduler-type", "cosine",
            "--scheduler-warmup-ratio", "0.015", "--ttt-steps", str(ttt_steps), "--ttt-step-loss-decay",
            str(step_decay), "--total-seq-len", str(seq_len), "--num-workers", "0", "--seed", str(seed),
            "--no-resume-from-checkpoint", "--logger", "", "--train-data-ratio", f"{(n - 0.5) / n:.9f}", *CPU_FLAGS]
    with log.open("w") if log else contextlib.nullcontext(subprocess.DEVNULL) as sink:
        done = subprocess.run([sys.executable, "-m", "eagle3q.dev.speculators_cpu", *args], stdout=sink,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"speculators' trainer failed (exit {done.returncode})" + (f": see {log}" if log else ""))
    last = out / str(epochs - 1)
    if not (last / "model.safetensors").is_file():
        raise RuntimeError(f"speculators' trainer wrote no checkpoint at {last}")
    return last


def _run(argv: list[str]) -> None:
    import speculators.train.trainer as trainer
    import torch
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: "cpu"  # change 1
    torch.accelerator.synchronize = lambda *_a, **_k: None  # change 2 (the only caller here is its step timer)
    main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    _run(sys.argv[1:])
