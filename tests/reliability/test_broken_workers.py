"""Workers that cannot do their stage's work: found first by running the compose stack (issue 35), where a consumer
without its tokenizer reported ready, failed every task and the sweep re-sent all 240 of them every two minutes."""

from __future__ import annotations

import time

from eagle3q.dev.tiny import SAMPLE_DATASET, build_model, build_tokenizer
from eagle3q.status import render, snapshot
from tests.store_paths import run_dir


def _wait_exit(proc, timeout_s: float = 90) -> int:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not proc.alive(), f"{proc.name} still running: {proc.log.read_text()[-2000:]}"
    return proc.proc.returncode


def test_a_worker_that_cannot_build_its_context_refuses_to_start(stack_factory, tmp_path):  # noqa: ANN001
    stack = stack_factory()
    # A hub id with no tokenizer.json and no transformers cache behind it: what the light image got in compose.
    inf = stack.worker("inference", wait=False, EAGLE3Q_TOKENIZER=str(tmp_path / "no-such-tokenizer"),
                       HF_HUB_OFFLINE="1")
    hs = stack.worker("hidden_states", wait=False, EAGLE3Q_TARGET_MODEL=str(tmp_path / "no-such-target"))
    assert _wait_exit(inf) != 0 and _wait_exit(hs) != 0
    log = inf.log.read_text()
    assert "the inference worker cannot start" in log and "ready." not in log
    assert "the hidden_states worker cannot start" in hs.log.read_text()
    refused = stack.ledger.refused_workers()
    assert len(refused) == 2, refused
    causes = {w.split("@")[0]: r["cause"] for w, r in refused.items()}
    assert "no-such-tokenizer" in causes["inference"] and "no-such-target" in causes["hidden_states"]
    # status names the cause, with the run's counts still adding up (nothing was taken)
    stack.enqueue(SAMPLE_DATASET, "broken", max_samples=4)
    snap = snapshot(stack.ledger, "broken")
    assert snap["stages"]["inference"]["pending"] == 4 and snap["stages"]["inference"]["done"] == 0
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "refused to start" in text and "does not exist" in text and "no-such-tokenizer" in text
    # a good worker takes the queued prompts
    stack.worker("inference")
    stack.wait_settled("broken")
    assert stack.ledger.counts("broken", "inference").done == 4


def test_a_sample_failing_the_same_way_every_time_is_rejected_by_name(stack_factory, tmp_path):  # noqa: ANN001
    """A bug on every sample (here a target whose vocabulary is smaller than the generating model's: the embedding
    lookup raises) ends each sample as `task_error` after EAGLE3Q_MAX_RETRIES, instead of retrying for ever; the
    counts add up and the run drains."""
    small = tmp_path / "small-target"
    build_tokenizer(small, vocab_size=300)
    build_model(small)
    stack = stack_factory(env={"EAGLE3Q_MAX_RETRIES": "2"})
    stack.worker("inference")
    stack.worker("hidden_states", EAGLE3Q_TARGET_MODEL=str(small))
    rep = stack.enqueue(SAMPLE_DATASET, "bug", max_samples=6)
    assert rep.enqueued == 6
    stack.wait_settled("bug", stages=("inference", "hidden_states"), timeout_s=180)
    inf, hs = stack.ledger.counts("bug", "inference"), stack.ledger.counts("bug", "hidden_states")
    assert inf.done == 6 and hs.incoming == 6
    assert hs.rejected == 6 and hs.reasons == {"task_error": 6}, hs
    files = list((run_dir(stack.store, "bug") / "rejected" / "hidden_states").glob("*/*.json"))
    assert len(files) == 6 and all("IndexError" in f.read_text() for f in files)
    assert snapshot(stack.ledger, "bug")["stages"]["hidden_states"]["task_errors"] == 6 * 3  # 1 try + 2 retries
