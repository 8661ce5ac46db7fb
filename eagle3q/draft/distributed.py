"""Data-parallel draft training on one machine's GPUs (or CPU processes): `torchrun`-launched ranks, NCCL on GPUs,
gloo on CPU.

Each rank takes every world-th sample of each batch, runs its forward and backward (scaled by the whole batch's
positions), and the gradients are summed across ranks before the optimizer step: the step is the one a single
process would take on the same batch, so the loss curve does not depend on the number of ranks. Rank 0 alone
reports progress, writes checkpoints, TensorBoard and the export.

The training task (`eagle3q.stages.train`) holds the run lock, freezes the manifest and, with
`EAGLE3Q_TRAIN_PROCESSES` > 1, starts `python -m torch.distributed.run --standalone --nproc-per-node N -m
eagle3q.draft.distributed RUN` and waits; every rank reads the manifest and the samples from the store
(EAGLE3Q_STORE_URL, passed on), and rank 0 leaves its result there (train/ddp-result.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from eagle3q.draft.collectives import is_main, rank_and_world
from eagle3q.store import Store
from eagle3q.store.run_store import DDP_RESULT


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


def launch(store: Store, run: str, processes: int, env: dict[str, str] | None = None) -> dict:
    """Run the ranks (the caller holds the run lock and has written the manifest); rank 0's result."""
    store.delete_artifact(run, DDP_RESULT)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "eagle3q.draft.distributed", run]
    subprocess.run(args, check=True, env={**os.environ, **(env or {})})
    return store.get_json(run, DDP_RESULT)["result"]


def main(argv: list[str]) -> None:
    """One rank: `python -m eagle3q.draft.distributed RUN` under torchrun."""
    import logging

    import torch.distributed as dist

    from eagle3q.config import get_settings
    from eagle3q.control.ledger import Ledger
    from eagle3q.draft.manifest import load
    from eagle3q.draft.training import train_draft

    run = argv[0]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        s = get_settings()
        store = Store.from_settings(s)
        manifest = load(store, run)
        ledger = Ledger.from_url(s.broker_url()) if is_main() and os.environ.get("EAGLE3Q_DDP_REPORT") == "1" \
            else None

        def progress(**kw: object) -> None:
            if ledger is not None:
                ledger.set_train_progress(run, **{k: (json.dumps(v) if isinstance(v, list) else v)
                                                  for k, v in kw.items()})

        result = train_draft(manifest, store, s, s.target_model, progress)
        if is_main():
            store.put_json(run, DDP_RESULT, {"result": result.__dict__, "world_size": rank_and_world()[1]})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
