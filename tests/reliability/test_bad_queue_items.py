"""Items on a queue list that are not messages (garbage, a truncated write, another application's data) are set
aside with their queue and reason, counted in `status`, and never kill a consumer."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from eagle3q.dev.local import child_env
from eagle3q.dev.tiny import SAMPLE_DATASET


def test_garbage_on_a_queue_is_set_aside_and_the_worker_lives(stack_factory):  # noqa: ANN001
    stack = stack_factory(env={"EAGLE3Q_RECONCILE_PERIOD_S": "0.5"})
    stack.enqueue(SAMPLE_DATASET, "junk", max_samples=6)
    real = stack.broker.lindex("inference", 0)
    bad = ["not json at all", json.dumps({"from": "another app"}), json.dumps("just a string"), real[: len(real) // 2],
           json.dumps({"body": "!!!", "properties": {"body_encoding": "base64"}, "headers": {}})]
    stack.broker.rpush("inference", *bad)  # BRPOP takes from the right: these come first
    w = stack.worker("inference", concurrency=2)
    stack.wait_settled("junk", timeout_s=60)
    assert w.alive() and "Unrecoverable error" not in w.log.read_text()
    assert stack.ledger.counts("junk", "inference").done == 6
    assert stack.ledger.dead_letters() == {"inference": len(bad)}
    kept = [json.loads(x) for x in stack.broker.lrange("e3q:dead:inference", 0, -1)]
    assert sorted(k["raw"] for k in kept) == sorted(bad) and all(k["why"] and k["queue"] == "inference" for k in kept)
    assert w.log.read_text().count("set aside an item on queue inference") == len(bad)
    out = subprocess.run([sys.executable, "-m", "eagle3q.cli", "status", "--run", "junk"], env=child_env(stack.env),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"inference={len(bad)}" in out
    time.sleep(1.5)  # a few lost-message sweeps over a queue that held garbage: still alive
    assert w.alive()


def test_garbage_on_the_gpu_queues_is_set_aside_and_the_pipeline_still_trains(stack_factory):  # noqa: ANN001
    stack = stack_factory()
    bad = ["\x00\x01binary", json.dumps({"body": "e30=", "headers": "not a dict"}), "{truncated"]
    for queue in ("hidden_states", "train"):
        stack.broker.rpush(queue, *bad)
    stack.worker("inference", concurrency=4)
    hs, tr = stack.worker("hidden_states"), stack.worker("train")
    deadline = time.monotonic() + 30
    while sum(stack.ledger.dead_letters().values()) < 2 * len(bad) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.ledger.dead_letters() == {"hidden_states": len(bad), "train": len(bad)}
    stack.enqueue(SAMPLE_DATASET, "gpuq", max_samples=4)  # real work afterwards: extraction and training
    stack.wait_settled("gpuq", stages=("inference", "hidden_states"), timeout_s=120)
    deadline = time.monotonic() + 120
    while stack.ledger.train_progress("gpuq").get("state") != "done" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stack.ledger.train_progress("gpuq").get("state") == "done"
    assert hs.alive() and tr.alive() and all(w.alive() for w in stack.workers)
