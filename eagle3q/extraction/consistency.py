"""Do a sample's stored states belong to its tokens? The final state through the target's final norm and LM head must
predict the sample's next tokens. A state from the wrong layer, or shifted by a token, passes every shape check (and
no peer checks more than shapes); it fails this one.

Per sample, up to `positions` generated positions are drawn (seeded by the sample id, so a rerun draws the same): at
position t the final state predicts token t+1, and the top-1 agreement is the fraction where the head's argmax is
the token the model produced. Structural tokens (the tokenizer's special tokens: think markers, end of turn) are
left out on both sides: rules force or forbid them (a logits processor, min_tokens), the model does not choose them.
The same is measured with the states one token either side: states shifted against their tokens agree best at that
offset, even in text that repeats itself. A sample is rejected when its agreement is below the threshold
(EAGLE3Q_HS_CHECK_MIN_GREEDY for a sample generated at temperature 0, EAGLE3Q_HS_CHECK_MIN for a sampled one) or an
offset other than 0 agrees better.

What to expect: a greedy sample of the right states agrees ~1.0 (bf16 rounding flips near-ties; tokens a logits
processor forced among ordinary tokens do not agree); a sampled one agrees as often as the sampled token is the
model's top one (reasoning models at temperature 0.6-1: ~0.6-0.9, lower in high-entropy writing: lower
EAGLE3Q_HS_CHECK_MIN for those runs). Shifted states agree best at their offset (in a sample that only repeats one
token, every offset agrees alike and the shift cannot be seen). A wrong layer on the random tiny target agrees
0.0-0.72 on greedy text, the right one 0.92-1.0 (measured on 12 demo-like samples); on a trained model a layer next
to the last still predicts the next token often (the "logit lens"), so the check catches wrong layers far from the
end, and `status` shows the run's mean agreement to compare across runs.

Only the final norm and the LM head are loaded (from the target's safetensors index, not the model). Cost for
Kimi-K2.5 (head 163,840 x 7,168, bf16 2.3 GB): up to 96 rows (32 positions, 3 offsets) x 7,168 x 163,840 x 2 = 225
GFLOP a sample; bench/bench_consistency.py measured 280 ms a 3,000-token sample on 2 CPU cores, against 575 ms for
writing its 172 MB file (ratio 0.49).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3q.target import final_norm, load_target_tensors, target_config

log = logging.getLogger(__name__)

OFFSETS = (-1, 0, 1)  # the stored alignment and one token either way


@dataclass(frozen=True)
class Agreement:
    top1: float  # fraction of the checked positions where the head's argmax is the sample's next token
    positions: int  # how many were checked (0: the sample has no generated position to check)
    offset: int = 0  # the shift (in tokens) at which the states agree best with the tokens: 0 when aligned
    by_offset: tuple[float, ...] = ()  # the agreement at each of OFFSETS

    def as_meta(self) -> dict:
        return {"top1": round(self.top1, 4), "positions": self.positions, "offset": self.offset}


def check_positions(sample_id: str, input_ids: Sequence[int], loss_mask: Sequence[int], n: int,
                    skip: Collection[int] = ()) -> list[int]:
    """Up to n positions t whose next token t+1 was generated (loss_mask[t+1] = 1) and is not in `skip` (the
    structural tokens), drawn by the sample id."""
    candidates = [t for t in range(len(loss_mask) - 1) if loss_mask[t + 1] and input_ids[t + 1] not in skip]
    if len(candidates) <= n:
        return candidates
    seed = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big")
    return sorted(random.Random(seed).sample(candidates, n))


def structural_ids(tokenizer: str) -> frozenset[int]:
    """The tokenizer's special tokens (think markers, end of turn, template markers); empty, with a warning, when
    the tokenizer cannot be read: the check then compares every generated token."""
    from eagle3q.generate.tokenizer import load_tokenizer

    try:
        return frozenset(load_tokenizer(tokenizer).special_ids())
    except Exception as e:  # noqa: BLE001 - a check that is stricter beats a worker that will not start
        log.warning("consistency check: no special tokens from %s (%s); every generated token is compared",
                    tokenizer, e)
        return frozenset()


class ConsistencyCheck:
    """The target's final norm and LM head, loaded alone, and the threshold a sample must reach."""

    def __init__(self, target_dir: str | Path, positions: int = 32, min_agreement: float = 0.4,
                 min_greedy: float = 0.8, device: str = "cpu", tokenizer: str | None = None):
        tensors = load_target_tensors(target_dir, names=("lm_head", "norm"), as_float32=False)
        head = tensors["lm_head"]
        if not head.is_floating_point():
            raise ValueError(f"the target's LM head in {target_dir} is stored as {head.dtype} (quantized): the "
                             "consistency check needs a float head; set EAGLE3Q_HS_CHECK_POSITIONS=0 to turn it off")
        # The head stays in its stored dtype (Kimi's: bf16, 2.3 GB; fp32 would double it in every worker).
        self.head = head.to(device=device)
        norm = tensors.get("norm")
        self.norm = None if norm is None else norm.to(device=device, dtype=torch.float32)
        self.eps = float(target_config(target_dir).get("rms_norm_eps", 1e-6))
        self.positions, self.device = positions, device
        self.min_agreement, self.min_greedy = min_agreement, min_greedy
        # Structural tokens are forced or forbidden by rules, not chosen by the model (a logits processor's </think>,
        # min_tokens holding back the end of turn, a simulator that never emits a marker mid-text): positions
        # whose next token is one are not checked, and none is a prediction the head can make.
        self.skip = structural_ids(str(tokenizer or target_dir))
        self._skip_cols = torch.tensor(sorted(i for i in self.skip if i < head.shape[0]), dtype=torch.long)

    def agreement(self, sample_id: str, input_ids: Sequence[int], loss_mask: Sequence[int], final: torch.Tensor,
                  final_state: str) -> Agreement:
        """`final`: [T, H], before the final norm ("pre_norm") or after it ("post_norm"). Also reads the states one
        token either side of each position: states shifted against the tokens agree best at that offset."""
        pos = check_positions(sample_id, input_ids, loss_mask, self.positions, self.skip)
        if not pos:
            return Agreement(1.0, 0)
        rows = sorted({t + d for t in pos for d in OFFSETS if 0 <= t + d < len(input_ids)})
        h = final[rows].to(device=self.device, dtype=torch.float32)
        if final_state == "pre_norm" and self.norm is not None:
            h = final_norm(h, self.norm, self.eps)
        with torch.inference_mode():
            logits = h.to(self.head.dtype) @ self.head.T
            logits[:, self._skip_cols] = float("-inf")
            predicted = dict(zip(rows, logits.argmax(-1).tolist(), strict=True))
        by_offset = []
        for d in OFFSETS:
            hits = [predicted[t + d] == input_ids[t + 1] for t in pos if t + d in predicted]
            by_offset.append(sum(hits) / len(hits) if hits else 0.0)
        aligned = by_offset[OFFSETS.index(0)]
        # Ties go to the stored alignment (a sample that repeats itself agrees at every offset).
        best = max(OFFSETS, key=lambda d: (by_offset[OFFSETS.index(d)], d == 0))
        return Agreement(aligned, len(pos), best, tuple(round(a, 4) for a in by_offset))

    def threshold(self, greedy: bool) -> float:
        return self.min_greedy if greedy else self.min_agreement

    def passes(self, a: Agreement, greedy: bool) -> bool:
        """`greedy`: the sample was generated at temperature 0, so the right states' argmax is its token."""
        return a.positions == 0 or (a.top1 >= self.threshold(greedy) and a.offset == 0)
