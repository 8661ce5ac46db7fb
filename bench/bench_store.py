"""The store on S3 against the store on local disk, in one run (issue 36), on moto's server on loopback:

(1) training throughput (tokens/s) reading every sample from the bucket with read-ahead, against reading it from a
    local directory (goal >= 0.9); also with 20 ms added to every request (a remote object store's first-byte
    latency, which loopback does not have), with and without read-ahead;
(2) the hidden-state stage's write throughput (MB/s) of sample-sized objects, 1 to 8 parallel writers, S3 against
    local disk, and how many writers Kimi-K2.5's 1.15 GB/s (20k prefill tokens/s x 57 KB a token in bf16) takes.

moto is a Python server on the same 2 cores as the client: its ceiling is this machine's, not S3's. The writer
count says what it takes here; the per-writer rate is the figure to compare with a real bucket's."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_training import hidden_run
from common import report, workdir

from eagle3q.config import Settings
from eagle3q.dev.s3_local import S3Server
from eagle3q.draft.manifest import load_or_create
from eagle3q.draft.training import train_draft
from eagle3q.store import Store
from eagle3q.store.run_store import VOCAB

KIMI_BYTES_PER_S = 20_000 * 57_353  # 20k prefill tokens/s x Kimi-K2.5's bytes a token in bf16 (7168 x 4 x 2 + 9)


def _s3_store(server: S3Server, prefix: str, s: Settings) -> Store:
    os.environ.update({"AWS_ACCESS_KEY_ID": server.key_id, "AWS_SECRET_ACCESS_KEY": server.secret})
    return Store.from_settings(s.model_copy(update={"store_url": server.url(prefix), "s3_endpoint": server.endpoint}))


def _copy_run(src: Store, dst: Store, run: str) -> None:
    for sid in src.hidden_ids(run):
        dst.write_hidden(run, sid, src.hidden_bytes(run, sid))


def _train_rate(store: Store, s: Settings, target: str) -> float:
    m = load_or_create(store, "b", 0.0)
    store.delete_artifact("b", VOCAB)  # each run counts its vocabulary, as a first trainer does
    t0 = time.monotonic()
    train_draft(m, store, s, target, lambda **_: None, log_every=10**6)
    return sum(e.tokens for e in m.train) / (time.monotonic() - t0)


def training(base: Path) -> dict:
    local, target = hidden_run(base, 32)
    s = Settings(target_model=target, draft_vocab_size=2048, epochs=1, train_batch_tokens=4096, val_fraction=0.0,
                 checkpoint_every=10**6)
    out: dict = {}
    near = S3Server(base / "s3-near")
    far = S3Server(base / "s3-far", delay_ms=20)
    try:
        s3, s3_far = _s3_store(near, "t", s), _s3_store(far, "t", s)
        _copy_run(local, s3, "b")
        _copy_run(local, s3_far, "b")
        _train_rate(local, s, target)  # warm-up
        runs = {"local": [], "s3": [], "s3_20ms": [], "s3_20ms_no_read_ahead": []}
        for _ in range(2):  # interleaved: drift on a shared machine hits every column
            runs["local"].append(_train_rate(local, s, target))
            runs["s3"].append(_train_rate(s3, s, target))
            runs["s3_20ms"].append(_train_rate(s3_far, s, target))
            runs["s3_20ms_no_read_ahead"].append(_train_rate(s3_far, s.model_copy(update={"train_read_ahead": 0}),
                                                             target))
        out = {k: sum(v) / len(v) for k, v in runs.items()}
    finally:
        near.close()
        far.close()
    return out


def _write_rate(store: Store, writers: int, size: int, per_writer: int) -> float:
    data = os.urandom(size)

    def write(w: int) -> None:
        for i in range(per_writer):
            store.write_hidden("w", f"{w:04d}{i:028d}", data)

    t0 = time.monotonic()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers)))
    return writers * per_writer * size / (time.monotonic() - t0)


def writes(base: Path, size: int = 16 << 20) -> dict:
    """Sample-sized objects (16 MB: a 280-token Kimi sample in bf16), each writer in its own thread as each
    hidden-state worker writes its own samples."""
    server = S3Server(base / "s3-writes")
    out: dict = {}
    try:
        s3 = _s3_store(server, "w", Settings())
        for writers in (1, 2, 4, 8):
            local = Store(base / f"local-writes-{writers}")
            out[writers] = {"local": _write_rate(local, writers, size, 4), "s3": _write_rate(s3, writers, size, 4)}
            shutil.rmtree(base / f"local-writes-{writers}", ignore_errors=True)
            for key in list(server.keys("w/")):
                server.client().delete_object(Bucket=server.bucket, Key=key)
    finally:
        server.close()
    return out


def main() -> dict:
    base = workdir("store")
    t = training(base)
    w = writes(base)
    best = max(w, key=lambda n: w[n]["s3"])
    per_writer = w[1]["s3"]
    rows = [
        ("training from local disk", f"{t['local']:.0f} tokens/s"),
        ("training from S3 (moto, loopback), read-ahead 16", f"{t['s3']:.0f} tokens/s"),
        ("  ratio S3 / local", f"{t['s3'] / t['local']:.3f}  (goal >= 0.9)"),
        ("training from S3 + 20 ms a request, read-ahead 16", f"{t['s3_20ms']:.0f} tokens/s"),
        ("  ratio / local", f"{t['s3_20ms'] / t['local']:.3f}"),
        ("training from S3 + 20 ms a request, no read-ahead", f"{t['s3_20ms_no_read_ahead']:.0f} tokens/s"),
        ("  ratio / local", f"{t['s3_20ms_no_read_ahead'] / t['local']:.3f}"),
    ]
    for n, r in w.items():
        rows.append((f"write 16 MB objects, {n} writer(s): local / S3", f"{r['local'] / 1e6:.0f} / {r['s3'] / 1e6:.0f} "
                     f"MB/s  (ratio {r['s3'] / r['local']:.3f})"))
    rows.append(("Kimi-K2.5 needs (20k prefill tokens/s, bf16)", f"{KIMI_BYTES_PER_S / 1e9:.2f} GB/s"))
    rows.append(("  S3 writers for it at one writer's rate here",
                 f"{-(-KIMI_BYTES_PER_S // int(per_writer))} (one writer {per_writer / 1e6:.0f} MB/s; best here "
                 f"{w[best]['s3'] / 1e6:.0f} MB/s at {best}: moto's ceiling on these 2 cores)"))
    report("the store on S3 (moto on loopback) against local disk, one run", rows)
    return {"training": t, "writes": w}


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()
    main()
