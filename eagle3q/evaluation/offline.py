"""Quality, measured: greedy speculative decoding of the draft against its target, and the mean acceptance length.

Each round the draft proposes k tokens after the last verified one; the target checks them in one forward pass and
keeps the longest matching prefix plus its own next token. Acceptance length = accepted drafts + 1 (the bonus token),
so 1.0 means the draft never helps and k+1 is perfect (the ceiling: the target as its own draft).

Baselines in the same loop: a bigram table (no network: each token -> the token that follows it most often in the
run's training samples), which any draft that uses the target's hidden states must beat, and an untrained draft.
Prompts are held out: the prompt part of the run's validation samples (`eagle3q.draft.manifest`), never trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from eagle3q.draft.model import Eagle3Draft


@dataclass(frozen=True)
class GreedyPath:
    """The target's greedy continuation of one prompt, computed once: under greedy verification every accepted
    token and every bonus token is the target's own argmax, so whatever the draft proposes, the sequence is this
    path; only how many tokens each round gains differs. `next_token[t]` is the target's argmax after position t,
    `aux[t]` its aux states at t (one forward over the whole path, as a verify forward sees them)."""

    tokens: list[int]
    next_token: list[int]
    aux: torch.Tensor


@dataclass
class TargetRunner:
    model: object  # transformers CausalLM
    aux_ids: list[int]

    @torch.no_grad()
    def __call__(self, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[i][0] for i in self.aux_ids], -1).float()
        return out.logits[0].float(), aux

    @torch.no_grad()
    def greedy_path(self, prompt: Sequence[int], new: int) -> GreedyPath:
        """`new` greedy tokens after the prompt (no stop at eos, as vLLM's `ignore_eos`). Generated with the KV
        cache, then checked by one full forward: where its argmax differs (a near tie decided otherwise without the
        cache), the full forward's token wins and generation resumes from there."""
        from transformers import DynamicCache

        seq = list(prompt)
        attempts = 8  # a correction per near tie; bounded, should rounding ever flip one back and forth
        for attempt in range(attempts):
            cache = DynamicCache()
            out = self.model(torch.tensor([seq]), None, None, cache, use_cache=True)  # positional: the cache's
            tok = int(out.logits[0, -1].argmax())  # keyword changed its name across transformers releases
            while len(seq) < len(prompt) + new:
                seq.append(tok)
                out = self.model(torch.tensor([[tok]]), None, None, cache, use_cache=True)
                tok = int(out.logits[0, -1].argmax())
            logits, aux = self(seq)
            nxt = logits.argmax(-1).tolist()
            bad = next((t for t in range(len(prompt), len(seq)) if seq[t] != nxt[t - 1]), None)
            if bad is None or attempt == attempts - 1:
                return GreedyPath(seq, nxt, aux)
            seq = seq[:bad] + [nxt[bad - 1]]
        raise AssertionError("unreachable")


@torch.no_grad()
def propose(draft: Eagle3Draft, d2t_full: torch.Tensor, seq: list[int], aux: torch.Tensor, k: int) -> list[int]:
    """k draft tokens after `seq`, given the target's aux states for seq[:-1] (the last token is not verified by a
    forward yet: it is the target's own prediction). Step 0 runs over every row (its keys are what later steps
    attend to); steps 1.. only on the last row, the one speculating past the sequence: in the TTT attention a row
    sees the step-0 keys up to itself and its own chain, so the other rows' later steps change nothing."""
    n = len(seq) - 1  # rows 0..n-1: row t pairs the state at t with token seq[t+1]
    cache: list = []
    logits, h = draft.step(torch.tensor([seq[1 : n + 1]]), draft.combine(aux[:n]).unsqueeze(0), torch.arange(n), cache)
    out: list[int] = []
    for step in range(k):
        if step:
            logits, h = draft.step(torch.tensor([[out[-1]]]), h, torch.tensor([n - 1 + step]), cache)
        out.append(int(d2t_full[int(logits[0, -1].argmax())]))
        h = h[:, -1:]
    return out


Proposer = Callable[[list[int], torch.Tensor, int], list[int]]  # (sequence, its aux states, k) -> k tokens


def draft_proposer(draft: Eagle3Draft, d2t: torch.Tensor) -> Proposer:
    d2t_full = d2t + torch.arange(d2t.numel())
    return lambda seq, aux, k: propose(draft, d2t_full, seq, aux, k)


@dataclass
class Bigram:
    """token -> the token that most often follows it in the training samples' generated text."""

    table: dict[int, int]
    fallback: int

    @classmethod
    def from_tokens(cls, samples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> Bigram:
        """From (input ids, loss mask) of each training sample."""
        from collections import Counter

        pairs: Counter[tuple[int, int]] = Counter()
        unigrams: Counter[int] = Counter()
        for ids_, mask_ in samples:
            ids, mask = list(map(int, ids_)), list(map(int, mask_))
            for t in range(1, len(ids)):
                if mask[t]:
                    pairs[(ids[t - 1], ids[t])] += 1
                    unigrams[ids[t]] += 1
        best: dict[int, tuple[int, int]] = {}
        for (a, b), n in sorted(pairs.items()):
            if a not in best or n > best[a][1]:
                best[a] = (b, n)
        return cls({a: b for a, (b, _) in best.items()}, unigrams.most_common(1)[0][0] if unigrams else 0)

    def __call__(self, seq: list[int], aux: torch.Tensor, k: int) -> list[int]:
        out, tok = [], seq[-1]
        for _ in range(k):
            tok = self.table.get(tok, self.fallback)
            out.append(tok)
        return out


@torch.no_grad()
def acceptance_rounds(target: TargetRunner, proposer: Proposer, prompts: list[list[int]], k: int,
                      max_new: int = 48, paths: Sequence[GreedyPath] | None = None) -> list[list[int]]:
    """Per prompt, the length of each drafting round (accepted drafts + 1): the raw record that every figure below
    (mean, per position, per prompt set) is a sum over. Each round the draft proposes k tokens after the last
    verified one; the target keeps the longest prefix equal to its own argmax, plus its own next token. `paths`
    (one per prompt, at least max_new + k tokens long) saves the target's forwards when several drafts or ks are
    measured on the same prompts."""
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        path = paths[i] if paths is not None else target.greedy_path(prompt, max_new + k)
        lengths: list[int] = []
        seq = list(prompt) + [path.next_token[len(prompt) - 1]]
        produced = 1
        while produced < max_new:
            drafts = proposer(seq, path.aux[: len(seq) - 1], k)
            base = len(seq) - 1  # next_token[base] is the target's token after seq
            accepted = 0
            for j, d in enumerate(drafts):
                if path.next_token[base + j] == d:
                    accepted += 1
                else:
                    break
            seq += drafts[:accepted] + [path.next_token[base + accepted]]
            produced += accepted + 1
            lengths.append(accepted + 1)
        out.append(lengths)
    return out


def mean_length(rounds: Sequence[Sequence[int]]) -> float:
    flat = [n for r in rounds for n in r]
    return sum(flat) / len(flat) if flat else 0.0


def per_position(rounds: Sequence[Sequence[int]], k: int) -> list[float]:
    """Position i (0-based): the share of rounds whose first i+1 drafts were all accepted, as vLLM's per-position
    counter divided by its drafts counts them."""
    flat = [n for r in rounds for n in r]
    return [sum(1 for n in flat if n - 1 > i) / len(flat) if flat else 0.0 for i in range(k)]


def dataset_prompts(path: Path, tokenizer: str, profile: str, thinking: bool, n: int, stride: int = 1,
                    offset: int = 0) -> list[list[int]]:
    """The first n prompts of a data set (rows with row % stride == offset), rendered by the profile's template and
    tokenized as the server would."""
    from eagle3q.generate.profiles import get_profile
    from eagle3q.generate.templates import render_prompt
    from eagle3q.generate.tokenizer import load_tokenizer
    from eagle3q.sources import Prompt, iter_prompts

    tok, prof = load_tokenizer(tokenizer), get_profile(profile)
    out: list[list[int]] = []
    for item in iter_prompts(path):
        if len(out) >= n:
            break
        if isinstance(item, Prompt) and item.row % stride == offset:
            out.append(tok.encode(render_prompt(prof, item.messages, thinking)))
    return out


@lru_cache(maxsize=1)
def _target(target_dir: str) -> tuple[object, dict[str, torch.Tensor]]:
    """The target model and its embedding / head tensors, loaded once for every draft measured against it."""
    from transformers import AutoModelForCausalLM

    from eagle3q.target import load_target_tensors

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return model, load_target_tensors(target_dir)


def heldout_prompts(store, run: str, n: int) -> list[list[int]]:  # noqa: ANN001 - an eagle3q.store.Store
    """The prompt tokens of up to n of the run's validation samples (one a prompt; prompts never trained on), as
    the server tokenized them."""
    import json

    from eagle3q.draft.manifest import load

    m = load(store, run)
    out, seen = [], set()
    for e in m.val:  # one sample a prompt: repeats of a prompt would count its completion twice
        if len(out) >= n:
            break
        if e.split_key in seen:
            continue
        seen.add(e.split_key)
        sample = store.read_sample(run, e.sample_id)
        out.append(sample.input_ids[: sample.num_prompt_tokens])
    if not out:
        raise ValueError(f"run {run} has no held-out samples (EAGLE3Q_VAL_FRACTION was {json.dumps(m.val_fraction)})")
    return out


def bigram_for_run(store, run: str) -> Bigram:  # noqa: ANN001
    from eagle3q.draft.manifest import load

    m = load(store, run)
    return Bigram.from_tokens(store.map_samples(lambda sid: store.hidden_tokens(run, sid),
                                                [e.sample_id for e in m.train]))


def evaluate_proposer(target_dir: str, proposer: Proposer, aux_ids: list[int], prompts: list[list[int]],
                      ks: Sequence[int] = (1, 2, 3, 4, 5), max_new: int = 64) -> dict[int, float]:
    runner = TargetRunner(_target(target_dir)[0], aux_ids)
    paths = [runner.greedy_path(p, max_new + max(ks)) for p in prompts]
    return {k: round(mean_length(acceptance_rounds(runner, proposer, prompts, k, max_new, paths)), 3) for k in ks}


def evaluate(target_dir: str, export_dir: str | None, prompts: list[list[int]], ks: Sequence[int] = (1, 2, 3, 4, 5),
             max_new: int = 48, untrained_seed: int | None = None, draft_vocab_size: int = 32000) -> dict[int, float]:
    """Mean acceptance length per k for an exported draft, or (export_dir None) an untrained one as the baseline."""
    from eagle3q.draft.export import load_exported
    from eagle3q.extraction.transformers_backend import default_aux_ids
    from eagle3q.target import target_config

    model, tensors = _target(target_dir)
    if export_dir is not None:
        draft, cfg, d2t, _ = load_exported(Path(export_dir), tensors["embed"])
        aux_ids = cfg["eagle_aux_hidden_state_layer_ids"]  # what vLLM reads
    else:
        from eagle3q.draft.model import DraftConfig

        tcfg = target_config(target_dir)
        dc = DraftConfig.from_target(tcfg, draft_vocab_size)
        torch.manual_seed(untrained_seed or 0)
        draft = Eagle3Draft(dc, tensors["embed"]).eval()
        d2t = torch.zeros(dc.draft_vocab_size, dtype=torch.long)
        aux_ids = default_aux_ids(int(tcfg["num_hidden_layers"]))
    return evaluate_proposer(target_dir, draft_proposer(draft, d2t), aux_ids, prompts, ks, max_new)


def acceptance_table(target_dir: str, export_dir: str, prompts: list[list[int]], store, run: str,  # noqa: ANN001
                     ks: Sequence[int] = (1, 2, 3, 4, 5), max_new: int = 64, draft_vocab_size: int = 32000,
                     untrained: bool = False) -> dict[str, dict[int, float]]:
    """The trained draft, the run's bigram table (and an untrained draft) and the ceiling, on the same prompts."""
    results = acceptance_by_set(target_dir, export_dir, {HELD_OUT: prompts}, {}, store, run, ks, max_new)
    extra = evaluate(target_dir, None, prompts, ks, max_new, draft_vocab_size=draft_vocab_size) if untrained else None
    return held_out_table(results, ks, extra)


OOD_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "ood_prompts.jsonl"
HELD_OUT, OOD = "held-out", "out-of-domain"


def ood_prompt_sets(tokenizer: str, profile: str, thinking: bool,
                    path: Path = OOD_PROMPTS) -> dict[str, list[list[int]]]:
    """The out-of-domain prompts shipped with the package (64, written for eagle3q, worded unlike any training data
    set: chat, code, math, writing and multi-turn), by category, rendered by the profile's template and tokenized
    as the server would. A multi-turn row is one prompt: the whole conversation, the next assistant turn to
    generate."""
    import json

    from eagle3q.generate.profiles import get_profile
    from eagle3q.generate.templates import render_prompt
    from eagle3q.generate.tokenizer import load_tokenizer

    tok, prof = load_tokenizer(tokenizer), get_profile(profile)
    out: dict[str, list[list[int]]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.setdefault(row["category"], []).append(tok.encode(render_prompt(prof, row["messages"], thinking)))
    return out


def with_ood(held_out: list[list[int]], ood: dict[str, list[list[int]]] | None
             ) -> tuple[dict[str, list[list[int]]], dict[str, list[str]], list[str]]:
    """The prompt sets to measure, the groups over them and the order to print: held-out, then out-of-domain all
    together and by category."""
    sets = {HELD_OUT: held_out, **(ood or {})}
    groups = {OOD: list(ood)} if ood else {}
    return sets, groups, [HELD_OUT, *([OOD, *ood] if ood else [])]


def held_out_table(results: dict[str, SetResult], ks: Sequence[int],
                   untrained: dict[int, float] | None = None) -> dict[str, dict[int, float]]:
    """The classic table (trained, bigram, an untrained draft where measured, ceiling per k) for the held-out set."""
    r = results[HELD_OUT]
    table = {"trained": r.mean["trained"], "bigram": r.mean["bigram"]}
    if untrained is not None:
        table["untrained"] = untrained
    return {**table, "ceiling": {k: float(k + 1) for k in ks}}


def plot_positions(results: dict[str, SetResult], served: dict[str, list[float]] | None = None) -> bytes | None:
    """The per-position acceptance at the largest k: the trained draft and the bigram table on the held-out and the
    out-of-domain prompts, and vLLM's own where it was measured (eagle3q.evaluation.plots), as PNG bytes."""
    from eagle3q.evaluation.plots import acceptance_by_position

    series: dict[str, list[float]] = {}
    k = 0
    for name in (HELD_OUT, OOD):
        if name in results:
            k = max(results[name].positions["trained"])
            series[f"trained, {name}"] = results[name].positions["trained"][k]
            series[f"bigram, {name}"] = results[name].positions["bigram"][k]
    for name, rates in (served or {}).items():
        series[f"vLLM, {name}"] = rates
    return acceptance_by_position(series, f"acceptance by draft position (greedy, k = {k} drafts a round)")


EVAL_JSON, POSITIONS_PNG = "eval.json", "acceptance_by_position.png"


def save_report(store, run: str, report: dict, png: bytes | None,  # noqa: ANN001 - an eagle3q.store.Store
                out: Path | None = None) -> list[str]:
    """The evaluation's figures, in the run's train/eval in the store, or in the local directory `out` where one
    is given: where each went."""
    import json

    from eagle3q.store import write_atomic
    from eagle3q.store.run_store import EVAL

    files = {EVAL_JSON: json.dumps(report, indent=1).encode(), **({POSITIONS_PNG: png} if png else {})}
    for name, data in files.items():
        if out is not None:
            write_atomic(out / name, data)
        else:
            store.put_artifact(run, f"{EVAL}/{name}", data)
    return [str(out / n) if out is not None else store.artifact_url(run, f"{EVAL}/{n}") for n in files]


@dataclass
class SetResult:
    """One prompt set's acceptance: per proposer, per k, the mean length and the per-position rates."""

    prompts: int
    mean: dict[str, dict[int, float]]
    positions: dict[str, dict[int, list[float]]]


def acceptance_by_set(target_dir: str, export_dir: str, sets: dict[str, list[list[int]]],
                      groups: dict[str, list[str]], store, run: str,  # noqa: ANN001 - an eagle3q.store.Store
                      ks: Sequence[int] = (1, 3, 5), max_new: int = 64,
                      others: dict[str, str] | None = None) -> dict[str, SetResult]:
    """The trained draft and the run's bigram table on each prompt set, and on each group of sets (e.g. every
    out-of-domain category together), from one pass over every prompt per proposer and k. `others` (name ->
    export dir) are more drafts of the same target and aux layers, measured on the same greedy paths (the target's
    paths are computed once: most of the time for a few drafts)."""
    from eagle3q.draft.export import load_exported

    model, tensors = _target(target_dir)
    draft, cfg, d2t, _ = load_exported(Path(export_dir), tensors["embed"])
    aux_ids = cfg["eagle_aux_hidden_state_layer_ids"]
    runner = TargetRunner(model, aux_ids)
    proposers = {"trained": draft_proposer(draft, d2t), "bigram": bigram_for_run(store, run)}
    for name, other_dir in (others or {}).items():
        other, other_cfg, other_d2t, _ = load_exported(Path(other_dir), tensors["embed"])
        if sorted(other_cfg["eagle_aux_hidden_state_layer_ids"]) != sorted(aux_ids):
            raise ValueError(f"draft {name} reads aux layers {other_cfg['eagle_aux_hidden_state_layer_ids']}, "
                             f"the first {aux_ids}: they cannot share the target's paths")
        proposers[name] = draft_proposer(other, other_d2t)
    paths = {s: [runner.greedy_path(p, max_new + max(ks)) for p in prompts] for s, prompts in sets.items()}
    rounds = {(name, k, s): acceptance_rounds(runner, prop, prompts, k, max_new, paths[s])
              for name, prop in proposers.items() for k in ks for s, prompts in sets.items()}
    out: dict[str, SetResult] = {}
    for name, members in {**{s: [s] for s in sets}, **groups}.items():
        res = SetResult(sum(len(sets[m]) for m in members), {}, {})
        for prop in proposers:
            per_k = {k: [r for m in members for r in rounds[(prop, k, m)]] for k in ks}
            res.mean[prop] = {k: round(mean_length(v), 3) for k, v in per_k.items()}
            res.positions[prop] = {k: [round(x, 4) for x in per_position(v, k)] for k, v in per_k.items()}
        out[name] = res
    return out


def format_sets(results: dict[str, SetResult], order: Sequence[str], served: dict[str, float] | None = None,
                served_k: int | None = None) -> str:
    """A row per prompt set: the trained draft's and the bigram table's mean acceptance length at each k, the margin
    at the largest k, and (served) vLLM's own figure at its k."""
    ks = list(next(iter(results.values())).mean["trained"])
    label = "trained, k = " + " / ".join(map(str, ks))
    w = max(6 * len(ks) + 3 * (len(ks) - 1), len(label))  # "1.234 / 1.234 / ..."
    head = (f"{'prompt set':<14} {'n':>3}  {label:<{w}}  {'bigram':<{w}}  "
            f"{'margin k=' + str(ks[-1]):>11}")
    if served:
        head += f"  vLLM k={served_k}"
    lines = [head]
    for name in order:
        r = results[name]
        tr, bg = r.mean["trained"], r.mean["bigram"]
        line = (f"{name:<14} {r.prompts:>3}  {' / '.join(f'{tr[k]:.3f}' for k in ks):<{w}}  "
                f"{' / '.join(f'{bg[k]:.3f}' for k in ks):<{w}}  {tr[ks[-1]] - bg[ks[-1]]:>+11.3f}")
        if served and name in served:
            line += f"  {served[name]:>9.3f}"
        lines.append(line)
    return "\n".join(lines)


def format_table(table: dict[str, dict[int, float]]) -> str:
    cols = list(table)
    lines = ["k  " + "  ".join(f"{c:>9}" for c in cols)]
    for k in table[cols[0]]:
        lines.append(f"{k}  " + "  ".join(f"{table[c][k]:9.3f}" for c in cols))
    return "\n".join(lines)
