"""The store on an S3 bucket (EAGLE3Q_STORE_URL=s3://...), against moto's standalone server behind a front that can
be killed or made to refuse PUTs (tests/s3_server.py): the whole pipeline with no local store at all, faults on the
way, bad buckets and keys refused at start, and a trainer that resumes from the bucket's checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3q.config import Settings
from eagle3q.dev.local import child_env
from eagle3q.dev.s3_local import S3Server
from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.store import Store, StoreError

FAST_RETRY = {"EAGLE3Q_BACKOFF_BASE_S": "0.2", "EAGLE3Q_BACKOFF_MAX_S": "1", "EAGLE3Q_STORE_RETRIES": "1"}


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    server = S3Server(tmp_path / "s3")
    for k, v in server.env("unused").items():  # this process's own Store objects read the key from here too
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    yield server
    server.close()


def _store(s3: S3Server, prefix: str) -> Store:
    return Store.from_settings(Settings(store_url=s3.url(prefix), s3_endpoint=s3.endpoint, store_retries=1))


def test_objects_are_whole_or_absent_and_ranges_read_the_header_only(s3: S3Server, tiny: Path) -> None:
    """A reader racing a writer of an 11 MB object (a multipart upload) gets one complete version or nothing, never a
    part; the hidden-state header and token ids come back through ranged reads."""
    from eagle3q.extraction.transformers_backend import TransformersExtractor, to_safetensors

    store = _store(s3, "whole")
    big = [bytes([i]) * (11 << 20) for i in (1, 2)]
    seen: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                data = store.get_artifact("r", "big.bin")
            except FileNotFoundError:
                seen.append(0)
                continue
            assert data in big, f"a partial object: {len(data)} bytes"
            seen.append(data[0])

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(4):
        store.put_artifact("r", "big.bin", big[i % 2])
    time.sleep(0.3)
    stop.set()
    reader.join()
    assert len(seen) > 0 and set(seen) <= {0, 1, 2} and seen[-1] == 2

    ex = TransformersExtractor(str(tiny), None, "cpu", "float32")
    ids = list(range(5, 45))
    n = store.write_hidden("r", "a" * 32, to_safetensors(ids, [0] * 8 + [1] * 32, ex.extract([ids])[0],
                                                         {"aux_layer_ids": ex.aux_ids, "final_state": ex.final_state}))
    stored = s3.keys("whole/r/hidden/")  # moto's own listing
    assert store.hidden_valid("r", "a" * 32, 40) == n == stored[f"whole/r/hidden/aa/{'a' * 32}.safetensors"]
    tok, mask = store.hidden_tokens("r", "a" * 32)
    assert tok.tolist() == ids and int(mask.sum()) == 32
    assert store.hidden_ids("r") == ["a" * 32] and store.free_bytes() is None


def test_missing_bucket_or_wrong_key_refuses_the_worker_and_marks_nothing(s3: S3Server, stack_factory) -> None:  # noqa: ANN001
    bad_bucket = {**s3.env("p"), "EAGLE3Q_STORE_URL": "s3://no-such-bucket/p"}
    stack = stack_factory(env={**bad_bucket, **FAST_RETRY})
    w = stack.worker("inference", wait=False)
    assert w.proc.wait(timeout=60) != 0
    log = w.log.read_text()
    assert "NoSuchBucket" in log and "s3://no-such-bucket/p" in log
    refused = stack.ledger.refused_workers()
    assert any("NoSuchBucket" in r["cause"] for r in refused.values()), refused
    # The producer refuses it too, before it registers a prompt: nothing is marked anywhere.
    with pytest.raises(StoreError, match="NoSuchBucket"):
        stack.enqueue(SAMPLE_DATASET, "nb", max_samples=4)
    assert stack.ledger.counts("nb", "inference").incoming == 0

    wrong_key = {**s3.env("p"), "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    stack2 = stack_factory(env={**wrong_key, **FAST_RETRY})
    w2 = stack2.worker("hidden_states", wait=False)
    assert w2.proc.wait(timeout=90) != 0
    assert "SignatureDoesNotMatch" in w2.log.read_text()
    assert s3.keys("p/") == {}


def test_pipeline_on_s3_through_refused_puts_and_a_killed_server(s3: S3Server, stack_factory, assert_accounted,  # noqa: ANN001
                                                                  tiny: Path, tmp_path: Path) -> None:
    """No local store anywhere: samples, hidden states, the manifest, the vocabulary, checkpoints and the export all
    in the bucket. PUTs refused for a while, then the server killed and restarted mid-run: tasks retry, every prompt
    ends in one place, every stored object is whole, training runs once, and the export is fetched from the bucket
    and loads."""
    run = "s3run"
    env = {**s3.env("pipe"), **FAST_RETRY, "EAGLE3Q_EPOCHS": "2", "EAGLE3Q_TRAIN_BATCH_TOKENS": "512",
           "EAGLE3Q_VAL_FRACTION": "0.2", "EAGLE3Q_CHECKPOINT_EVERY": "3", "EAGLE3Q_TOKEN_BUDGET": "2048"}
    stack = stack_factory(env=env, sim_args=["--ttft", "1.5"])  # the first answers come after the PUTs are refused
    for role in ("inference", "hidden_states", "train"):
        stack.worker(role, concurrency=4)
    stack.enqueue(SAMPLE_DATASET, run, max_samples=24)
    s3.refuse_puts(True)
    L = stack.ledger
    deadline = time.monotonic() + 60
    while L.counts(run, "inference").stats.get("store_errors", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert L.counts(run, "inference").done == 0  # nothing marked while its object could not be written
    s3.refuse_puts(False)
    while L.counts(run, "hidden_states").done < 4 and time.monotonic() < deadline + 60:
        time.sleep(0.1)
    s3.kill_front()  # the server goes down mid-run
    at_kill = L.counts(run, "hidden_states").done
    time.sleep(2)
    s3.start_front()
    stack.wait_settled(run, stages=("inference", "hidden_states"), timeout_s=240)
    deadline = time.monotonic() + 240
    while L.train_progress(run).get("state") != "done" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert L.train_progress(run).get("state") == "done", L.train_progress(run)

    done, rejected = assert_accounted(stack, run)  # read back from the bucket: samples and rejections
    assert len(done) + len(rejected) == 24
    errors = sum(L.counts(run, st).stats.get("store_errors", 0) for st in ("inference", "hidden_states"))
    assert errors >= 4
    store = stack.store
    hs_done = L.done_ids(run, "hidden_states")
    assert set(store.hidden_ids(run)) == hs_done and len(hs_done) >= 20 and at_kill < len(hs_done)
    for sid in hs_done:  # every object whole: the size its header promises, the sample's length
        assert store.hidden_valid(run, sid, len(store.read_sample(run, sid).input_ids)) is not None
    assert L.counts(run, "hidden_states").stats["bytes"] == sum(s3.keys(f"pipe/{run}/hidden/").values())
    trainer = next(w for w in stack.workers if w.name.startswith("train")).log.read_text()
    assert trainer.count("succeeded") == 1
    result = store.get_json(run, "result.json")
    assert result["samples"] + result["val_samples"] == len(hs_done)
    names = set(s3.keys(f"pipe/{run}/train/"))
    for name in ("manifest.json", "vocab.safetensors", "export/model.safetensors", "export/config.json"):
        assert f"pipe/{run}/train/{name}" in names
    assert not stack.settings.store_dir.exists()  # nothing went to a local store

    # The export, fetched from the bucket by the CLI, is a directory vLLM loads (and so does our reader).
    dest = tmp_path / "draft"
    cli = [sys.executable, "-m", "eagle3q.cli"]
    out = subprocess.run([*cli, "fetch-export", str(dest), "--run", run], env=child_env(stack.env), text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from eagle3q.draft.export import load_exported
    from eagle3q.target import load_target_tensors

    model, cfg, _, _ = load_exported(dest, load_target_tensors(tiny)["embed"])
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    # `status` on the S3 store: sizes from the ledger, no free-space figure for an object store.
    snap = json.loads(subprocess.run([*cli, "status", "--run", run, "--json"], env=child_env(stack.env), text=True,
                                     capture_output=True, timeout=60, check=True).stdout)
    assert snap["store"]["url"] == s3.url("pipe") and snap["store"]["free_bytes"] is None
    assert snap["store"]["bytes"] == L.counts(run, "hidden_states").stats["bytes"]


def test_a_trainer_killed_resumes_from_the_buckets_checkpoint_on_the_same_schedule(s3: S3Server, tiny: Path) -> None:
    """One store in a bucket trained straight through; another, the same samples, its trainer killed at step 7 and a
    fresh one (another process, another machine: nothing local carries over) resuming from the checkpoint: the same
    steps and the same weights."""
    from safetensors.torch import load

    from eagle3q.dev.samples import write_samples
    from eagle3q.draft.manifest import load_or_create
    from eagle3q.draft.training import train_draft
    from eagle3q.sources import Prompt, iter_prompts
    from eagle3q.stages.train import train_run

    class Killed(Exception):
        pass

    s = Settings(target_model=str(tiny), draft_vocab_size=512, epochs=2, lr=3e-3, train_batch_tokens=300,
                 val_fraction=0.0, checkpoint_every=5)
    a, b = _store(s3, "a"), _store(s3, "b")
    prompts = [p for p in iter_prompts(SAMPLE_DATASET) if isinstance(p, Prompt)][:16]
    write_samples(tiny, a, "x", prompts)
    write_samples(tiny, b, "x", prompts)
    full = train_run("x", s, a)

    def dies_at_step_7(**kw: object) -> None:
        if int(kw.get("step", 0) or 0) >= 7:
            raise Killed

    with pytest.raises(Killed):
        train_draft(load_or_create(b, "x", 0.0), b, s, str(tiny), dies_at_step_7, log_every=1)
    resumed = train_run("x", s, _store(s3, "b"))  # a new Store: all it knows is in the bucket
    assert resumed.resumed_from == 5 and resumed.steps == full.steps
    wa, wb = (load(st.get_artifact("x", "export/model.safetensors")) for st in (a, b))
    for k in wa:
        torch.testing.assert_close(wa[k].float(), wb[k].float(), atol=1e-6, rtol=0, msg=k)
    assert resumed.export_dir == s3.url("b") + "/x/train/export"
