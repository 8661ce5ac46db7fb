"""Hidden-state extraction: the target's auxiliary and final hidden states for every accepted sample.

Layer ids follow vLLM's convention: id 0 = embedding output, id k = output of decoder layer k-1. The EAGLE-3 default
is [2, L//2, L-3]; SpecForge / Model-Optimizer write [1, L//2-1, L-4] for the same layers ("output of layer i"): use
`from_layer_indices` to convert, never copy ids across conventions.

One safetensors file per sample: input_ids [T] (int64), loss_mask [T] (uint8), aux_hidden_states [T, 3H] and
hidden_state [T, H] (bf16; or with EAGLE3Q_HS_DTYPE=fp8, e4m3 with float32 `*_scales` [T, 3, 1] and [T, 1, 1], see
eagle3q.eagle3.fp8; metadata `hs_dtype`; `read_hidden` restores them to float32). The final state is the last
decoder layer's output before the target's final norm, what vLLM's extraction returns: the post-norm state follows
from it with the norm's weight (training and the SpecForge export apply it), the pre-norm one cannot be recovered
from the post-norm. The file's metadata `final_state` says
which one a file holds ("pre_norm", or "post_norm" for a target without a final norm module, and older files).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from eagle3q.eagle3.target import text_config
from eagle3q.store import write_atomic

log = logging.getLogger("eagle3q.hidden_states")


def default_aux_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def from_layer_indices(indices: Sequence[int]) -> list[int]:
    """SpecForge/Model-Optimizer "output of layer i" -> vLLM id i + 1."""
    return [i + 1 for i in indices]


def check_aux_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """The aux ids sorted ascending: vLLM captures the aux states in layer order, so the columns of fc's input
    follow the sorted ids whatever order they were given in."""
    ids = list(ids)
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 uses 3 auxiliary layers, got {ids}")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} outside 0..{num_layers} (vLLM convention, L={num_layers})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux layer ids {ids} repeat a layer")
    return sorted(ids)


def plan_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group indices so that (rows x longest) stays within the token budget; similar lengths together (sorted),
    so padding is small. A sample longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in cur] + [lengths[i]])
        if cur and longest * (len(cur) + 1) > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@dataclass
class Extracted:
    aux: object  # torch.Tensor [T, 3H]
    final: object  # torch.Tensor [T, H]
    reason: str | None = None  # a backend's named rejection of this sample (then no tensors)
    detail: str = ""


class TransformersExtractor:
    """The target through transformers, loaded once per worker process."""

    backend = "transformers"

    def __init__(self, model_path: str, aux_ids: Sequence[int] | None, device: str, dtype: str):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.torch = torch
        cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
        text_cfg = text_config(cfg)
        self.num_layers = int(text_cfg.num_hidden_layers)
        self.hidden_size = int(text_cfg.hidden_size)
        self.max_positions = int(getattr(text_cfg, "max_position_embeddings", 1 << 30))
        self.aux_ids = check_aux_ids(aux_ids or default_aux_ids(self.num_layers), self.num_layers)
        torch_dtype = getattr(torch, dtype)
        kwargs: dict = {"dtype": torch_dtype, "trust_remote_code": True}
        # Larger than one GPU: let accelerate spread the layers over every visible device.
        if device == "auto":
            kwargs["device_map"] = "auto"
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
        if device != "auto":
            model = model.to(device)
        self.device = next(model.parameters()).device
        self.model = model.eval()
        # The decoder without the LM head: logits over a 160k vocabulary would cost more than the states we keep.
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        # The final norm's input is the pre-norm final state (transformers' last hidden state is after the norm).
        self.final_norm = getattr(self.decoder, "norm", None)
        self.final_state = "pre_norm" if isinstance(self.final_norm, torch.nn.Module) else "post_norm"

    def extract(self, batch: Sequence[Sequence[int]]) -> list[Extracted]:
        torch = self.torch
        lengths = [len(x) for x in batch]
        longest = max(lengths)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, x in enumerate(batch):
            # Right padding: with a causal mask, real tokens never attend to the pads after them.
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = 1
        captured: list = []
        hook = None
        if self.final_state == "pre_norm":
            hook = self.final_norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            with torch.inference_mode():
                out = self.decoder(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), output_hidden_states=True,
                    use_cache=False,
                )
        finally:
            if hook is not None:
                hook.remove()
        hs = out.hidden_states
        aux = torch.cat([hs[i].to(self.device) for i in self.aux_ids], dim=-1)
        final = captured[-1] if captured else hs[self.num_layers]
        return [Extracted(aux[i, :n].float().cpu(), final[i, :n].float().cpu()) for i, n in enumerate(lengths)]


def check_tensors(input_ids: Sequence[int], ex: Extracted, hidden_size: int, n_aux: int = 3) -> str | None:
    """A named rejection reason, or None when the states are fit to train on."""
    if ex.reason is not None:
        return ex.reason
    torch_mod = __import__("torch")
    t = len(input_ids)
    if tuple(ex.aux.shape) != (t, n_aux * hidden_size) or tuple(ex.final.shape) != (t, hidden_size):
        return "hs_length_mismatch"
    if not bool(torch_mod.isfinite(ex.aux).all()) or not bool(torch_mod.isfinite(ex.final).all()):
        return "hs_nonfinite"
    return None


def to_safetensors(input_ids: Sequence[int], loss_mask: Sequence[int], ex: Extracted, meta: dict,
                   hs_dtype: str = "bf16") -> bytes:
    import torch
    from safetensors.torch import save

    from eagle3q.eagle3.fp8 import SCALES_SUFFIX, quantize

    aux, final = ex.aux.to(torch.bfloat16).contiguous(), ex.final.to(torch.bfloat16).contiguous()
    # bf16 can overflow to inf where float32 did not: check what is actually written (fp8's scales come from it).
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


def write_hidden(path, input_ids, loss_mask, ex: Extracted, meta: dict, hs_dtype: str = "bf16") -> int:  # noqa: ANN001
    data = to_safetensors(input_ids, loss_mask, ex, meta, hs_dtype)
    write_atomic(path, data)
    return len(data)


def load_hidden(path) -> dict:  # noqa: ANN001
    """A file's four tensors, fp8 ones restored (bf16 files: as stored)."""
    return read_hidden(path)[0]


