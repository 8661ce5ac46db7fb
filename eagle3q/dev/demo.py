"""`make demo`: the whole product on one machine, on the bundled data set and a tiny local target.

redis-server, the simulator (generating with the tiny target, as vLLM would serve the real one), an inference
consumer, a hidden-state worker and a trainer, all real processes; it ends with the status table and the trained
draft's acceptance length against an untrained one."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from eagle3q.dev.local import LocalStack, wait_worker_ready
from eagle3q.dev.tiny import SAMPLE_DATASET, build_model
from eagle3q.status import render, snapshot


def run_demo(workdir: Path, max_samples: int | None, timeout_s: float = 600) -> int:
    console = Console(width=140)
    workdir = workdir.resolve()
    tiny = workdir / "tiny"
    if not (tiny / "model.safetensors").is_file():
        console.print("building the tiny local target ...")
        build_model(tiny)
    run = f"demo-{int(time.time())}"
    stack = LocalStack(
        workdir, tiny,
        sim_args=["--ttft", "0.01", "--itl", "0.001", "--mean-output-tokens", "48", "--target-model", str(tiny)],
        env={"EAGLE3Q_EPOCHS": "2", "EAGLE3Q_LR": "3e-3", "EAGLE3Q_CHECKPOINT_EVERY": "100",
             "EAGLE3Q_TOKEN_BUDGET": "8192", "EAGLE3Q_REQUEST_TIMEOUT_S": "120"},
    )
    try:
        stack.worker("inference", concurrency=16, wait=False)
        stack.worker("hidden_states", wait=False)
        stack.worker("train", wait=False)
        for p in stack.workers:
            wait_worker_ready(p)
        ledger, s = stack.ledger, stack.settings
        rep = stack.enqueue(SAMPLE_DATASET, run, max_samples=max_samples)
        console.print(f"run [bold]{run}[/bold]: enqueued {rep.enqueued} prompts from {SAMPLE_DATASET.name} "
                      f"({len(rep.bad_rows)} bad rows); logs in {workdir / 'logs'}")
        t0, last = time.monotonic(), 0.0
        while time.monotonic() - t0 < timeout_s:
            if ledger.train_progress(run).get("state") == "done":
                break
            if time.monotonic() - last > 10:
                snap = snapshot(ledger, run)
                inf, hs = snap["stages"]["inference"], snap["stages"]["hidden_states"]
                tr = snap["train"]
                console.print(f"[{time.monotonic() - t0:5.0f}s] inference {inf['done']}+{inf['rejected']}"
                              f"/{inf['incoming']}  hidden states {hs['done']}/{hs['incoming']}  "
                              f"train {tr.get('state', '-')} {tr.get('step', '')}/{tr.get('total_steps', '')}")
                last = time.monotonic()
            time.sleep(1)
        else:
            console.print("[red]demo timed out[/red]")
            return 1
        console.print(render(snapshot(ledger, run)))
        from eagle3q.eagle3.evaluate import dataset_prompts, evaluate

        prompts = dataset_prompts(SAMPLE_DATASET, str(tiny), "kimi_k2", True, 8, stride=25, offset=3)  # a spread
        export = s.store_dir / run / "train" / "export"
        trained = evaluate(str(tiny), str(export), prompts, max_new=32)
        untrained = evaluate(str(tiny), None, prompts, max_new=32, draft_vocab_size=s.draft_vocab_size)
        ledger.set_train_progress(run, acceptance=trained[3])
        console.print("mean acceptance length (greedy speculative decoding against the tiny target, k drafts):")
        for k in trained:
            console.print(f"  k={k}: trained {trained[k]:.2f}   untrained {untrained[k]:.2f}")
        console.print(f"draft checkpoint for vLLM: {export}  ({time.monotonic() - t0:.0f}s)")
        return 0
    finally:
        stack.close()
