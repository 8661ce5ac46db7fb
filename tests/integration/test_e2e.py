"""All three stages as real worker processes: inference -> hidden states -> one training run."""

from __future__ import annotations

import json
import time

from eagle3q.dev.tiny import SAMPLE_DATASET
from tests.store_paths import hidden_file, train_dir


def test_pipeline_to_trained_draft(stack_factory):  # noqa: ANN001
    # One sample per training step, nothing held out: the step count is the number of samples trained on.
    stack = stack_factory(env={"EAGLE3Q_EPOCHS": "1", "EAGLE3Q_LR": "3e-3", "EAGLE3Q_TOKEN_BUDGET": "2048",
                               "EAGLE3Q_TRAIN_BATCH_TOKENS": "1", "EAGLE3Q_VAL_FRACTION": "0"})
    stack.worker("inference", concurrency=8)
    stack.worker("hidden_states")
    stack.worker("hidden_states")  # two GPU workers finishing at once
    stack.worker("train")
    rep = stack.enqueue(SAMPLE_DATASET, "e2e", max_samples=40, train_target=30)
    assert rep.enqueued == 40
    stack.wait_settled("e2e", stages=("inference", "hidden_states"), timeout_s=240)

    L = stack.ledger
    done = L.done_ids("e2e", "hidden_states")
    assert len(done) == 40
    for sid in done:
        s = stack.store.read_sample("e2e", sid)
        assert stack.store.hidden_valid("e2e", sid, len(s.input_ids)) is not None
    hs = L.counts("e2e", "hidden_states")
    assert hs.stats["bytes"] == sum(hidden_file(stack.store, "e2e", sid).stat().st_size for sid in done)
    assert hs.stats["tokens"] == sum(len(stack.store.read_sample("e2e", sid).input_ids) for sid in done)

    deadline = time.monotonic() + 180
    while L.train_progress("e2e").get("state") != "done" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert L.train_progress("e2e").get("state") == "done"
    result = json.loads((train_dir(stack.store, "e2e") / "result.json").read_text())
    # the trigger fired at 30 of 40, once; the trainer saw what was there when it started
    assert 30 <= result["steps"] <= 40
    trainer_log = next(w for w in stack.workers if w.name.startswith("train")).log.read_text()
    assert trainer_log.count("eagle3q.train.train[") >= 1
    assert trainer_log.count("succeeded") == 1
    assert (train_dir(stack.store, "e2e") / "export" / "model.safetensors").is_file()


def test_an_fp8_store_through_the_pipeline(stack_factory, tiny):  # noqa: ANN001
    """EAGLE3Q_HS_DTYPE=fp8 from enqueue to the export: every file fp8 and checked for consistency on what it
    stores, `status` measuring about half bf16's bytes a token, and the trainer reading the files restored."""
    from eagle3q.extraction.estimate import bytes_per_token
    from eagle3q.status import snapshot
    from eagle3q.store.hidden_format import stored_dtype

    # The simulator generating greedily with the tiny target: its own text, so the consistency check runs.
    stack = stack_factory(sim_args=["--target-model", str(tiny)],
                          env={"EAGLE3Q_HS_DTYPE": "fp8", "EAGLE3Q_EPOCHS": "1", "EAGLE3Q_TRAIN_BATCH_TOKENS": "1",
                               "EAGLE3Q_VAL_FRACTION": "0", "EAGLE3Q_TEMPERATURE": "0", "EAGLE3Q_TOP_P": "1"})
    stack.worker("inference", concurrency=8)
    stack.worker("hidden_states")
    stack.worker("train")
    stack.enqueue(SAMPLE_DATASET, "fp8", max_samples=12)
    stack.wait_settled("fp8", stages=("inference", "hidden_states"), timeout_s=180)
    done = stack.ledger.done_ids("fp8", "hidden_states")
    assert len(done) == 12
    assert {stored_dtype(stack.store.hidden_header("fp8", sid)) for sid in done} == {"fp8"}
    from safetensors import safe_open

    top1 = []
    for sid in done:
        with safe_open(str(hidden_file(stack.store, "fp8", sid)), framework="pt") as f:
            top1.append(json.loads(f.metadata()["consistency"])["top1"])
    # e4m3's rounding flips some of the random tiny target's near-tied argmaxes (bf16: ~1.0; bench_fp8 measures it)
    assert min(top1) >= 0.8 and sum(top1) / len(top1) >= 0.9, top1
    per_token = snapshot(stack.ledger, "fp8")["stages"]["hidden_states"]["bytes_per_token"]
    h = 64
    assert bytes_per_token(h, hs_dtype="fp8") <= per_token < 0.65 * bytes_per_token(h), per_token
    deadline = time.monotonic() + 180
    while stack.ledger.train_progress("fp8").get("state") != "done" and time.monotonic() < deadline:
        time.sleep(0.5)
    result = json.loads((train_dir(stack.store, "fp8") / "result.json").read_text())
    assert result["steps"] == 12 and result["final_loss"] == result["final_loss"]  # trained, and not NaN
    assert (train_dir(stack.store, "fp8") / "export" / "model.safetensors").is_file()
