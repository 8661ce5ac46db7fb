"""The storage estimate of hidden states for a run, from the target's config.json (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3q.config import Settings
from eagle3q.target import text_config

BF16 = 2


def bytes_per_token(hidden_size: int, n_aux: int = 3, hs_dtype: str = "bf16") -> int:
    # aux [3H] + final [H] in bf16 (fp8: 1 byte each and a float32 scale per layer), plus input id (int64) and loss
    # mask (uint8)
    if hs_dtype == "fp8":
        return (hidden_size + 4) * (n_aux + 1) + 8 + 1
    return BF16 * hidden_size * (n_aux + 1) + 8 + 1


def _config_path(target: str) -> Path | None:
    """config.json of a local directory, or of a hub id already in the local Hugging Face cache (no download)."""
    if not target:
        return None
    local = Path(target) / "config.json"
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(target, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id, no hub library: no estimate
        return None
    return Path(cached) if isinstance(cached, str) else None


def target_hidden_size(target: str) -> int | None:
    cfg = _config_path(target)
    if cfg is None:
        return None
    data = json.loads(cfg.read_text())
    data = text_config(data)
    return int(data["hidden_size"]) if "hidden_size" in data else None


def estimate_for_run(s: Settings, prompts: int, tokens_per_sample: int | None = None) -> str | None:
    h = target_hidden_size(s.target_model)
    if h is None or prompts == 0:
        return None
    per_sample = tokens_per_sample or (s.max_tokens // 2 + 512)
    per_token = bytes_per_token(h, hs_dtype=s.hs_dtype)
    total = prompts * per_sample * per_token
    line = (f"hidden-state storage estimate: {prompts} samples x ~{per_sample} tokens x {per_token} B/token "
            f"(H={h}, {s.hs_dtype}) = {total / 1e9:.2f} GB")
    from eagle3q.store import Store

    store = Store.from_settings(s)
    free = store.free_bytes()
    if free is not None:
        line += f"; the store {store.url} has {free / 1e9:.2f} GB free"
        if free < total:
            line += " (WARNING: not enough; `status` projects the size again from the bytes really written)"
    return line

