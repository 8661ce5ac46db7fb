"""Learning curve of the draft on the tiny target: acceptance at k = 5 on held-out in-domain prompts and on the
shipped out-of-domain prompts (eagle3q/data/ood_prompts.jsonl), against the number of training samples and the
epochs, beside the bigram table built from the same training samples (the baseline in the same run). Writes
learning_curve.md and learning_curve.png to the work directory and prints the table.

In-domain prompts are drawn from the families of the bundled open-perfectblend sample with their slots filled
anew (topics, languages, tasks, numbers), so there are enough of them for the larger sizes; the held-out ones are
distinct prompts (by eagle3q.prompt_keys) from the same families, never trained on. Every size trains on a prefix
of one pool of samples, so a larger size holds the smaller ones.

The peer column: speculators' own trainer (0.9, `make peers`) on the same samples, exported by `export-data --format
speculators`, with the same settings where the two share one (eagle3q.dev.speculators_cpu, which also names the
three changes it needs on a CPU), its draft measured by the same loop. `--no-peer` leaves it out.

    python bench_learning_curve.py [--sizes 250,1000,4000] [--epochs 5,20] [--heldout 32] [--max-new 64] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from common import report, tiny_target, workdir

from eagle3q.config import Settings
from eagle3q.dev.samples import write_samples
from eagle3q.evaluation.offline import OOD, acceptance_by_set, ood_prompt_sets, with_ood
from eagle3q.generate.profiles import KIMI_K2
from eagle3q.generate.templates import render_prompt
from eagle3q.generate.tokenizer import load_tokenizer
from eagle3q.interop.peer_formats import export_data
from eagle3q.prompt_keys import prompt_key
from eagle3q.sources import Prompt
from eagle3q.stages.train import train_run
from eagle3q.store import Store

TOPICS = ["black holes", "recursion", "binary search", "the French Revolution", "vaccines", "photosynthesis",
          "the printing press", "probability", "quantum entanglement", "DNA replication", "renewable energy",
          "machine translation", "plate tectonics", "hash tables", "sorting algorithms", "climate change",
          "general relativity", "prime numbers", "linked lists", "supply and demand", "the Renaissance",
          "the Roman Empire", "volcanoes"]
LANGS = ["Python", "Rust", "C++", "SQL", "JavaScript", "Go"]
TASKS = ["check if a number is prime", "validate an email address", "count word frequencies in a text",
         "reverse a string", "parse a CSV line", "compute the nth Fibonacci number", "flatten a nested list",
         "find duplicates in an array"]
FOLLOW = ["What is the most surprising fact about it?", "Can you give a concrete example?",
          "How is this used in practice?"]
SYSTEM = "You are a careful assistant who answers concisely."


def in_domain(rng: random.Random) -> list[dict[str, str]]:
    """One prompt from the bundled data set's families, slots filled at random."""
    t, u = rng.choice(TOPICS), rng.choice(TOPICS)
    family = rng.randrange(11)
    text = [f"Give an analogy that explains {t}.", f"Summarize the history of {t} in five sentences.",
            f"Write a {rng.choice(LANGS)} function to {rng.choice(TASKS)}, and explain its time complexity.",
            f"Write a short essay on {t}.",
            f"Solve for x: {rng.randint(2, 999)}x + {rng.randint(1, 999)} = {rng.randint(1000, 9999)}.",
            f"Is {rng.randint(1000, 999999)} a prime number? Explain.",
            f"What is {rng.randint(10, 999)} times {rng.randint(10, 999)}? Show your work.",
            f"A train travels {rng.randint(50, 900)} km in {rng.randint(2, 12)} hours. What is its average speed?",
            f"What are three common misconceptions about {t}?",
            f"Compare {t} with {u} and list the key differences.",
            f"Explain {t} to a high school student."][family]
    msgs = [{"role": "user", "content": text}]
    if family in (0, 3, 10) and rng.random() < 0.4:  # some rows open with the system line, as the data set's do
        msgs.insert(0, {"role": "system", "content": SYSTEM})
    if family == 10 and rng.random() < 0.5:  # and some are second turns ("Tell me about X." + a follow-up)
        msgs = [{"role": "user", "content": f"Tell me about {t}."},
                {"role": "assistant", "content": f"{t} is a broad subject."},
                {"role": "user", "content": rng.choice(FOLLOW)}]
    return msgs


