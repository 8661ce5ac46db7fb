"""The training stage's run lock: one trainer per run, renewed while it lives, freed when it dies."""

from __future__ import annotations

import time

import pytest

from eagle3q.config import Settings
from eagle3q.control.locks import RunLock, TrainingBusy
from eagle3q.stages.train import train_run
from eagle3q.store import Store


def test_a_second_trainer_waits_for_the_first(ledger, tmp_path):  # noqa: ANN001
    s = Settings(store_dir=tmp_path / "store", target_model="unused")
    with RunLock(ledger, "busy"), pytest.raises(TrainingBusy):
        train_run("busy", s, Store(tmp_path / "store"), ledger)
    assert not RunLock.held(ledger, "busy")  # released by its holder
    with pytest.raises(RuntimeError, match="no hidden-state files"):  # free again: this one gets to work
        train_run("busy", s, Store(tmp_path / "store"), ledger)
    assert not RunLock.held(ledger, "busy")  # released on the error too


def test_the_lease_is_renewed_while_held_and_ends_with_a_dead_holder(ledger):  # noqa: ANN001
    with RunLock(ledger, "long", ttl_s=1) as lock:
        time.sleep(2.5)  # over twice the lease, with no step calling renew(): the background renewal keeps it
        assert RunLock.holder(ledger, "long") == lock.token
        with pytest.raises(TrainingBusy), RunLock(ledger, "long", ttl_s=1):
            pass
    assert not RunLock.held(ledger, "long")

    dead = RunLock(ledger, "dead", ttl_s=1).__enter__()
    dead._renewal.stop()  # the holder dies: nothing renews the lease any more
    time.sleep(1.3)
    assert not RunLock.held(ledger, "dead")
    with RunLock(ledger, "dead", ttl_s=1) as successor:
        dead.__exit__(None, None, None)  # the old holder's late release must not free its successor's lease
        assert RunLock.holder(ledger, "dead") == successor.token
