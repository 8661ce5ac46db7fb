"""Hidden-state extraction throughput (tokens/s) against a bare forward pass of the same model on the same batches
(goal >= 0.9): what batching, slicing, validation and the bf16 safetensors write cost on top of the model."""

from __future__ import annotations

import random
import time

import torch
from common import report, workdir

from eagle3q.eagle3.extract import TransformersExtractor, check_tensors, plan_batches, to_safetensors


def main() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    base = workdir("extraction")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(base / "target")
    ex = TransformersExtractor(str(base / "target"), None, "cpu", "float32")
    rng = random.Random(0)
    samples = [[rng.randrange(8000) for _ in range(rng.randint(100, 700))] for _ in range(48)]
    batches = [[samples[i] for i in b] for b in plan_batches([len(s) for s in samples], 4096)]
    tokens = sum(len(s) for s in samples)

    def bare() -> float:
        t0 = time.monotonic()
        for b in batches:
            longest = max(len(s) for s in b)
            ids = torch.zeros((len(b), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(b):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            with torch.inference_mode():
                ex.decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        return tokens / (time.monotonic() - t0)

    def ours() -> float:
        t0 = time.monotonic()
        for b in batches:
            for s, e in zip(b, ex.extract(b), strict=True):
                assert check_tensors(s, e, ex.hidden_size) is None
                to_safetensors(s, [1] * len(s), e, {"final_state": "post_norm"})
        return tokens / (time.monotonic() - t0)

    bare()  # warm-up
    b1, o1, b2, o2 = bare(), ours(), bare(), ours()  # interleaved: drift on a shared machine hits both
    b, o = (b1 + b2) / 2, (o1 + o2) / 2
    report("hidden-state extraction: Llama H=512, 8 layers, 48 samples of 100-700 tokens, budget 4096", [
        ("bare forward (same batches)", f"{b:.0f} tokens/s"),
        ("eagle3q extraction + validation + bf16 file bytes", f"{o:.0f} tokens/s"),
        ("ratio", f"{o / b:.3f}  (goal >= 0.9)"),
    ])
    return {"bare": b, "ours": o, "ratio": o / b}


if __name__ == "__main__":
    main()
