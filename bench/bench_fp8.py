"""fp8 hidden-state storage (EAGLE3Q_HS_DTYPE=fp8) against bf16, in one run (issue 21.3):

1. bytes a token as written (the tiny target, and a Kimi-K2.5-size sample, H=7,168), and the write path's speed
   for that sample (convert, quantize, serialize, atomic write): what an extraction worker spends per sample;
2. extraction throughput on the tiny target (forward + checks + write, tokens/s), bf16 against fp8;
3. the restored states' error, our scale per token and layer against hs_connectors' one per token;
4. the demo's draft trained twice on the same samples (the demo's pipeline and settings: the simulator generating
   greedily with the tiny target, bf16 files, and an fp8 copy of each, which is the file an fp8 worker writes: it
   quantizes the same bf16 tensors), acceptance on the same held-out prompts at k = 1..5. `--engine vllm`: also
   measured by vLLM's engine speculating with each export (its counters, `eagle3q.evaluation.served`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from common import report, workdir

from eagle3q.extraction.transformers_backend import Extracted, to_safetensors
from eagle3q.store import Store
from eagle3q.store.fp8 import dequantize, quantize

DTYPES = ("bf16", "fp8")


def _kimi_like(tokens: int, h: int = 7168) -> Extracted:
    """States shaped like a large model's: most dims small, a few massive ones, larger in later layers."""
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(tokens, 3, h, generator=g) * torch.tensor([1.0, 4.0, 12.0]).view(1, 3, 1)
    final = torch.randn(tokens, h, generator=g) * 20
    aux[:, :, :4] *= 50
    final[:, :4] *= 50
    return Extracted(aux.reshape(tokens, 3 * h), final)


def storage(base: Path, tokens: int = 1000) -> dict:
    ex = _kimi_like(tokens)
    ids, mask = list(range(tokens)), [0] * 100 + [1] * (tokens - 100)
    out: dict = {}
    store = Store(base / "kimi-store")
    for d in DTYPES:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            n = store.write_hidden("kimi", d, to_safetensors(ids, mask, ex, {"final_state": "pre_norm"}, d))
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        t, _ = store.read_hidden("kimi", d)  # and to float32, as training's load_batch does: bf16's cost is there
        _ = [t[k].float() for k in ("aux_hidden_states", "hidden_state")]
        out[d] = {"bytes_per_token": n / tokens, "write_s": min(times), "read_s": time.perf_counter() - t0}
    return out


def scale_error(ex: Extracted, h: int) -> dict:
    """Relative error (norm over H, mean over tokens and layers) of the restored states: a scale per token and
    layer (ours) against one per token over the four layers (hs_connectors' own writer)."""
    t = ex.final.shape[0]
    layers = torch.cat([ex.aux.reshape(t, 3, h), ex.final.reshape(t, 1, h)], 1).to(torch.bfloat16).float()
    ours = dequantize(*quantize(layers.reshape(t, -1), 4)).reshape(t, 4, h)
    amax = layers.abs().amax(dim=(1, 2), keepdim=True)
    scale = (amax / 448).clamp(min=1e-12)
    theirs = (layers / scale).to(torch.float8_e4m3fn).float() * scale

    def rel(x: torch.Tensor) -> list[float]:
        return [round(float(v), 4) for v in ((x - layers).norm(dim=-1) / layers.norm(dim=-1)).mean(0)]

    return {"per_token_layer": rel(ours), "per_token": rel(theirs)}


def extraction(tiny: Path, n: int = 24) -> dict:
    import random

    from eagle3q.extraction.transformers_backend import TransformersExtractor, check_tensors

    ex = TransformersExtractor(str(tiny), None, "cpu", "float32")
    rng = random.Random(0)
    samples = [[rng.randrange(1000) for _ in range(rng.randint(200, 600))] for _ in range(n)]
    tokens = sum(map(len, samples))
    ex.extract(samples[:2])  # warm-up
    rates, err = {}, {}
    for _ in range(2):  # interleaved: drift on a shared machine hits both
        for d in DTYPES:
            t0 = time.perf_counter()
            for s in samples:
                out = ex.extract([s])[0]
                assert check_tensors(s, out, ex.hidden_size) is None
                to_safetensors(s, [1] * len(s), out, {"final_state": ex.final_state}, d)
            rates.setdefault(d, []).append(tokens / (time.perf_counter() - t0))
    err = scale_error(ex.extract([samples[0]])[0], ex.hidden_size)
    return {"tokens_per_s": {d: sum(v) / len(v) for d, v in rates.items()}, "error": err}


def _pipeline_store(base: Path, tiny: Path, run: str) -> Path:
    """The demo's pipeline (simulator greedy with the tiny target, inference and hidden-state workers): the store."""
    from common import stack

    from eagle3q.dev.demo import TRAIN_ENV
    from eagle3q.dev.tiny import SAMPLE_DATASET

    st = stack(base / "stack", tiny, ["--target-model", str(tiny)], **TRAIN_ENV)
    try:
        st.worker("inference", concurrency=16)
        st.worker("hidden_states")
        st.enqueue(SAMPLE_DATASET, run)
        st.wait_settled(run, stages=("inference", "hidden_states"), timeout_s=900)
        return Path(st.settings.store_dir)
    finally:
        st.close()