HIDDEN_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_state")
STATE_KEYS = ("aux_hidden_states", "hidden_state")


def read_hidden(path, restore: bool = True) -> tuple[dict, str]:  # noqa: ANN001
    """A sample's four tensors, and which side of the target's final norm its final state is on ("pre_norm", or
    "post_norm" for files that do not say: the older ones). An fp8 file's states come back restored to float32
    (`restore=False`: as stored, with their `*_scales`)."""
    from safetensors import safe_open

    from eagle3q.eagle3.fp8 import SCALES_SUFFIX, dequantize

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in HIDDEN_KEYS}
        scales = {k: f.get_tensor(k + SCALES_SUFFIX) for k in STATE_KEYS if k + SCALES_SUFFIX in keys}
    if scales:
        tensors |= {k: dequantize(tensors[k], scales[k]) for k in STATE_KEYS} if restore else \
            {k + SCALES_SUFFIX: v for k, v in scales.items()}
    return tensors, json.loads(meta.get("final_state", '"post_norm"'))


def stored_dtype(path) -> str:  # noqa: ANN001
    """"fp8" or "bf16" (files from before the setting are bf16)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("hs_dtype", '"bf16"'))


def file_is_valid(path, expected_len: int) -> bool:  # noqa: ANN001
    """A complete file of the right length (a redelivered task trusts it only then)."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_slice("input_ids").get_shape() == [expected_len]
    except Exception:  # noqa: BLE001 - missing or corrupt: extract again
        return False
