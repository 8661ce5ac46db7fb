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


def resolve_model_dir(spec: str | Path) -> Path:
    """A local model directory, or a hub id (e.g. moonshotai/Kimi-K2.5) already in the local Hugging Face cache
    (HF_HOME): its snapshot directory. Nothing is downloaded; a hub id not in the cache is a clear error."""
    path = Path(spec)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(spec), local_files_only=True))
    except Exception as e:  # noqa: BLE001 - not a hub id, or not cached: the same message
        raise FileNotFoundError(f"the target {spec!r} is neither a directory nor a model in the local Hugging Face "
                                f"cache (download it first, e.g. `huggingface-cli download {spec}`): {e}") from e


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


def load_target_tensors(model_dir: str | Path, names: tuple[str, ...] = ("embed", "lm_head", "norm"),
                        as_float32: bool = True) -> dict[str, torch.Tensor]:
    """The named tensors of {"embed", "lm_head", "norm"}, as float32 (or as stored); lm_head falls back to the
    embeddings when they are tied. Only the files that hold them are opened, and only these tensors read."""
    from safetensors import safe_open

    model_dir = resolve_model_dir(model_dir)
    weight_map = _index(model_dir)

    def find(name: str) -> str | None:
        keys = [k for k in weight_map if _PATTERNS[name].search(k) and "layers." not in k]
        return sorted(keys, key=len)[0] if keys else None

    keys = {n: find(n) for n in names}
    if "lm_head" in keys and keys["lm_head"] is None:  # tied to the embeddings
        keys["lm_head"] = find("embed")
    read: dict[str, torch.Tensor] = {}  # by key: tied embeddings are read once
    out: dict[str, torch.Tensor] = {}
    for name, key in keys.items():
        if key is None:
            continue
        if key not in read:
            with safe_open(str(model_dir / weight_map[key]), framework="pt") as f:
                t = f.get_tensor(key)
            read[key] = t.float() if as_float32 else t
        out[name] = read[key]
    for need in ("embed", "lm_head"):
        if need in names and need not in out:
            raise KeyError(f"no {need} weight (nor tied embeddings) in {model_dir}")
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
    return text_config(json.loads((resolve_model_dir(model_dir) / "config.json").read_text()))
