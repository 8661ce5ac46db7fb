"""The hidden-state consistency check at Kimi-K2.5's size (LM head 163,840 x 7,168 in bf16, 2.3 GB) against what
the same worker already does for every sample: write its hidden-state file (4 x 7,168 bf16 per token, ~170 MB for a
3,000-token sample). Both on this machine's CPU, in the same run; the ratio is the check's cost per sample."""

from __future__ import annotations

import json
import time

import torch
from common import report, workdir
from safetensors.torch import save_file

from eagle3q.extraction.consistency import ConsistencyCheck
from eagle3q.extraction.transformers_backend import Extracted, to_safetensors
from eagle3q.store import Store

VOCAB, HIDDEN, TOKENS, PROMPT = 163_840, 7_168, 3_000, 200


def main() -> dict:
    base = workdir("consistency")
    target = base / "target"
    target.mkdir()
    g = torch.Generator().manual_seed(0)
    head = torch.empty(VOCAB, HIDDEN, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    save_file({"lm_head.weight": head, "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)},
              str(target / "model.safetensors"))
    del head
    (target / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": HIDDEN,
                                                    "vocab_size": VOCAB, "rms_norm_eps": 1e-6}))
    check = ConsistencyCheck(target, positions=32)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=g).tolist()
    mask = [0] * PROMPT + [1] * (TOKENS - PROMPT)
    final = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    ex = Extracted(aux=torch.randn(TOKENS, 3 * HIDDEN, generator=g).to(torch.bfloat16), final=final)

    def timed(fn, n: int = 5) -> float:  # noqa: ANN001
        fn()  # warm-up
        t0 = time.monotonic()
        for _ in range(n):
            fn()
        return (time.monotonic() - t0) / n

    c = timed(lambda: check.agreement("s", ids, mask, final, "pre_norm"))
    store = Store(base / "store")
    w = timed(lambda: store.write_hidden("c", "s", to_safetensors(ids, mask, ex, {"final_state": "pre_norm"})))
    size = len(store.hidden_bytes("c", "s"))
    report(f"consistency check, Kimi-K2.5 head ({VOCAB} x {HIDDEN} bf16), {TOKENS}-token sample, "
           f"{torch.get_num_threads()} threads", [
        ("check (32 positions x 3 offsets through norm + head)", f"{c * 1000:.0f} ms"),
        (f"write the sample's file ({size / 1e6:.0f} MB)", f"{w * 1000:.0f} ms"),
        ("check / write", f"{c / w:.3f}"),
        ("Kimi reference run: 0.6 samples/s", f"check uses {c * 0.6:.2f} of one worker's second"),
    ])
    return {"check_s": c, "write_s": w, "ratio": c / w}


if __name__ == "__main__":
    main()
