"""`status` projects the hidden-state store's size from the bytes per finished sample and the samples left, and
says when the store's free space will not hold it."""

from __future__ import annotations

from pathlib import Path

from eagle3q.status import render, store_projection
from eagle3q.store import Store


def _stages(incoming: int, inf_rejected: int, done: int, hs_rejected: int, nbytes: int) -> dict:
    return {"inference": {"incoming": incoming, "rejected": inf_rejected},
            "hidden_states": {"done": done, "rejected": hs_rejected, "bytes": nbytes}}


def test_projection_counts_only_the_samples_still_to_extract(tmp_path: Path) -> None:
    # 1000 enqueued, 50 rejected at inference, 100 extracted (1 MB each), 10 rejected at extraction: 840 left.
    p = store_projection(_stages(1000, 50, 100, 10, 100_000_000), Store(tmp_path).free_bytes())
    assert p["samples_left"] == 840 and p["projected_bytes"] == 100_000_000 + 840 * 1_000_000
    assert p["free_bytes"] > 0 and p["fits"] is True
    assert store_projection(_stages(1000, 0, 0, 0, 0), 10**9) is None  # nothing to project from yet


def test_a_store_too_small_for_the_run_is_a_red_line(tmp_path: Path) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    # Each sample is a tenth of the free space: 100 left cannot fit.
    p = store_projection(_stages(110, 0, 10, 0, 10 * (free // 10)), Store(tmp_path).free_bytes())
    assert store_projection(_stages(110, 0, 10, 0, 10), None)["fits"] is None  # an object store: no limit to meet
    assert p["fits"] is False
    row = {"incoming": 110, "done": 10, "rejected": 0, "pending": 100, "reasons": {}, "rate_per_s": 0.1,
           "eta_s": 1000.0, "tokens_per_s": 1.0, "bytes": 0, "bytes_per_token": None, "retries": {},
           "store_errors": 0, "task_errors": 0, "resent_lost": 0, "server_too_old": 0}
    snap = {"run": "r", "stages": {"inference": row, "hidden_states": row}, "bad_rows": 0, "store": p, "train": {},
            "train_fired": False}
    from rich.console import Console

    console = Console(record=True, width=400)
    console.print(render(snap))
    assert "the store will fill before the run ends" in console.export_text()


def test_drained_is_what_the_hand_off_waits_for() -> None:
    """`status --wait-for STAGE`: a stage has drained when the producer has finished and nothing of the run is left
    in it or before it; training when the draft is trained."""
    from eagle3q.status import drained

    def snap(complete: bool, inf: tuple[int, int], hs: tuple[int, int], train: str | None = None) -> dict:
        return {"meta": {"enqueue_complete": "1" if complete else "0"}, "train": {"state": train} if train else {},
                "stages": {"inference": {"incoming": inf[0], "pending": inf[1]},
                           "hidden_states": {"incoming": hs[0], "pending": hs[1]}}}

    assert drained(snap(True, (10, 0), (8, 3)), "inference") and not drained(snap(True, (10, 0), (8, 3)),
                                                                           "hidden_states")
    assert not drained(snap(False, (10, 0), (8, 0)), "inference")  # the producer is still sending
    assert not drained(snap(True, (10, 2), (8, 0)), "hidden_states")  # samples still to come from inference
    assert not drained(snap(True, (0, 0), (0, 0)), "inference")  # nothing enqueued yet is not done
    assert drained(snap(True, (10, 0), (8, 0)), "hidden_states")
    assert not drained(snap(True, (10, 0), (8, 0), "training"), "train") and drained(snap(True, (10, 0), (8, 0),
                                                                                      "done"), "train")
