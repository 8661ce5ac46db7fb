"""FP8 hidden-state storage (`EAGLE3Q_HS_DTYPE=fp8`): float8_e4m3fn with a float32 scale per token and layer.

The convention is the one of `hs_connectors` (speculators' FP8 connector and reader, 0.9): scale = amax / 448,
stored = (x / scale) as e4m3, restored = stored * scale. Its reader (`FP8Transfer`) multiplies by the scale with
broadcasting, so a scale per token *and layer* ([T, layers, 1]) reads as well as its own per-token one ([T, 1, 1]);
we keep one per layer because the layers' magnitudes differ (the final pre-norm state is the largest), and a shared
scale would spend the small layers' few mantissa bits on the big one's range. 16 bytes a token for 4 layers,
against 4 x H saved (Kimi-K2.5: 28,688 B a token against 57,353 in bf16).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
SCALES_SUFFIX = "_scales"  # aux_hidden_states_scales, hidden_state_scales; the peer writes hidden_states_scales


def quantize(x: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, layers * H] (any float dtype) -> (e4m3 [T, layers * H], float32 scales [T, layers, 1])."""
    t = x.shape[0]
    v = x.float().reshape(t, layers, -1)
    scale = (v.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (v / scale).to(E4M3).reshape(x.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t, layers = scale.shape[0], scale.shape[1]
    return (q.to(torch.float32).reshape(t, layers, -1) * scale.float()).reshape(q.shape).to(dtype)


def as_stored(x: torch.Tensor, hs_dtype: str, layers: int = 1) -> torch.Tensor:
    """What a reader gets back for x once stored in hs_dtype (the consistency check judges that, not the input)."""
    if hs_dtype == "fp8":
        return dequantize(*quantize(x, layers))
    return x.to(torch.bfloat16)
