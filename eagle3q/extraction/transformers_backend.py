"""Hidden-state extraction: the target's auxiliary and final hidden states for every accepted sample.

Layer ids follow vLLM's convention: id 0 = embedding output, id k = output of decoder layer k-1. The EAGLE-3 default
is [2, L//2, L-3]; SpecForge / Model-Optimizer write [1, L//2-1, L-4] for the same layers ("output of layer i"): use
`from_layer_indices` to convert, never copy ids across conventions.

One object per sample in the store; its format (the four tensors, fp8, the metadata) is eagle3q.store.hidden_format.
The final state is the last decoder layer's output before the target's final norm, what vLLM's extraction returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from eagle3q.target import text_config

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
    """The sample's hidden-state object (eagle3q.store.hidden_format), for `Store.write_hidden`."""
    from eagle3q.store.hidden_format import encode

    return encode(input_ids, loss_mask, ex.aux, ex.final, meta, hs_dtype)
