"""Reads an eagle3q draft export with vLLM's own code (run with the conformance venv's python):
`read_export.py TARGET_DIR EXPORT_DIR` prints one JSON line.

- vLLM's engine configuration with `--speculative-config {"method": "eagle3", "model": EXPORT}`: the draft's
  architecture, vocabularies, hidden sizes, and the aux layer ids as vLLM's worker reads them
  (`get_eagle3_aux_layers_from_config`);
- vLLM's Eagle-3 Llama model class built on the CPU and its own `load_weights` over the export's file: for every
  parameter vLLM has, whether it holds the export's tensor (q/k/v and gate/up fused as vLLM fuses them, `d2t` as
  `draft_id_to_target_id`), and which of the file's tensors it left unused.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config  # noqa: E402


def expected(file: dict[str, torch.Tensor], vllm_name: str) -> torch.Tensor | None:
    """What a vLLM parameter must hold, from the export's tensors."""
    name = vllm_name.removeprefix("model.").replace("layers.0.", "midlayer.")
    if name == "draft_id_to_target_id":
        return file["d2t"]
    if name.endswith("qkv_proj.weight"):
        base = name.removesuffix("qkv_proj.weight")
        return torch.cat([file[base + p + "_proj.weight"] for p in "qkv"])
    if name.endswith("gate_up_proj.weight"):
        base = name.removesuffix("gate_up_proj.weight")
        return torch.cat([file[base + "gate_proj.weight"], file[base + "up_proj.weight"]])
    return file.get(name)


def main() -> None:
    target, export, port = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = EngineArgs(model=target, max_model_len=512, dtype="float32", speculative_config={
        "method": "eagle3", "model": export, "num_speculative_tokens": 3}).create_engine_config()
    spec = cfg.speculative_config
    hf = spec.draft_model_config.hf_config
    report = {
        "method": spec.method,
        "architectures": list(hf.architectures or []),
        "draft_vocab_size": getattr(hf, "draft_vocab_size", None),
        "target_hidden_size": getattr(hf, "target_hidden_size", None),
        "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec) or []),
    }
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    file = load_file(os.path.join(export, "model.safetensors"))
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        model = Eagle3LlamaForCausalLM(vllm_config=cfg, prefix="")
        model.load_weights(file.items())
    params = {}
    for name, p in model.named_parameters():
        want = expected(file, name)
        params[name] = None if want is None else bool(torch.equal(p.detach().to(want.dtype), want))
    report["params"] = params
    # the three norm switches as vLLM's model runs them (each one changes the forward, two without a weight)
    report["norms"] = {
        "norm_before_residual": model.model.layers[0]._residual_norm.__name__ == "_norm_before_residual",
        "norm_before_fc": bool(model.model.norm_before_fc),
        "norm_output": bool(model.model.norm_output),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
