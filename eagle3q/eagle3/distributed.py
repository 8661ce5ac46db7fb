"""Data-parallel draft training on one machine's GPUs (or CPU processes): `torchrun`-launched ranks, NCCL on GPUs,
gloo on CPU.

Each rank takes every world-th sample of each batch, runs its forward and backward (scaled by the whole batch's
positions), and the gradients are summed across ranks before the optimizer step: the step is the one a single
process would take on the same batch, so the loss curve does not depend on the number of ranks. Rank 0 alone
reports progress, writes checkpoints, TensorBoard and the export.

The training task (`eagle3q.stages.train`) holds the run lock, freezes the manifest and, with
`EAGLE3Q_TRAIN_PROCESSES` > 1, starts `python -m torch.distributed.run --standalone --nproc-per-node N -m
eagle3q.eagle3.distributed RUN OUT` and waits; rank 0 leaves its result in `OUT/ddp-result.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from eagle3q.eagle3.collectives import is_main, rank_and_world

RESULT = "ddp-result.json"


def settings_env(s) -> dict[str, str]:  # noqa: ANN001 - an eagle3q.config.Settings
    """The caller's settings as EAGLE3Q_* variables for the ranks (secrets stay in the inherited environment)."""
    from pydantic import SecretStr

    env: dict[str, str] = {}
    for name in type(s).model_fields:
        v = getattr(s, name)
        if v is None or isinstance(v, SecretStr):
            continue
        env[f"EAGLE3Q_{name.upper()}"] = json.dumps(v) if isinstance(v, list | bool) else str(v)
    return env


def launch(run: str, out: Path, processes: int, env: dict[str, str] | None = None) -> dict:
    """Run the ranks (the caller holds the run lock and has written the manifest); rank 0's result."""
    (out / RESULT).unlink(missing_ok=True)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "eagle3q.eagle3.distributed", run, str(out)]
    subprocess.run(args, check=True, env={**os.environ, **(env or {})})
    return json.loads((out / RESULT).read_text())["result"]


def main(argv: list[str]) -> None:
    """One rank: `python -m eagle3q.eagle3.distributed RUN OUT` under torchrun."""
    import logging

    import torch.distributed as dist

    from eagle3q.config import get_settings
    from eagle3q.control.ledger import Ledger
    from eagle3q.eagle3.manifest import NAME, Manifest
    from eagle3q.eagle3.training import train_draft
    from eagle3q.store import Store

    run, out = argv[0], Path(argv[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        s = get_settings()
        store = Store(s.store_dir)
        manifest = Manifest.from_json((out / NAME).read_bytes())
        paths = {e.sample_id: store.hidden_path(run, e.sample_id) for e in (*manifest.train, *manifest.val)}
        ledger = Ledger.from_url(s.broker_url()) if is_main() and os.environ.get("EAGLE3Q_DDP_REPORT") == "1" \
            else None

        def progress(**kw: object) -> None:
            if ledger is not None:
                ledger.set_train_progress(run, **{k: (json.dumps(v) if isinstance(v, list) else v)
                                                  for k, v in kw.items()})

        result = train_draft(manifest, paths, s, out, s.target_model, progress)
        if is_main():
            (out / RESULT).write_text(json.dumps({"result": result.__dict__, "world_size": rank_and_world()[1]}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
