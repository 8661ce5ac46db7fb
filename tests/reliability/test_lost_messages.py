"""Messages the broker loses (popped by Redis, never received by a worker) are found and sent again, exactly those.

Removing a message from its queue list is what Redis does when it serves a BRPOP and stops before the reply is
written: the message is in no list and not in `unacked`. The other messages are queued or delivered while the sweeps
run, so "sent again == lost" also shows that nothing the broker still holds is sent twice."""

from __future__ import annotations

import json
import time

from eagle3q.dev.tiny import SAMPLE_DATASET
from tests.store_paths import train_dir

FAST_SWEEP = {"EAGLE3Q_RECONCILE_PERIOD_S": "0.5", "EAGLE3Q_RECONCILE_GRACE_S": "1.5"}


def _stat(stack, run: str, stage: str, name: str) -> int:  # noqa: ANN001
    return stack.ledger.stat(run, stage, name)


def test_lost_inference_messages_are_sent_again(stack_factory, assert_accounted):  # noqa: ANN001
    stack = stack_factory(env=FAST_SWEEP, sim_args=["--ttft", "0.1"])
    stack.enqueue(SAMPLE_DATASET, "lost", max_samples=24)
    r = stack.broker
    assert r.llen("inference") == 24
    lost = [json.loads(r.rpop("inference")) for _ in range(3)]
    stack.worker("inference", concurrency=2)  # slow enough that most messages stay queued across several sweeps
    stack.wait_settled("lost", timeout_s=90)
    done, rejected = assert_accounted(stack, "lost")
    assert len(done) == 24 and not rejected
    assert _stat(stack, "lost", "inference", "resent_lost") == 3
    assert stack.ledger.open_count("lost", "inference") == 0  # payloads leave Redis with the terminal mark
    assert all(m["headers"]["argsrepr"].split("/")[1] in done for m in lost)


def test_lost_hidden_state_messages_are_sent_again(stack_factory):  # noqa: ANN001
    stack = stack_factory(env=FAST_SWEEP)
    stack.worker("inference", concurrency=4)
    stack.enqueue(SAMPLE_DATASET, "lost_hs", max_samples=10)
    stack.wait_settled("lost_hs")
    r = stack.broker
    assert r.llen("hidden_states") == 10 and stack.ledger.open_count("lost_hs", "hidden_states") == 10
    r.delete("hidden_states")  # every hand-off to the GPU queue lost
    stack.worker("hidden_states")
    stack.wait_settled("lost_hs", stages=("inference", "hidden_states"), timeout_s=90)
    assert stack.ledger.done_ids("lost_hs", "hidden_states") == stack.ledger.done_ids("lost_hs", "inference")
    assert _stat(stack, "lost_hs", "hidden_states", "resent_lost") == 10
    assert stack.ledger.open_count("lost_hs", "hidden_states") == 0


def test_lost_training_task_is_sent_again_and_trains_once(stack_factory):  # noqa: ANN001
    stack = stack_factory(env={**FAST_SWEEP, "EAGLE3Q_EPOCHS": "1"})
    stack.worker("inference", concurrency=4)
    stack.worker("hidden_states")
    stack.enqueue(SAMPLE_DATASET, "lost_train", max_samples=8)
    r = stack.broker
    deadline = time.monotonic() + 90
    # `fired` is set a moment before the trigger message is published: wait for the message itself.
    while r.llen("train") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.ledger.train_fired("lost_train") and r.llen("train") == 1
    r.delete("train")  # the one training trigger, lost by the broker
    stack.worker("train")
    deadline = time.monotonic() + 180
    while stack.ledger.train_progress("lost_train").get("state") != "done" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.ledger.train_progress("lost_train").get("state") == "done"
    assert _stat(stack, "lost_train", "train", "resent_lost") == 1
    assert (train_dir(stack.store, "lost_train") / "result.json").is_file()
