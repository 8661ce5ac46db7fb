"""The draft checkpoint eagle3q exports, read by vLLM 0.33's own code: its engine configuration with
`--speculative-config {"method": "eagle3", "model": EXPORT}`, the aux layer ids as its worker reads them, and its
Eagle-3 Llama model class loading the weights (issue 12, item 5)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from eagle3q.dev.local import free_port
from eagle3q.dev.tiny import build_served_model
from eagle3q.draft.model import NORM_LAYOUTS
from tests.conformance.vllm_server import VLLM_PYTHON
from tests.drafts import random_export

READER = Path(__file__).with_name("read_export.py")


@pytest.mark.parametrize(("draft_vocab", "norms"), [(256, "speculators"), (1024, "speculators"), (256, "eagle3")])
def test_vllm_loads_our_draft_export(tiny: Path, tmp_path: Path, draft_vocab: int, norms: str) -> None:
    """1024: the whole target vocabulary, where vLLM's model has no draft_id_to_target_id and a d2t in the file
    fails its loader. Both draft layouts (EAGLE3Q_DRAFT_NORMS): vLLM's model runs the norms the draft has."""
    aux = [2, 4, 5]  # vLLM's convention, for the 8-layer tiny target
    tc, _, c, *_ = random_export(tiny, tmp_path / "export", aux, draft_vocab, norms)
    assert tc["vocab_size"] == 1024
    target = build_served_model(tiny, tmp_path / "target", "kimi_k2")

    r = subprocess.run([str(VLLM_PYTHON), str(READER), str(target), str(tmp_path / "export"), str(free_port())],
                       capture_output=True, text=True, timeout=300, env={"VLLM_TARGET_DEVICE": "cpu",
                                                                         "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["method"] == "eagle3"
    assert report["architectures"] == ["LlamaForCausalLMEagle3"]
    assert report["draft_vocab_size"] == draft_vocab and report["target_hidden_size"] == tc["hidden_size"]
    # The ids vLLM's worker captures: our top-level key, in layer order (not the target's default ids).
    assert report["aux_layer_ids"] == aux
    params = report["params"]
    # Every parameter vLLM has holds our tensor, fused as vLLM fuses them; the embeddings come from the target.
    assert params.pop("model.embed_tokens.weight") is None
    assert params and all(params.values()), params
    assert {"model.fc.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.hidden_norm.weight"} <= set(params)
    assert ("draft_id_to_target_id" in params) == (draft_vocab < tc["vocab_size"])
    assert report["norms"] == c.norms() == NORM_LAYOUTS[norms]
    assert ("model.input_norm.weight" in params) == c.norm_before_fc  # and it holds our tensor (above)
