"""Quality, measured: greedy speculative decoding of the draft against its target, and the mean acceptance length.

Each round the draft proposes k tokens after the last verified one; the target checks them in one forward pass and
keeps the longest matching prefix plus its own next token. Acceptance length = accepted drafts + 1 (the bonus token),
so 1.0 means the draft never helps and k+1 is perfect (the ceiling: the target as its own draft).

Baselines in the same loop: a bigram table (no network: each token -> the token that follows it most often in the
run's training samples), which any draft that uses the target's hidden states must beat, and an untrained draft.
Prompts are held out: the prompt part of the run's validation samples (`eagle3q.eagle3.manifest`), never trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from eagle3q.eagle3.model import Eagle3Draft


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
def propose(draft: Eagle3Draft, d2t_full: torch.Tensor, seq: list[int], aux: torch.Tensor, k: int) -> list[int]:
    """k draft tokens after `seq`, given the target's aux states for seq[:-1] (the last token is not verified by a
    forward yet: it is the target's own prediction)."""
    n = len(seq) - 1  # rows 0..n-1: row t pairs the state at t with token seq[t+1]
    pos = torch.arange(n)
    h = draft.fc(aux[:n]).unsqueeze(0)
    tokens = torch.tensor([seq[1 : n + 1]])
    cache: list = []
    out: list[int] = []
    for step in range(k):
        logits, h = draft.step(tokens, h, pos + step, cache)
        nxt = int(d2t_full[int(logits[0, -1].argmax())])
        out.append(nxt)
        tokens = tokens.clone()
        tokens[0, -1] = nxt  # only the last row's chain matters: it is the one speculating past the sequence
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
    def from_files(cls, paths: Sequence[Path]) -> Bigram:
        from collections import Counter

        from safetensors import safe_open

        pairs: Counter[tuple[int, int]] = Counter()
        unigrams: Counter[int] = Counter()
        for p in paths:
            with safe_open(str(p), framework="pt") as f:
                ids, mask = f.get_tensor("input_ids").tolist(), f.get_tensor("loss_mask").tolist()
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
def acceptance_length(target: TargetRunner, proposer: Proposer, prompts: list[list[int]], k: int,
                      max_new: int = 48) -> float:
    lengths: list[int] = []
    for prompt in prompts:
        seq = list(prompt)
        logits, aux = target(seq)
        seq.append(int(logits[-1].argmax()))
        produced = 1
        while produced < max_new:
            drafts = proposer(seq, aux, k)
            logits, aux_all = target(seq + drafts)
            base = len(seq) - 1  # logits at `base` predict the token after seq
            accepted = 0
            for j, d in enumerate(drafts):
                if int(logits[base + j].argmax()) == d:
                    accepted += 1
                else:
                    break
            bonus = int(logits[base + accepted].argmax())
            seq += drafts[:accepted] + [bonus]
            produced += accepted + 1
            lengths.append(accepted + 1)
            aux = aux_all[: len(seq) - 1]
    return sum(lengths) / len(lengths) if lengths else 0.0


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

    from eagle3q.eagle3.target import load_target_tensors

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return model, load_target_tensors(target_dir)


def heldout_prompts(store, run: str, n: int) -> list[list[int]]:  # noqa: ANN001 - an eagle3q.store.Store
    """The prompt tokens of up to n of the run's validation samples (one a prompt; prompts never trained on), as
    the server tokenized them."""
    import json

    from eagle3q.eagle3.manifest import load

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
    from eagle3q.eagle3.manifest import load

    m = load(store, run)
    return Bigram.from_files([store.hidden_path(run, e.sample_id) for e in m.train])


def evaluate_proposer(target_dir: str, proposer: Proposer, aux_ids: list[int], prompts: list[list[int]],
                      ks: Sequence[int] = (1, 2, 3, 4, 5), max_new: int = 64) -> dict[int, float]:
    runner = TargetRunner(_target(target_dir)[0], aux_ids)
    return {k: round(acceptance_length(runner, proposer, prompts, k, max_new), 3) for k in ks}


def evaluate(target_dir: str, export_dir: str | None, prompts: list[list[int]], ks: Sequence[int] = (1, 2, 3, 4, 5),
             max_new: int = 48, untrained_seed: int | None = None, draft_vocab_size: int = 32000) -> dict[int, float]:
    """Mean acceptance length per k for an exported draft, or (export_dir None) an untrained one as the baseline."""
    from eagle3q.eagle3.export import load_exported
    from eagle3q.eagle3.extract import default_aux_ids
    from eagle3q.eagle3.target import target_config

    model, tensors = _target(target_dir)
    if export_dir is not None:
        draft, cfg, d2t, _ = load_exported(Path(export_dir), tensors["embed"])
        aux_ids = cfg["eagle_aux_hidden_state_layer_ids"]  # what vLLM reads
    else:
        from eagle3q.eagle3.model import DraftConfig

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
    from eagle3q.eagle3.export import load_exported

    tensors = _target(target_dir)[1]
    draft, cfg, d2t, _ = load_exported(Path(export_dir), tensors["embed"])
    aux_ids = cfg["eagle_aux_hidden_state_layer_ids"]
    table = {
        "trained": evaluate_proposer(target_dir, draft_proposer(draft, d2t), aux_ids, prompts, ks, max_new),
        "bigram": evaluate_proposer(target_dir, bigram_for_run(store, run), aux_ids, prompts, ks, max_new),
    }
    if untrained:
        table["untrained"] = evaluate(target_dir, None, prompts, ks, max_new, draft_vocab_size=draft_vocab_size)
    table["ceiling"] = {k: float(k + 1) for k in ks}
    return table


def format_table(table: dict[str, dict[int, float]]) -> str:
    cols = list(table)
    lines = ["k  " + "  ".join(f"{c:>9}" for c in cols)]
    for k in table[cols[0]]:
        lines.append(f"{k}  " + "  ".join(f"{table[c][k]:9.3f}" for c in cols))
    return "\n".join(lines)
