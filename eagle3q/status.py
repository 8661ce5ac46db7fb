"""`eagle3q status`: per stage, what came in, what is done, rejected (by reason) and still queued; rates and ETA.

The counts add up by construction: pending = incoming - done - rejected, all read from the same ledger."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console, Group
from rich.table import Table

from eagle3q.config import get_settings
from eagle3q.contract import HIDDEN_STATES, INFERENCE
from eagle3q.control.ledger import STAGES, Ledger, StageCounts


def _fmt_eta(eta: float | None) -> str:
    if eta is None:
        return "-"
    if eta <= 0:
        return "done"
    h, rem = divmod(int(eta), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def connector_backlog(directory: str) -> dict | None:
    """Files the extraction vLLM's connector wrote and no worker has read yet (EAGLE3Q_HS_CONNECTOR_DIR)."""
    if not directory:
        return None
    root = Path(directory)
    files = list(root.glob("*.safetensors")) if root.is_dir() else []
    return {"dir": directory, "files": len(files), "bytes": sum(p.stat().st_size for p in files if p.exists())}


def snapshot(ledger: Ledger, run: str) -> dict:
    """Everything `status` shows, as plain data (also what `status --json` prints)."""
    stages = {s: ledger.counts(run, s) for s in STAGES}
    meta = ledger.meta(run)
    out: dict = {"run": run, "meta": meta, "stages": {}, "train": ledger.train_progress(run),
                 "train_fired": ledger.train_fired(run), "bad_rows": int(meta.get("bad_rows", 0) or 0),
                 "duplicate_prompts": int(meta.get("duplicate_prompts", 0) or 0),
                 "skipped_duplicates": int(meta.get("skipped_duplicates", 0) or 0),
                 "dead_letters": ledger.dead_letters(), "refused_workers": ledger.refused_workers(),
                 "connector": connector_backlog(get_settings().hs_connector_dir)}
    for name, c in stages.items():
        gen_tokens = c.stats.get("completion_tokens", 0)
        tokens = c.stats.get("tokens", 0)
        out["stages"][name] = {
            "incoming": c.incoming, "done": c.done, "rejected": c.rejected, "pending": c.pending,
            "reasons": c.reasons, "rate_per_s": round(c.rate, 3), "eta_s": c.eta_s,
            "generated_tokens": gen_tokens, "prompt_tokens": c.stats.get("prompt_tokens", 0),
            "tokens_per_s": round(_token_rate(c), 1), "bytes": c.stats.get("bytes", 0),
            "bytes_per_token": round(c.stats.get("bytes", 0) / tokens, 1) if tokens else None,
            "retries": {k[6:]: v for k, v in c.stats.items() if k.startswith("retry_")},
            "store_errors": c.stats.get("store_errors", 0),
            "task_errors": c.stats.get("task_errors", 0),
            "server_too_old": c.stats.get("server_too_old", 0),
            "resent_lost": c.stats.get("resent_lost", 0),
        }
        if c.stats.get("hs_checked"):  # the hidden-state consistency check (eagle3q.extraction.consistency)
            n = c.stats["hs_checked"]
            out["stages"][name]["consistency"] = {"checked": n,
                                                  "mean_top1": round(c.stats.get("hs_check_milli", 0) / n / 1000, 3),
                                                  "inconsistent": c.reasons.get("hs_inconsistent", 0)}
    out["store"] = store_projection(out["stages"], *_store_free_bytes())
    return out


def _store_free_bytes() -> tuple[int | None, str]:
    """The store's free space (a directory's; None where it is not mounted here, or for an object store) and URL."""
    from eagle3q.store import Store

    store = Store.from_settings(get_settings())
    return store.free_bytes(), store.url


def store_projection(stages: dict, free: int | None, url: str = "") -> dict | None:
    """The hidden-state objects the run will have written when every sample still in the pipeline is extracted:
    the bytes so far per finished sample x the samples left (enqueued, not rejected, not yet extracted: an upper
    bound when more will be rejected), against the store's free space (None: an object store, or a directory not
    mounted where status runs). The bytes come from the ledger, so this reads the same for a local or an S3 store."""
    inf, hs = stages[INFERENCE.name], stages[HIDDEN_STATES.name]
    if not hs["done"] or not hs["bytes"]:
        return None
    left = max(0, inf["incoming"] - inf["rejected"] - hs["done"] - hs["rejected"])
    more = hs["bytes"] / hs["done"] * left
    return {"url": url, "bytes": hs["bytes"], "projected_bytes": round(hs["bytes"] + more), "samples_left": left,
            "free_bytes": free, "fits": None if free is None else more <= free}


