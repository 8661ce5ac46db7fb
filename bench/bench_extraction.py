"""Hidden-state extraction throughput (tokens/s) against a bare forward pass of the same model on the same batches
(goal >= 0.9): what batching, slicing, validation and the bf16 safetensors write cost on top of the model. Then the
vLLM path (`EAGLE3Q_HS_BACKEND=vllm`) against the simulator in extract_hidden_states mode, on the same target and
samples (the simulator's forward stands in for vLLM's prefill: the ratio is the protocol's cost, HTTP, connector
file, lock, read back), and the store bandwidth the path needs at a given prefill rate."""

from __future__ import annotations

import random
import time

import torch
from common import report, workdir

from eagle3q.extraction.transformers_backend import TransformersExtractor, check_tensors, plan_batches, to_safetensors


def main() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3q.dev.tiny import build_tokenizer

    base = workdir("extraction")
    build_tokenizer(base / "target", vocab_size=8000)  # the simulator needs one; the samples are random ids
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(base / "target" / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(base / "target")
    ex = TransformersExtractor(str(base / "target"), None, "cpu", "float32")
    rng = random.Random(0)
    samples = [[rng.randrange(vocab) for _ in range(rng.randint(100, 700))] for _ in range(48)]
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
    v = vllm_path(base, samples)
    bare_alone = bare_one_by_one(ex, samples)
    # Kimi-K2.5: the connector's file and ours both hold 4 x 7168 bf16 per token.
    per_token = 4 * 7168 * 2
    prefill = 20_000  # tokens/s of prefill across the extraction vLLM's GPUs (an assumption: measure yours)
    report("hidden-state extraction: Llama H=512, 8 layers, 48 samples of 100-700 tokens, budget 4096", [
        ("bare forward (same batches)", f"{b:.0f} tokens/s"),
        ("eagle3q extraction + validation + bf16 file bytes", f"{o:.0f} tokens/s"),
        ("ratio", f"{o / b:.3f}  (goal >= 0.9)"),
        ("bare forward, one sample at a time, 1 thread (the simulator's prefill)", f"{bare_alone:.0f} tokens/s"),
        ("vLLM path against the simulator (HTTP, connector file, lock, read, checks)", f"{v:.0f} tokens/s"),
        ("vLLM path / one-at-a-time forward", f"{v / bare_alone:.3f}"),
        (f"store bandwidth at {prefill} prefill tokens/s (Kimi-K2.5, 57 KB/token)",
         f"connector writes {per_token * prefill / 1e9:.2f} GB/s, workers read it and write "
         f"{per_token * prefill / 1e9:.2f} GB/s"),
    ])
    return {"bare": b, "ours": o, "ratio": o / b, "vllm_path": v, "bare_one_by_one": bare_alone}


def bare_one_by_one(ex: TransformersExtractor, samples: list[list[int]]) -> float:
    """One sample per forward on one thread: what the simulator's stand-in for vLLM's prefill does (it keeps torch
    to one thread, sharing the machine with the workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.monotonic()
        for s in samples:
            with torch.inference_mode():
                ex.decoder(input_ids=torch.tensor([s]), output_hidden_states=True, use_cache=False)
        return sum(len(s) for s in samples) / (time.monotonic() - t0)
    finally:
        torch.set_num_threads(threads)


def vllm_path(base, samples: list[list[int]]) -> float:  # noqa: ANN001 - base: Path
    from eagle3q.dev.local import start_sim
    from eagle3q.extraction.vllm_backend import VllmExtractor

    proc, url = start_sim(str(base / "target"), base / "logs",
                          extra=["--target-model", str(base / "target"), "--hs-dir", str(base / "connector")])
    try:
        ex = VllmExtractor(url, "moonshotai/Kimi-K2.5", str(base / "target"), None, concurrency=1)
        ex.extract(samples[:2])  # warm-up
        t0 = time.monotonic()
        for s in samples:
            assert ex.extract([s])[0].reason is None
        return sum(len(s) for s in samples) / (time.monotonic() - t0)
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
