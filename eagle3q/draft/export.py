"""Export the draft in the layout vLLM loads with `--speculative-config '{"method": "eagle3", "model": DIR, ...}'`:
`config.json` (LlamaForCausalLMEagle3) and `model.safetensors` with midlayer.*, fc, norm, lm_head, d2t and t2d.
Written to the store (the run's train/export/); `eagle3q fetch-export` copies it to the directory vLLM reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3q.draft.model import NORM_FLAGS, DraftConfig, Eagle3Draft, rope_scaling_of, rope_theta_of
from eagle3q.store import Store
from eagle3q.store.run_store import EXPORT

REQUIRED_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
MIDLAYER_KEYS = (
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)


def vllm_config(c: DraftConfig, aux_ids: list[int]) -> dict:
    aux_ids = sorted(aux_ids)  # vLLM captures in layer order
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # The three norm switches, each set explicitly: vLLM's defaults differ between versions, and without
        # `norm_before_fc` its loader silently drops the `input_norm` weight.
        **c.norms(),
        # Top level: vLLM (`get_eagle3_aux_layers_from_config`) and the speculators converter read only this key;
        # without it vLLM silently uses the target's default ids. The nested copy is for readers of eagle_config.
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_ids),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
        },
    }
    return cfg


def aux_ids_as_vllm_reads(cfg: dict) -> list[int] | None:
    """The aux layer ids vLLM will use from an exported config: the top-level key only."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def export_draft(store: Store, run: str, model: Eagle3Draft, c: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor,
                 aux_ids: list[int]) -> str:
    """The export's two objects in the store, the weights first (a reader that finds config.json finds the whole
    export); where it is."""
    for name, data in draft_files(model, c, d2t, t2d, aux_ids).items():
        store.put_artifact(run, f"{EXPORT}/{name}", data)
    return store.artifact_url(run, EXPORT)


def draft_files(model: Eagle3Draft, c: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor,
                aux_ids: list[int]) -> dict[str, bytes]:
    """The export's files by name, weights first: model.safetensors and config.json."""
    from safetensors.torch import save

    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.exported_state().items()}
    # A draft vocabulary as large as the target's is the identity: vLLM's Eagle3 model then has no
    # draft_id_to_target_id parameter, and a d2t in the file makes its weight loader fail ("no module or parameter
    # named 'draft_id_to_target_id'", vLLM 0.32), so the file carries the mapping only where there is one.
    if c.draft_vocab_size != c.vocab_size:
        tensors["d2t"] = d2t.to(torch.long).contiguous()
        tensors["t2d"] = t2d.to(torch.bool).contiguous()
    cfg = json.dumps(vllm_config(c, aux_ids), indent=2).encode()
    read_back = aux_ids_as_vllm_reads(json.loads(cfg))
    if read_back != sorted(aux_ids):
        raise RuntimeError(f"exported config gives vLLM aux ids {read_back}, trained with {sorted(aux_ids)}")
    return {"model.safetensors": save(tensors, metadata={"format": "pt"}), "config.json": cfg}


def load_exported(out: Path, embed_weight: torch.Tensor) -> tuple[Eagle3Draft, dict, torch.Tensor, torch.Tensor]:
    """Load an exported draft back (the evaluation and the tests use exactly what vLLM would read). A checkpoint of
    speculators' trainer (its `Eagle3DraftModel` layout, which vLLM loads too) is read as well, so `eval-draft`
    compares drafts from either trainer on the same prompts."""
    from safetensors.torch import load_file

    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    if "speculators_config" in cfg:
        cfg, tensors = _from_speculators(cfg, tensors)
    dc = DraftConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], vocab_size=cfg["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"],
        rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
        max_position_embeddings=cfg["max_position_embeddings"], norm_before_residual=cfg["norm_before_residual"],
        rope_scaling=cfg.get("rope_scaling"), norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        norm_output=bool(cfg.get("norm_output", False)),
    )
    model = Eagle3Draft(dc, embed_weight)
    weights = {k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if not m.startswith("embed_tokens")]:
        raise ValueError(f"exported draft does not match: missing {missing}, unexpected {unexpected}")
    if "d2t" not in tensors:  # the full target vocabulary (see export_draft): the identity mapping
        identity = torch.zeros(dc.vocab_size, dtype=torch.long), torch.ones(dc.vocab_size, dtype=torch.bool)
        return model.eval(), cfg, *identity
    return model.eval(), cfg, tensors["d2t"], tensors["t2d"]


def _from_speculators(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """speculators 0.9's Eagle3 checkpoint as our config and weight names: its decoder is `layers.0.*` (ours
    `midlayer.*`), its layer settings are nested in `transformer_layer_config`, and it carries its own copy of the
    target's embeddings (dropped: the target's are used, as vLLM does). Its layer's sliding window (2,048 tokens by
    default) is not applied: the figures are exact for sequences shorter than it, as `eval-draft`'s are."""
    layer = cfg["transformer_layer_config"]
    if int(layer.get("num_hidden_layers", 1)) != 1 or cfg.get("fc_norm"):
        raise ValueError("only one-layer speculators drafts without fc_norm are read (vLLM's Eagle3 Llama layout)")
    if len(cfg["eagle_aux_hidden_state_layer_ids"]) != 3:
        raise ValueError("the draft folds 3 aux states: speculators drafts with other counts are not read")
    ours = {
        "hidden_size": layer["hidden_size"], "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"], "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        "vocab_size": layer["vocab_size"], "draft_vocab_size": cfg["draft_vocab_size"],
        "rms_norm_eps": layer["rms_norm_eps"], "rope_theta": rope_theta_of(layer),
        "rope_scaling": rope_scaling_of(layer), "max_position_embeddings": layer["max_position_embeddings"],
        **{flag: bool(cfg.get(flag, False)) for flag in NORM_FLAGS},
        "eagle_aux_hidden_state_layer_ids": sorted(cfg["eagle_aux_hidden_state_layer_ids"]),
    }
    renamed = {k.replace("layers.0.", "midlayer.", 1): v for k, v in tensors.items() if k != "embed_tokens.weight"}
    return ours, renamed
