"""The target model as the draft needs it: its language-model config, and single tensors (embeddings, final norm,
LM head) read from its safetensors files without loading the model (for a 1T-parameter target only these three are
needed by the draft's training). Importable without torch (the storage estimate uses the config part)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_PATTERNS = {
    "embed": re.compile(r"(^|\.)embed_tokens\.weight$"),
    "lm_head": re.compile(r"(^|\.)lm_head\.weight$"),
    "norm": re.compile(r"(^|\.)model\.norm\.weight$|^norm\.weight$"),
}


def _index(model_dir: Path) -> dict[str, str]:
    idx = model_dir / "model.safetensors.index.json"
    if idx.is_file():
        return json.loads(idx.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {model_dir}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def load_target_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """{"embed", "lm_head", "norm"} as float32 (lm_head falls back to the embeddings when they are tied)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    weight_map = _index(model_dir)
    out: dict[str, torch.Tensor] = {}
    for name, pat in _PATTERNS.items():
        keys = [k for k in weight_map if pat.search(k) and "layers." not in k]
        if not keys:
            continue
        key = sorted(keys, key=len)[0]
        with safe_open(str(model_dir / weight_map[key]), framework="pt") as f:
            out[name] = f.get_tensor(key).float()
    if "embed" not in out:
        raise KeyError(f"no embed_tokens weight in {model_dir}")
    out.setdefault("lm_head", out["embed"])
    return out


def final_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm (Llama, DeepSeek-V3 / Kimi): pre-norm final states -> what its LM head reads."""
    return weight * (h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt())


def text_config(cfg: Any) -> Any:
    """The language model's part of a config (a dict or a transformers config): multimodal wrappers (Kimi-K2.5)
    nest it under `text_config`."""
    if isinstance(cfg, dict):
        return cfg.get("text_config", cfg)
    return getattr(cfg, "text_config", None) or cfg


def target_config(model_dir: str | Path) -> dict:
    """The target's config.json, unwrapped to its language model."""
    return text_config(json.loads((Path(model_dir) / "config.json").read_text()))