def _token_rate(c: StageCounts) -> float:
    done = c.done or 1
    per_sample = (c.stats.get("completion_tokens", 0) or c.stats.get("tokens", 0)) / done
    return c.rate * per_sample


def render(snap: dict) -> Group:
    t = Table(title=f"eagle3q run [bold]{snap['run']}[/bold]", expand=False)
    for col in ("stage", "in", "done", "rejected", "queued", "req/s", "tok/s", "ETA", "stored"):
        t.add_column(col, justify="right" if col != "stage" else "left")
    for name, st in snap["stages"].items():
        stored = _fmt_bytes(st["bytes"]) if st["bytes"] else "-"
        if st["bytes_per_token"]:
            stored += f" ({st['bytes_per_token']:.0f} B/tok)"
        t.add_row(name, str(st["incoming"]), str(st["done"]), str(st["rejected"]), str(st["pending"]),
                  f"{st['rate_per_s']:.2f}", f"{st['tokens_per_s']:.0f}", _fmt_eta(st["eta_s"]), stored)
    parts: list = [t]
    reasons = Table(title="rejected by reason", expand=False)
    reasons.add_column("stage")
    reasons.add_column("reason")
    reasons.add_column("count", justify="right")
    any_reason = False
    for name, st in snap["stages"].items():
        for reason, n in sorted(st["reasons"].items(), key=lambda kv: -kv[1]):
            reasons.add_row(name, reason, str(n))
            any_reason = True
    if any_reason:
        parts.append(reasons)
    extra = []
    if snap["bad_rows"]:
        extra.append(f"bad data-set rows (not enqueued): {snap['bad_rows']} (see `eagle3q bad-rows`)")
    if snap.get("duplicate_prompts"):
        skipped = snap.get("skipped_duplicates", 0)
        extra.append(f"exact duplicate prompts in the data set: {snap['duplicate_prompts']} ("
                     + (f"{skipped} not generated: temperature 0 gives the same completion; rejected as "
                        "duplicate_prompt" if skipped else "all generated: sampled, each is more data")
                     + "; kept on one side of the held-out split)")
    if snap.get("dead_letters"):
        extra.append("[red]items on the queues that were not messages, set aside: "
                     + ", ".join(f"{q}={n}" for q, n in sorted(snap["dead_letters"].items()))
                     + " (e3q:dead:<queue>)[/red]")
    for worker, r in sorted((snap.get("refused_workers") or {}).items()):
        extra.append(f"[red]worker {worker} refused to start: {r['cause']} (fix its settings; it starts once they "
                     "are right)[/red]")
    if snap.get("connector") and snap["connector"]["files"]:
        c = snap["connector"]
        extra.append(f"extraction connector backlog in {c['dir']}: {c['files']} files, {_fmt_bytes(c['bytes'])}")
    retries = snap["stages"][INFERENCE.name]["retries"]
    if retries:
        extra.append("transient errors retried: " + ", ".join(f"{k}={v}" for k, v in sorted(retries.items())))
    for name, st in snap["stages"].items():
        if st.get("server_too_old"):
            extra.append(f"[red]{name}: tasks held back {st['server_too_old']} times because the vLLM server is too "
                         "old for the profile (see the worker log; upgrade it)[/red]")
        if st["store_errors"]:
            extra.append(f"[red]store write errors in {name}: {st['store_errors']} (tasks kept and retried)[/red]")
        if st["task_errors"]:
            extra.append(f"[red]unexpected task errors in {name}: {st['task_errors']} (tasks kept and retried; "
                         "see the worker logs)[/red]")
        if st.get("consistency"):
            cc = st["consistency"]
            colour = "red" if cc["inconsistent"] else "green"
            extra.append(f"[{colour}]{name} consistency: mean top-1 agreement {cc['mean_top1']:.3f} of the final state "
                         f"with the next token over {cc['checked']} samples, {cc['inconsistent']} rejected as "
                         f"hs_inconsistent[/{colour}]")
        if st["resent_lost"]:
            extra.append(f"[yellow]{name} tasks lost by the broker and sent again: {st['resent_lost']}[/yellow]")
    sp = snap.get("store")
    if sp and sp["samples_left"]:
        line = (f"store {sp.get('url', '')}: {_fmt_bytes(sp['bytes'])} of hidden states, "
                f"{_fmt_bytes(sp['projected_bytes'])} projected when the {sp['samples_left']} samples left are "
                "extracted")
        if sp["free_bytes"] is not None:
            line += f"; {_fmt_bytes(sp['free_bytes'])} free"
        if sp["fits"] is False:
            line = f"[red]{line}: the store will fill before the run ends: free space, or move EAGLE3Q_STORE_URL[/red]"
        extra.append(line)
    tr = snap["train"]
    if tr:
        line = f"training: {tr.get('state', '?')} step {tr.get('step', 0)}/{tr.get('total_steps', '?')}"
        if "loss" in tr:
            line += f" loss {float(tr['loss']):.4f}"
        if "epoch" in tr:
            line += f" epoch {tr['epoch']}"
        if "acc" in tr:
            line += f" acc@ttt {tr['acc']}"
        if tr.get("val_acc") not in (None, "", "[]"):
            line += f" | held-out acc@ttt {tr['val_acc']} prefix {tr.get('val_prefix_acc', '')}"
        if "acceptance" in tr:
            line += f" | mean acceptance length at k=5 {tr['acceptance']}"
            if "bigram" in tr:
                line += f" (bigram table {tr['bigram']})"
        if tr.get("state") == "failed":
            line = f"[red]{line}: {tr.get('error', '')} (see the trainer log; `eagle3q train` reruns it)[/red]"
        extra.append(line)
    elif snap["train_fired"]:
        extra.append("training: triggered, waiting for a trainer")
    parts.extend(extra)
    return Group(*parts)