def _fp8_copy(src: Path, dst: Path, run: str) -> None:
    """The same run with every hidden-state file in fp8, quantized from the same bf16 tensors an fp8 worker would."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / run / "train", ignore_errors=True)  # a copy of a local store: its run's artifacts go
    store = Store(dst)
    for sid in store.hidden_ids(run):
        t, _ = store.read_hidden(run, sid)
        meta = {k: json.loads(v) for k, v in store.hidden_header(run, sid).metadata.items() if k != "hs_dtype"}
        store.write_hidden(run, sid, to_safetensors(t["input_ids"].tolist(), t["loss_mask"].tolist(),
                                                    Extracted(t["aux_hidden_states"], t["hidden_state"]), meta, "fp8"))


def acceptance(base: Path, tiny: Path, engine: str) -> dict:
    from eagle3q.config import Settings
    from eagle3q.dev.demo import SERVED_KS, TRAIN_ENV
    from eagle3q.draft.manifest import load_or_create
    from eagle3q.draft.training import train_draft
    from eagle3q.evaluation.offline import acceptance_table, heldout_prompts
    from eagle3q.store import Store

    run = "fp8bench"
    stores = {"bf16": _pipeline_store(base, tiny, run)}
    stores["fp8"] = base / "store-fp8"
    _fp8_copy(stores["bf16"], stores["fp8"], run)
    env = {k.removeprefix("EAGLE3Q_").lower(): v for k, v in TRAIN_ENV.items()}
    s = Settings(target_model=str(tiny), **env)
    out: dict = {}
    prompts = None
    for d, root in stores.items():
        store = Store(root)
        m = load_or_create(store, run, s.val_fraction)
        ids = [e.sample_id for e in (*m.train, *m.val)]
        t0 = time.monotonic()
        result = train_draft(m, store, s, str(tiny), lambda **_: None, log_every=10**6)
        export = Path(result.export_dir)  # a local store: the export's own directory
        prompts = prompts or heldout_prompts(store, run, 32)
        table = acceptance_table(str(tiny), str(export), prompts, store, run, max_new=64)
        if engine == "vllm":
            from eagle3q.dev.vllm_engine import eagle3_args, start_engine
            from eagle3q.evaluation.served import served_acceptance

            table["vllm"] = {}
            for k in SERVED_KS:
                e = start_engine(tiny, base / "vllm", "moonshotai/Kimi-K2.5", eagle3_args(export, k),
                                 max_num_seqs=4, max_model_len=4096)
                try:
                    table["vllm"][k] = served_acceptance(e.url, e.model, prompts, 64).mean_length
                finally:
                    e.stop()
        bytes_ = sum(len(store.hidden_bytes(run, sid)) for sid in ids)
        out[d] = {"table": table, "train_s": time.monotonic() - t0, "samples": len(ids), "bytes": bytes_,
                  "loss": result.final_loss, "heldout": len(prompts)}
    return out


def main(engine: str = "sim") -> dict:
    base = workdir("fp8")
    from common import tiny_target

    tiny = tiny_target(base, with_model=True)
    st = storage(base)
    ext = extraction(tiny)
    acc = acceptance(base, tiny, engine)
    rows = [(f"Kimi-size sample (H=7168, 1,000 tokens), {d}",
             f"{st[d]['bytes_per_token']:,.0f} B/token, write {st[d]['write_s'] * 1e3:.0f} ms, "
             f"read as float32 {st[d]['read_s'] * 1e3:.0f} ms") for d in DTYPES]
    rows.append(("  ratio fp8 / bf16 bytes", f"{st['fp8']['bytes_per_token'] / st['bf16']['bytes_per_token']:.3f}"))
    rows += [(f"tiny target extraction + write, {d}", f"{ext['tokens_per_s'][d]:,.0f} tokens/s") for d in DTYPES]
    rows.append(("  ratio fp8 / bf16", f"{ext['tokens_per_s']['fp8'] / ext['tokens_per_s']['bf16']:.3f}"))
    rows.append(("restored error by layer (aux x3, final), ours",
                 f"{ext['error']['per_token_layer']} (scale per token and layer)"))
    rows.append(("  hs_connectors' writer", f"{ext['error']['per_token']} (one scale per token)"))
    cols = [c for c in acc["bf16"]["table"] if c != "ceiling"]
    for d in DTYPES:
        a = acc[d]
        rows.append((f"demo draft on {d} files ({a['samples']} samples, {a['bytes'] / 1e6:.1f} MB)",
                     f"loss {a['loss']:.4f}, trained in {a['train_s']:.0f} s"))
        for c in cols:
            rows.append((f"  {c}, k = 1..5 ({a['heldout']} held-out prompts)",
                         " / ".join(f"{a['table'][c][k]:.3f}" for k in sorted(a['table'][c]))))
    for c in cols:
        diff = {k: acc["fp8"]["table"][c][k] - acc["bf16"]["table"][c][k] for k in acc["bf16"]["table"][c]}
        rows.append((f"fp8 - bf16 acceptance ({c})", " / ".join(f"{v:+.3f}" for _, v in sorted(diff.items()))))
    report("fp8 hidden states (e4m3, a float32 scale per token and layer) against bf16, same samples", rows)
    return {"storage": st, "extraction": ext, "acceptance": acc}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                   help="vllm: the acceptance also measured by vLLM's engine speculating with each export")
    main(p.parse_args().engine)