def prompt_pool(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Prompt], list[list[dict[str, str]]]]:
    """Distinct prompts: n_train for training, then n_heldout others for evaluation."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n_train + n_heldout:
        msgs = in_domain(rng)
        if (key := prompt_key(msgs)) not in seen:
            seen.add(key)
            out.append(msgs)
    train = [Prompt(row=i, turn=0, messages=m) for i, m in enumerate(out[:n_train])]
    return train, out[n_train:]


def link_prefix(store: Store, pool_run: str, run: str, ids: list[str]) -> None:
    """A run of the first len(ids) samples of the pool (hard links: no copies)."""
    for sid in ids:
        paths = store.blobs.path  # a local store (the bench builds it)
        for src, dst in ((paths(store.hidden_key(pool_run, sid)), paths(store.hidden_key(run, sid))),
                         (paths(store.sample_key(pool_run, sid)), paths(store.sample_key(run, sid)))):
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                os.link(src, dst)


def peer_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("speculators") is not None


def main(sizes: tuple[int, ...] = (250, 1000, 4000), epochs: tuple[int, ...] = (5, 20), heldout: int = 32,
         max_new: int = 64, base: Path | None = None, peer: bool = True) -> list[dict]:
    base = base or workdir("learning-curve")
    tiny = tiny_target(base, with_model=True)
    store = Store(base / "store")
    train_prompts, held_msgs = prompt_pool(max(sizes), heldout)
    t0 = time.monotonic()
    ids = write_samples(tiny, store, "pool", train_prompts)
    gen_s = time.monotonic() - t0
    tok = load_tokenizer(str(tiny))
    held = [tok.encode(render_prompt(KIMI_K2, m, True)) for m in held_msgs]
    sets, groups, _ = with_ood(held, ood_prompt_sets(str(tiny), "kimi_k2", True))
    rows = []
    for n in sizes:
        for ep in epochs:
            run = f"n{n}-e{ep}"
            link_prefix(store, "pool", run, ids[:n])
            # The demo's settings, nothing held out of the run (the evaluation prompts are outside it).
            s = Settings(store_dir=base / "store", target_model=str(tiny), draft_vocab_size=512, epochs=ep, lr=5e-3,
                         train_batch_tokens=1024, val_fraction=0.0, checkpoint_every=10**6)
            t1 = time.monotonic()
            r = train_run(run, s, store)
            train_s = time.monotonic() - t1
            row = {"samples": n, "epochs": ep, "steps": r.steps, "train_s": round(train_s, 1)}
            others = {}
            if peer:
                from eagle3q.dev.speculators_cpu import train

                data = export_data(store, run, "speculators", base / "speculators" / run, str(tiny), progress=False,
                                   val_fraction=0.0, draft_vocab_size=s.draft_vocab_size).out_dir
                t1 = time.monotonic()
                others["speculators"] = str(train(
                    data, tiny, base / "speculators" / f"{run}-ckpt", epochs=ep, lr=s.lr,
                    draft_vocab_size=s.draft_vocab_size, ttt_steps=s.ttt_steps, seq_len=s.train_batch_tokens,
                    log=base / "speculators" / f"{run}.log"))
                row["speculators train_s"] = round(time.monotonic() - t1, 1)
            # Both drafts on the same greedy paths of the target, computed once.
            res = acceptance_by_set(str(tiny), r.export_dir, sets, groups, store, run, ks=(5,), max_new=max_new,
                                    others=others)
            for name in ("held-out", OOD):
                row[f"{name} trained"] = res[name].mean["trained"][5]
                row[f"{name} bigram"] = res[name].mean["bigram"][5]
                if peer:
                    row[f"{name} speculators"] = res[name].mean["speculators"][5]
            rows.append(row)
            print(json.dumps(row), flush=True)
    _write(base, rows, gen_s, len(ids))
    return rows


def _write(base: Path, rows: list[dict], gen_s: float, n: int) -> None:
    peer = all(f"{OOD} speculators" in r for r in rows)
    head = "| samples | epochs | steps | train s | held-out: trained | bigram | margin | out-of-domain: trained | " \
           "bigram | margin |"
    lines = [head + (" held-out: speculators | out-of-domain: speculators | speculators train s |" if peer else ""),
             "|---" * (10 + 3 * peer) + "|"]
    for r in rows:
        h, o = r["held-out trained"] - r["held-out bigram"], r[f"{OOD} trained"] - r[f"{OOD} bigram"]
        lines.append(f"| {r['samples']} | {r['epochs']} | {r['steps']} | {r['train_s']} | {r['held-out trained']:.3f} "
                     f"| {r['held-out bigram']:.3f} | {h:+.3f} | {r[f'{OOD} trained']:.3f} | "
                     f"{r[f'{OOD} bigram']:.3f} | {o:+.3f} |" + (
                         f" {r['held-out speculators']:.3f} | {r[f'{OOD} speculators']:.3f} | "
                         f"{r['speculators train_s']} |" if peer else ""))
    (base / "learning_curve.md").write_text("\n".join(lines) + "\n")
    report(f"learning curve, acceptance at k=5 ({n} samples generated in {gen_s:.0f} s; {base})",
           [(f"n={r['samples']} epochs={r['epochs']}", f"held-out {r['held-out trained']:.3f} (bigram "
             f"{r['held-out bigram']:.3f})  out-of-domain {r[f'{OOD} trained']:.3f} (bigram "
             f"{r[f'{OOD} bigram']:.3f})" + (f"  speculators: held-out {r['held-out speculators']:.3f}, "
                                             f"out-of-domain {r[f'{OOD} speculators']:.3f}" if peer else ""))
            for r in rows])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ep in enumerate(sorted({r["epochs"] for r in rows})):
        sel = [r for r in rows if r["epochs"] == ep]
        xs = [r["samples"] for r in sel]
        ax.plot(xs, [r["held-out trained"] for r in sel], "-o", color=f"C{i}", label=f"held-out, {ep} epochs")
        ax.plot(xs, [r[f"{OOD} trained"] for r in sel], "--o", color=f"C{i}", label=f"out-of-domain, {ep} epochs")
        if peer:
            ax.plot(xs, [r[f"{OOD} speculators"] for r in sel], ":s", color=f"C{i}",
                    label=f"out-of-domain, {ep} epochs, speculators' trainer")
    sel = [r for r in rows if r["epochs"] == rows[-1]["epochs"]]
    ax.plot([r["samples"] for r in sel], [r["held-out bigram"] for r in sel], ":", color="grey",
            label="bigram, held-out")
    ax.plot([r["samples"] for r in sel], [r[f"{OOD} bigram"] for r in sel], "-.", color="grey",
            label="bigram, out-of-domain")
    ax.set(xscale="log", xlabel="training samples", ylabel="mean acceptance length, k = 5",
           title="draft learning curve (tiny target, greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(base / "learning_curve.png", dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="250,1000,4000")
    ap.add_argument("--epochs", default="5,20")
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-peer", action="store_true", help="leave speculators' trainer out")
    a = ap.parse_args()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    main(tuple(int(x) for x in a.sizes.split(",")), tuple(int(x) for x in a.epochs.split(",")), a.heldout,
         a.max_new, a.out, peer=not a.no_peer and peer_installed())
