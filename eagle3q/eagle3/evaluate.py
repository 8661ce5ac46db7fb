"""Quality, measured: greedy speculative decoding of the draft against its target, and the mean acceptance length.

Each round the draft proposes k tokens after the last verified one; the target checks them in one forward pass and
keeps the longest matching prefix plus its own next token. Acceptance length = accepted drafts + 1 (the bonus token),
so 1.0 means the draft never helps and k+1 is perfect.
"""

from __future__ import annotations

from collections.abc import Sequence
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


@torch.no_grad()
def acceptance_length(target: TargetRunner, draft: Eagle3Draft, d2t: torch.Tensor, prompts: list[list[int]],
                      k: int, max_new: int = 48) -> float:
    d2t_full = d2t + torch.arange(d2t.numel())
    lengths: list[int] = []
    for prompt in prompts:
        seq = list(prompt)
        logits, aux = target(seq)
        seq.append(int(logits[-1].argmax()))
        produced = 1
        while produced < max_new:
            drafts = propose(draft, d2t_full, seq, aux, k)
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
    runner = TargetRunner(model, aux_ids)
    return {k: round(acceptance_length(runner, draft, d2t, prompts, k, max_new), 3) for k in ks}
