"""The hidden-state object of one sample: a safetensors file.

Tensors: input_ids [T] (int64), loss_mask [T] (uint8), aux_hidden_states [T, 3H] and hidden_state [T, H] (bf16; or
with EAGLE3Q_HS_DTYPE=fp8, e4m3 with float32 `*_scales` [T, 3, 1] and [T, 1, 1], see eagle3q.store.fp8; metadata
`hs_dtype`; `decode` restores them to float32). The final state is the last decoder layer's output before the
target's final norm, what vLLM's extraction returns: the post-norm state follows from it with the norm's weight
(training and the SpecForge export apply it), the pre-norm one cannot be recovered from the post-norm. The metadata
`final_state` says which one a file holds ("pre_norm", or "post_norm" for a target without a final norm module, and
older files). Every metadata value is JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from eagle3q.store.safetensors_format import Header, NotSafetensors, array, parse_header

HIDDEN_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_state")
STATE_KEYS = ("aux_hidden_states", "hidden_state")
TOKEN_KEYS = ("input_ids", "loss_mask")


def encode(input_ids: Sequence[int], loss_mask: Sequence[int], aux, final, meta: dict,  # noqa: ANN001 - tensors
           hs_dtype: str = "bf16") -> bytes:
    """aux [T, 3H] and final [T, H] (any float dtype) as the object's bytes. OverflowError("hs_nonfinite") where
    bf16 rounding makes a state infinite (fp8's scales come from what is stored, so it is checked after)."""
    import torch
    from safetensors.torch import save

    from eagle3q.store.fp8 import SCALES_SUFFIX, quantize

    aux, final = aux.to(torch.bfloat16).contiguous(), final.to(torch.bfloat16).contiguous()
    if not torch.isfinite(aux).all() or not torch.isfinite(final).all():
        raise OverflowError("hs_nonfinite")
    tensors = {"input_ids": torch.tensor(list(input_ids), dtype=torch.long),
               "loss_mask": torch.tensor(list(loss_mask), dtype=torch.uint8)}
    if hs_dtype == "fp8":
        hidden = final.shape[-1]
        for key, x in (("aux_hidden_states", aux), ("hidden_state", final)):
            tensors[key], tensors[key + SCALES_SUFFIX] = quantize(x, x.shape[-1] // hidden)
    elif hs_dtype == "bf16":
        tensors |= {"aux_hidden_states": aux, "hidden_state": final}
    else:
        raise ValueError(f"hidden-state dtype must be bf16 or fp8, got {hs_dtype!r}")
    meta = {**meta, "hs_dtype": hs_dtype}
    return save(tensors, metadata={k: json.dumps(v) for k, v in meta.items()})


def decode(data: bytes, restore: bool = True) -> tuple[dict, str]:
    """The four tensors, and which side of the target's final norm the final state is on. An fp8 object's states
    come back restored to float32 (`restore=False`: as stored, with their `*_scales`)."""
    from safetensors.torch import load

    from eagle3q.store.fp8 import SCALES_SUFFIX, dequantize

    header = parse_header(data)
    if len(data) != header.file_size:
        raise NotSafetensors(f"{len(data)} bytes, the header says {header.file_size}")
    loaded = load(bytes(data))
    tensors = {k: loaded[k] for k in HIDDEN_KEYS}
    scales = {k: loaded[k + SCALES_SUFFIX] for k in STATE_KEYS if k + SCALES_SUFFIX in loaded}
    if scales:
        tensors |= {k: dequantize(tensors[k], scales[k]) for k in STATE_KEYS} if restore else \
            {k + SCALES_SUFFIX: v for k, v in scales.items()}
    return tensors, final_state(header)


def final_state(header: Header) -> str:
    return str(header.meta("final_state", "post_norm"))


def stored_dtype(header: Header) -> str:
    """"fp8" or "bf16" (files from before the setting are bf16)."""
    return str(header.meta("hs_dtype", "bf16"))


def token_count(header: Header) -> int:
    return int(header.tensors["input_ids"].shape[0])


def tokens_from_bytes(header: Header, data: bytes):  # noqa: ANN201 - (ids, mask) as numpy arrays
    """The ids and mask of a whole object's bytes, without decoding its states."""
    ids, mask = (header.tensors[k] for k in TOKEN_KEYS)
    return array(ids, data[ids.start:ids.end]), array(mask, data[mask.start:mask.end])


def loss_positions(data: bytes, max_len: int) -> int:
    """Positions of a sample that count at the first TTT step (generated input tokens, after the first), from its
    bytes without decoding its states."""
    header = parse_header(data)
    _, mask = tokens_from_bytes(header, data)
    return int(mask[1:max_len].sum())
