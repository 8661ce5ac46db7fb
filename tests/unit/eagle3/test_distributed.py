"""Data-parallel training under torchrun with 2 gloo CPU processes: the same loss curve as one process on the same
global batches (the gradients are summed across ranks before each step)."""

from __future__ import annotations

import json
import shutil

import pytest

from eagle3q.config import Settings
from eagle3q.stages.train import train_run
from eagle3q.store import Store
from tests.store_paths import run_dir, train_dir


@pytest.fixture
def two_stores(hidden_run, tmp_path):  # noqa: ANN001, ANN201
    """The same 5 samples in two stores (each training run writes its own manifest, checkpoint and export)."""
    stores = []
    for name in ("one", "two"):
        dst = tmp_path / name / "r" / "hidden"
        shutil.copytree(run_dir(hidden_run, "r") / "hidden", dst)
        stores.append(Store(tmp_path / name))
    return stores


def test_two_gloo_ranks_follow_the_single_process_loss_curve(two_stores, tiny):  # noqa: ANN001
    one, two = two_stores
    # ~2 samples per batch: each rank gets its share of every step
    s = Settings(target_model=str(tiny), draft_vocab_size=512, epochs=3, lr=3e-3, train_batch_tokens=60,
                 val_fraction=0.0, checkpoint_every=10**6)
    single = train_run("r", s, one)
    ddp = train_run("r", s.model_copy(update={"train_processes": 2}), two)
    assert ddp.steps == single.steps >= 6 and ddp.samples == single.samples == 5
    assert ddp.history == pytest.approx(single.history, rel=1e-4)
    def accs(r) -> list[float]:  # noqa: ANN001
        return [a for e in r.epochs for a in e["train"]["acc"]]

    assert len(ddp.epochs) == 3 and accs(ddp) == pytest.approx(accs(single), abs=1e-6)
    assert (train_dir(two, "r") / "export" / "model.safetensors").is_file()  # rank 0 exported
    assert json.loads((train_dir(two, "r") / "ddp-result.json").read_text())["world_size"] == 2
