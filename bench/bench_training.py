"""Draft training throughput (tokens/s) against a bare forward + backward + optimizer step of the same draft on the
same batches with the same inputs already in memory (goal >= 0.9): what reading the files, the target head (with
the full-vocabulary check for the out-of-vocabulary mask), the metrics and the checkpoints cost on top. Also the
time from the training trigger to the exported draft in a real pipeline (workers, Redis, the trainer's lock)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from common import report, workdir

from eagle3q.config import Settings
from eagle3q.draft.manifest import load_or_create
from eagle3q.draft.training import TargetHead, load_batch, make_model, plan_epoch, train_draft, ttt_loss
from eagle3q.draft.vocab import build_vocab
from eagle3q.extraction.transformers_backend import TransformersExtractor, to_safetensors
from eagle3q.store import Store
from eagle3q.store.run_store import EXPORT, RESULT, VOCAB


def hidden_run(base: Path, n: int) -> tuple[Store, str]:
    """n samples of 200-600 tokens with the target's hidden states (Llama H=256 x 8 layers, vocab 8000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(base / "target")
    ex = TransformersExtractor(str(base / "target"), None, "cpu", "float32")
    store, rng = Store(base / "store"), random.Random(0)
    for i in range(n):
        ids = [rng.randrange(8000) for _ in range(rng.randint(200, 600))]
        store.write_hidden("b", f"{i:032x}", to_safetensors(
            ids, [0] * 50 + [1] * (len(ids) - 50), ex.extract([ids])[0],
            {"aux_layer_ids": ex.aux_ids, "final_state": ex.final_state, "dataset": "bench", "row": i}))
    return store, str(base / "target")


def throughput(base: Path) -> dict:
    store, target = hidden_run(base, 32)
    s = Settings(target_model=target, draft_vocab_size=2048, epochs=1, train_batch_tokens=4096, val_fraction=0.0,
                 checkpoint_every=10**6)
    m = load_or_create(store, "b", 0.0)
    ids = [e.sample_id for e in m.train]
    tokens = sum(e.tokens for e in m.train)

    def ours() -> float:
        store.delete_artifact("b", VOCAB)  # each run builds its vocabulary, as a first trainer does
        t0 = time.monotonic()
        train_draft(m, store, s, target, lambda **_: None, log_every=10**6)
        return tokens / (time.monotonic() - t0)

    # The bare loop: the same draft, batches and TTT steps, inputs and target distributions precomputed in memory.
    model, cfg, tensors = make_model(s, target)
    _, t2d, _ = build_vocab(store, "b", ids, cfg.vocab_size, cfg.draft_vocab_size)
    head = TargetHead(tensors, t2d, cfg.rms_norm_eps)
    loaded = {sid: load_batch(store.hidden_bytes("b", sid), s.max_len) for sid in ids}
    prepared = {sid: (b, *head(b)) for sid, b in loaded.items()}
    batches = plan_epoch(m.train, s.train_batch_tokens, s.seed, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr)

    def bare() -> float:
        t0 = time.monotonic()
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            for i in batch:
                b, p, in_vocab = prepared[m.train[i].sample_id]
                loss, _ = ttt_loss(model, b, p, in_vocab, s.ttt_steps)
                loss.backward()
            opt.step()
        return tokens / (time.monotonic() - t0)

    bare()  # warm-up
    b1, o1, b2, o2 = bare(), ours(), bare(), ours()  # interleaved: drift on a shared machine hits both
    b, o = (b1 + b2) / 2, (o1 + o2) / 2
    return {"bare": b, "ours": o, "ratio": o / b, "tokens": tokens}


def trigger_to_export(base: Path) -> tuple[float, int]:
    """Seconds from the ledger's training trigger to the export on disk, 40 prompts through the whole stack."""
    from common import stack, tiny_target

    from eagle3q.dev.tiny import SAMPLE_DATASET

    tiny = tiny_target(base, with_model=True)
    st = stack(base / "stack", tiny, ["--ttft", "0.005", "--itl", "0.0005", "--target-model", str(tiny)],
               EAGLE3Q_EPOCHS="2", EAGLE3Q_TRAIN_BATCH_TOKENS="1024", EAGLE3Q_VAL_FRACTION="0.1")
    try:
        for role in ("inference", "hidden_states", "train"):
            st.worker(role, concurrency=8)
        st.enqueue(SAMPLE_DATASET, "t2e", max_samples=40)
        deadline = time.monotonic() + 300
        while st.ledger.train_progress("t2e").get("state") != "done" and time.monotonic() < deadline:
            time.sleep(0.2)
        fired = st.ledger.train_fired_at("t2e")
        export = st.store.blobs.path(st.store.artifact_key("t2e", f"{EXPORT}/model.safetensors"))  # a local store
        result = st.store.get_json("t2e", RESULT)
        return export.stat().st_mtime - fired, result["steps"]
    finally:
        st.close()


def main() -> dict:
    base = workdir("training")
    t = throughput(base)
    seconds, steps = trigger_to_export(base)
    report("draft training: Llama target H=256 x 8 layers, 32 samples of 200-600 tokens, 4096-token batches", [
        ("bare forward + backward + step (inputs in memory)", f"{t['bare']:.0f} tokens/s"),
        ("eagle3q train_draft (files, target head, OOV mask, metrics, export)", f"{t['ours']:.0f} tokens/s"),
        ("ratio", f"{t['ratio']:.3f}  (goal >= 0.9)"),
        ("trigger -> export, 40 prompts, 2 epochs, whole stack", f"{seconds:.1f} s ({steps} steps)"),
    ])
    return {**t, "trigger_to_export_s": seconds}


if __name__ == "__main__":
    main()