def _console() -> Console:
    """Piped output (CI logs, files) gets a wide table instead of rich's 80-column default."""
    return Console(width=None if sys.stdout.isatty() else 140)


def show(ledger: Ledger, run: str, watch: bool = False, every_s: float = 2.0, console: Console | None = None) -> None:
    console = console or _console()
    if not watch:
        console.print(render(snapshot(ledger, run)))
        return
    from rich.live import Live

    with Live(render(snapshot(ledger, run)), console=console, refresh_per_second=2) as live:
        while True:
            time.sleep(every_s)
            live.update(render(snapshot(ledger, run)))


WAITABLE = (*STAGES, "train")


def drained(snap: dict, stage: str) -> bool:
    """`stage` has nothing left to do in this run: every prompt enqueued and every one that reached the stage done
    or rejected (inference, hidden_states), or the draft trained (train). What a hand-off between servers on the
    same GPUs waits for (docs/deployment.md)."""
    if stage == "train":
        return snap["train"].get("state") == "done"
    if str(snap["meta"].get("enqueue_complete")) != "1":
        return False
    for name in STAGES[: STAGES.index(stage) + 1]:
        st = snap["stages"][name]
        if st["pending"] or not st["incoming"]:
            return False
    return True


def wait_for(ledger: Ledger, run: str, stage: str, timeout_s: float = 0, every_s: float = 2.0,
             console: Console | None = None) -> int:
    """Block until `drained(stage)`, printing one progress line a minute; 0 when drained, 1 on training failure
    or time-out (`timeout_s` > 0), with the status table."""
    console = console or _console()
    t0, last = time.monotonic(), 0.0
    while True:
        snap = snapshot(ledger, run)
        if drained(snap, stage):
            console.print(render(snap))
            return 0
        failed = snap["train"].get("state") == "failed"
        timed_out = timeout_s > 0 and time.monotonic() - t0 > timeout_s
        if failed or timed_out:
            console.print(render(snap))
            console.print(f"[red]{stage} of run {run}: {'training failed' if failed else 'not drained in time'}[/red]")
            return 1
        if time.monotonic() - last >= 60:
            st = snap["stages"].get(stage) or {}
            console.print(f"[{time.monotonic() - t0:5.0f}s] waiting for {stage}: "
                          + (f"{st['done']}+{st['rejected']}/{st['incoming']}" if st else
                             f"{snap['train'].get('state', 'not started')} {snap['train'].get('step', '')}"))
            last = time.monotonic()
        time.sleep(every_s)
