"""Processes die and Redis restarts mid-run: every prompt still ends exactly once."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.generate.endpoints import parse_gauge
from tests.store_paths import run_dir, train_dir


def _running(url: str) -> float:
    return parse_gauge(httpx.get(url[:-3] + "/metrics", timeout=5).text, "vllm:num_requests_running")


def test_sigkill_inference_worker_mid_request(stack_factory, assert_accounted):  # noqa: ANN001
    # Slow generations (1 s) so the kill lands while requests are in flight; a short visibility timeout so the
    # unacknowledged tasks come back quickly.
    stack = stack_factory(sim_args=["--ttft", "1.0"], env={"EAGLE3Q_VISIBILITY_TIMEOUT_S": "4",
                                                                         "EAGLE3Q_RESTORE_SWEEP_S": "1"})
    victim = stack.worker("inference", concurrency=4)
    stack.enqueue(SAMPLE_DATASET, "kill", max_samples=16)
    deadline = time.monotonic() + 30
    while _running(stack.sim_urls[0]) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(stack.sim_urls[0]) == 4
    victim.kill(signal.SIGKILL)
    in_flight_lost = 4 - stack.ledger.counts("kill", "inference").done
    assert in_flight_lost > 0
    stack.worker("inference", concurrency=4)
    stack.wait_settled("kill", timeout_s=120)
    done, rejected = assert_accounted(stack, "kill")
    assert len(done) == 16 and not rejected  # redelivered and finished once: no duplicates, no double counts
    files = list((run_dir(stack.store, "kill") / "samples").glob("*/*"))
    assert len(files) == 16  # no stray temp files either


def test_live_worker_keeps_tasks_longer_than_the_visibility_timeout(stack_factory, assert_accounted):  # noqa: ANN001
    # Generations of 6 s, a visibility timeout of 2 s swept every second, and an idle second worker ready to take any
    # redelivered message: only the lease refresh keeps the first worker's messages from running twice.
    stack = stack_factory(sim_args=["--ttft", "6.0"], env={"EAGLE3Q_VISIBILITY_TIMEOUT_S": "2",
                                                           "EAGLE3Q_RESTORE_SWEEP_S": "1",
                                                           "EAGLE3Q_REQUEST_TIMEOUT_S": "30"})
    stack.worker("inference", concurrency=2)
    stack.enqueue(SAMPLE_DATASET, "long", max_samples=4)
    stack.worker("inference", concurrency=2)
    stack.wait_settled("long", timeout_s=60)
    done, rejected = assert_accounted(stack, "long")
    assert len(done) == 4 and not rejected
    metrics = httpx.get(stack.sim_urls[0][:-3] + "/metrics", timeout=5).text
    assert parse_gauge(metrics, "vllm:request_success_total") == 4  # one generation per prompt
    assert _running(stack.sim_urls[0]) == 0  # and none still running twice


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_redis_restart_mid_run(stack_factory, assert_accounted, sig):  # noqa: ANN001
    # A quick lost-message sweep: a message Redis popped but never delivered before it stopped comes back in seconds.
    stack = stack_factory(sim_args=["--ttft", "0.3"], env={"EAGLE3Q_RECONCILE_PERIOD_S": "1",
                                                           "EAGLE3Q_RECONCILE_GRACE_S": "3"})
    stack.worker("inference", concurrency=4)
    stack.worker("hidden_states")
    stack.enqueue(SAMPLE_DATASET, "restart", max_samples=60)
    deadline = time.monotonic() + 60
    while stack.ledger.counts("restart", "inference").done < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = stack.ledger.counts("restart", "inference").done
    assert 10 <= before < 60
    # SIGTERM flushes the AOF; SIGKILL does not (what reached the AOF's write(2) before each reply survives: the
    # fsync policy matters only for a host crash). Down for 3 s, same port and data directory.
    stack.redis.restart(down_s=3.0, sig=sig)
    stack.wait_settled("restart", stages=("inference", "hidden_states"), timeout_s=240)
    done, rejected = assert_accounted(stack, "restart")
    assert len(done) == 60 and not rejected
    hs = stack.ledger.done_ids("restart", "hidden_states")
    assert hs == done


def test_sigkill_trainer_mid_training_resumes_and_trains_once(stack_factory):  # noqa: ANN001
    import json

    # One sample per step and nothing held out: 8 x 30 steps, long enough to kill the trainer in the middle.
    stack = stack_factory(env={"EAGLE3Q_EPOCHS": "8", "EAGLE3Q_CHECKPOINT_EVERY": "10", "EAGLE3Q_LR": "3e-3",
                               "EAGLE3Q_TRAIN_BATCH_TOKENS": "1", "EAGLE3Q_VAL_FRACTION": "0",
                               "EAGLE3Q_VISIBILITY_TIMEOUT_S": "4", "EAGLE3Q_RESTORE_SWEEP_S": "1",
                               "EAGLE3Q_TRAIN_LOCK_S": "3"})
    stack.worker("inference", concurrency=8)
    stack.worker("hidden_states")
    trainer = stack.worker("train")
    stack.enqueue(SAMPLE_DATASET, "tkill", max_samples=30)
    deadline = time.monotonic() + 180
    while int(stack.ledger.train_progress("tkill").get("step", 0)) < 25 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert int(stack.ledger.train_progress("tkill")["step"]) >= 25
    trainer.kill(signal.SIGKILL)
    assert not (train_dir(stack.store, "tkill") / "result.json").exists()
    stack.worker("train")
    deadline = time.monotonic() + 240
    while stack.ledger.train_progress("tkill").get("state") != "done" and time.monotonic() < deadline:
        time.sleep(0.5)
    result = json.loads((train_dir(stack.store, "tkill") / "result.json").read_text())
    assert result["resumed_from"] >= 20 and result["steps"] == 8 * 30  # resumed, not restarted
    assert stack.ledger.train_fired("tkill")
