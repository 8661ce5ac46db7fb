"""`make demo`: the whole product on one machine, on the bundled data set and a tiny local target.

redis-server, the simulator (generating with the tiny target, as vLLM would serve the real one), an inference
consumer, a hidden-state worker and a trainer, all real processes; it ends with the status table and the trained
draft's acceptance length on held-out prompts, beside a bigram table's (the baseline a draft must beat) and the
ceiling."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from eagle3q.dev.local import LocalStack, wait_worker_ready
from eagle3q.dev.tiny import SAMPLE_DATASET, build_model
from eagle3q.status import render, snapshot


def run_demo(workdir: Path, max_samples: int | None, timeout_s: float = 600, hs_backend: str = "transformers") -> int:
    """`hs_backend="vllm"`: the hidden states come from the simulator playing a vLLM with extract_hidden_states
    (connector files in `workdir/connector`), read by the hidden-state worker as on a Kimi deployment."""
    console = Console(width=140)
    workdir = workdir.resolve()
    tiny = workdir / "tiny"
    if not (tiny / "model.safetensors").is_file():
        console.print("building the tiny local target ...")
        build_model(tiny)
    run = f"demo-{int(time.time())}"
    sim_args = ["--ttft", "0.01", "--itl", "0.001", "--mean-output-tokens", "48", "--target-model", str(tiny)]
    if hs_backend == "vllm":
        sim_args += ["--hs-dir", str(workdir / "connector")]
    stack = LocalStack(
        workdir, tiny,
        sim_args=sim_args,
        # Sized for 2 CPU cores: 20 epochs of ~160 samples in ~1024-token batches (~80 s), a fifth of the rows held
        # out for the evaluation.
        env={"EAGLE3Q_EPOCHS": "20", "EAGLE3Q_LR": "5e-3", "EAGLE3Q_TRAIN_BATCH_TOKENS": "1024",
             "EAGLE3Q_VAL_FRACTION": "0.2", "EAGLE3Q_CHECKPOINT_EVERY": "100", "EAGLE3Q_TOKEN_BUDGET": "8192",
             "EAGLE3Q_REQUEST_TIMEOUT_S": "120", "EAGLE3Q_HS_BACKEND": hs_backend,
             "EAGLE3Q_HS_CONNECTOR_DIR": str(workdir / "connector")},
    )
    stack.env["EAGLE3Q_HS_VLLM_BASE_URL"] = stack.sim_urls[0]  # the same simulator serves both APIs
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
        from eagle3q.eagle3.evaluate import acceptance_table, format_table, heldout_prompts

        prompts = heldout_prompts(stack.store, run, 32)
        export = s.store_dir / run / "train" / "export"
        table = acceptance_table(str(tiny), str(export), prompts, stack.store, run, max_new=64)
        ledger.set_train_progress(run, acceptance=table["trained"][5], bigram=table["bigram"][5])
        console.print(f"mean acceptance length, greedy speculative decoding against the tiny target, on "
                      f"{len(prompts)} held-out prompts x 64 tokens (k drafts per round):")
        console.print(format_table(table))
        console.print(f"draft checkpoint for vLLM: {export}  ({time.monotonic() - t0:.0f}s)")
        return 0
    finally:
        stack.close()
