"""The hidden-state stage through the serving engine (`EAGLE3Q_HS_BACKEND=vllm`): the simulator plays a vLLM with
extract_hidden_states and the ExampleHiddenStatesConnector, the workers read its files; the result equals the
transformers backend's, and the connector's directory is left empty."""

from __future__ import annotations

import json
import time

import torch

from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.extraction.transformers_backend import TransformersExtractor
from tests.store_paths import hidden_file, load_hidden, run_dir


def test_pipeline_with_the_vllm_hidden_state_backend(stack_factory, tmp_path, tiny):  # noqa: ANN001
    connector = tmp_path / "connector"
    stack = stack_factory(sim_args=["--target-model", str(tiny), "--hs-dir", str(connector)],
                          env={"EAGLE3Q_HS_BACKEND": "vllm", "EAGLE3Q_TRAIN_TARGET": "1000"})
    stack.env["EAGLE3Q_HS_VLLM_BASE_URL"] = stack.sim_urls[0]
    stack.worker("inference", concurrency=4)
    stack.worker("hidden_states", EAGLE3Q_HS_VLLM_BASE_URL=stack.sim_urls[0])
    stack.enqueue(SAMPLE_DATASET, "hsv", max_samples=8)
    stack.wait_settled("hsv", stages=("inference", "hidden_states"), timeout_s=120)
    done, rejected = stack.ledger.done_ids("hsv", "hidden_states"), stack.ledger.rejected("hsv", "hidden_states")
    assert len(done) == 8 and not rejected, [stack.store.read_rejection("hsv", "hidden_states", sid).detail
                                             for sid in rejected]
    ref = TransformersExtractor(str(tiny), None, "cpu", "float32")
    for sid in done:
        sample = stack.store.read_sample("hsv", sid)
        ours = load_hidden(hidden_file(stack.store, "hsv", sid))
        want = ref.extract([sample.input_ids])[0]
        assert torch.equal(ours["input_ids"], torch.tensor(sample.input_ids))
        torch.testing.assert_close(ours["aux_hidden_states"].float(), want.aux, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(ours["hidden_state"].float(), want.final, atol=3e-2, rtol=3e-2)
    from safetensors import safe_open

    with safe_open(str(hidden_file(stack.store, "hsv", next(iter(done)))), framework="pt") as f:
        meta = f.metadata()
    assert meta["backend"] == '"vllm"' and meta["final_state"] == '"pre_norm"'
    assert json.loads(meta["consistency"])["top1"] >= 0.9  # the simulator's greedy text, held to the sampled 0.4
    assert not any(connector.iterdir())  # every connector file and lock read and removed


def test_vllm_backend_worker_killed_mid_run_loses_nothing(stack_factory, tmp_path, tiny):  # noqa: ANN001
    import signal
    import time

    connector = tmp_path / "connector"
    stack = stack_factory(sim_args=["--target-model", str(tiny), "--hs-dir", str(connector)],
                          env={"EAGLE3Q_HS_BACKEND": "vllm", "EAGLE3Q_TRAIN_TARGET": "1000",
                               "EAGLE3Q_VISIBILITY_TIMEOUT_S": "4", "EAGLE3Q_RESTORE_SWEEP_S": "1"})
    stack.env["EAGLE3Q_HS_VLLM_BASE_URL"] = stack.sim_urls[0]
    stack.worker("inference", concurrency=8)
    stack.enqueue(SAMPLE_DATASET, "hskill", max_samples=40)
    stack.wait_settled("hskill", timeout_s=120)  # all generated; now extraction
    victim = stack.worker("hidden_states", EAGLE3Q_TOKEN_BUDGET="512")
    deadline = time.monotonic() + 60
    while stack.ledger.counts("hskill", "hidden_states").done < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.kill(signal.SIGKILL)
    assert stack.ledger.counts("hskill", "hidden_states").done < 40
    stack.worker("hidden_states", EAGLE3Q_TOKEN_BUDGET="512")
    stack.wait_settled("hskill", stages=("inference", "hidden_states"), timeout_s=180)
    c = stack.ledger.counts("hskill", "hidden_states")
    assert c.done == 40 and c.rejected == 0
    assert len(list(run_dir(stack.store, "hskill").glob("hidden/*/*.safetensors"))) == 40
    # A request the killed worker had in flight may leave its connector file behind (status counts it); no more.
    assert len(list(connector.glob("*.safetensors"))) <= 8


def _kimi_shaped(tiny, out):  # noqa: ANN001, ANN202
    """The tiny target's files under Kimi-K2.5's config wrapper (a multimodal architecture, the DeepSeek-V3 text
    model nested in text_config): what the extraction backend reads to know the target's backbone."""
    import json

    out.mkdir()
    for f in tiny.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    text = json.loads((tiny / "config.json").read_text())
    text.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (out / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text,
                                                 "architectures": ["KimiK25ForConditionalGeneration"]}))
    return out


def test_an_extraction_server_that_drops_kimis_final_layer_is_refused(stack_factory, tmp_path, tiny):  # noqa: ANN001
    """vLLM before 0.25.0 returns one state fewer than configured for the deepseek_v2 backbone (Kimi-K2.5): the
    backend asks /version first and sends nothing to such a server; the tasks wait, counted, for the upgrade, and
    no sample is rejected. A Llama target has no such floor, and 0.25.0 passes."""
    import pytest

    from eagle3q.dev.local import start_sim
    from eagle3q.extraction.vllm_backend import VllmExtractor, final_layer_floor
    from eagle3q.generate.endpoints import ServerTooOld

    kimi = _kimi_shaped(tiny, tmp_path / "kimi")
    assert final_layer_floor(str(kimi)) == (0, 25, 0) and final_layer_floor(str(tiny)) is None
    for version, refused in (("0.17.0", True), ("0.24.0", True), ("0.25.0", False)):
        proc, url = start_sim(str(tiny), tmp_path / f"logs-{version}", extra=[
            "--target-model", str(tiny), "--hs-dir", str(tmp_path / f"c-{version}"), "--vllm-version", version])
        try:
            for target, floor in ((kimi, True), (tiny, False)):
                ex = VllmExtractor(url, "moonshotai/Kimi-K2.5", str(target), None, concurrency=1, timeout_s=30)
                try:
                    if refused and floor:
                        with pytest.raises(ServerTooOld, match=r"drops this target's final layer.*>= 0\.25\.0"):
                            ex.extract([list(range(5, 30))])
                        assert not (tmp_path / f"c-{version}").exists() or \
                            not any((tmp_path / f"c-{version}").iterdir())  # nothing was sent
                    else:
                        assert ex.extract([list(range(5, 30))])[0].reason is None
                finally:
                    ex.close()
        finally:
            proc.kill()

    connector = tmp_path / "connector"
    stack = stack_factory(sim_args=["--target-model", str(tiny), "--hs-dir", str(connector)],
                          env={"EAGLE3Q_HS_BACKEND": "vllm", "EAGLE3Q_TRAIN_TARGET": "1000",
                               "EAGLE3Q_TARGET_MODEL": str(kimi)})
    stack.worker("inference", concurrency=4)
    stack.worker("hidden_states", EAGLE3Q_HS_VLLM_BASE_URL=stack.sim_urls[0])
    stack.enqueue(SAMPLE_DATASET, "old", max_samples=4)
    stack.wait_settled("old", timeout_s=60)
    deadline = time.monotonic() + 30
    while stack.ledger.stat("old", "hidden_states", "server_too_old") < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    c = stack.ledger.counts("old", "hidden_states")
    assert stack.ledger.stat("old", "hidden_states", "server_too_old") >= 4
    assert c.done == 0 and c.rejected == 0  # still queued: an upgraded server takes them all


def test_states_from_the_wrong_layer_or_shifted_are_rejected_as_inconsistent(stack_factory, tmp_path, tiny):  # noqa: ANN001
    """Through the vLLM backend: a server whose "final" column is layer L-1, and one whose states are shifted by a
    token, pass every shape check; the consistency check rejects their samples by name, and passes the right
    server's with the agreement in the file's metadata and in `status`."""
    from safetensors import safe_open

    from eagle3q.dev.local import start_sim
    from eagle3q.status import snapshot

    connector = tmp_path / "connector"
    stack = stack_factory(sim_args=["--target-model", str(tiny), "--hs-dir", str(connector)],
                          env={"EAGLE3Q_HS_BACKEND": "vllm", "EAGLE3Q_TRAIN_TARGET": "1000",
                               "EAGLE3Q_TEMPERATURE": "0", "EAGLE3Q_TOP_P": "1"})
    stack.worker("inference", concurrency=4)
    servers = {"right": stack.sim_urls[0]}
    for name, extra in (("wrong_layer", ["--hs-layer-ids", "2,4,5,7"]), ("shifted", ["--hs-shift", "1"])):
        proc, url = start_sim(str(tiny), tmp_path / "logs", extra=["--target-model", str(tiny), "--hs-dir",
                                                                  str(connector), *extra])
        stack.sims.append(proc)  # stopped with the stack
        servers[name] = url
    assert len(servers) == 3
    for name, url in servers.items():
        worker = stack.worker("hidden_states", EAGLE3Q_HS_VLLM_BASE_URL=url)
        stack.enqueue(SAMPLE_DATASET, name, max_samples=6)
        stack.wait_settled(name, stages=("inference", "hidden_states"), timeout_s=120)
        worker.kill()
        done, rejected = stack.ledger.done_ids(name, "hidden_states"), stack.ledger.rejected(name, "hidden_states")
        snap = snapshot(stack.ledger, name)
        cons = snap["stages"]["hidden_states"]["consistency"]
        if name == "right":
            assert len(done) == 6 and not rejected
            # Everything extracted: the store's projection is what it holds.
            assert snap["store"]["samples_left"] == 0 and snap["store"]["projected_bytes"] == snap["store"]["bytes"]
            assert cons["mean_top1"] >= 0.9 and cons["checked"] == 6 and cons["inconsistent"] == 0
            with safe_open(str(hidden_file(stack.store, name, next(iter(done)))), framework="pt") as f:
                meta = json.loads(f.metadata()["consistency"])
            assert meta["top1"] >= 0.85 and meta["positions"] > 10 and meta["offset"] == 0
            continue
        assert not done and set(rejected.values()) == {"hs_inconsistent"}, (name, rejected)
        assert cons["inconsistent"] == 6 and cons["mean_top1"] < 0.8
        detail = stack.store.read_rejection(name, "hidden_states", next(iter(rejected))).detail
        assert ("shifted by 1" in detail) == (name == "shifted"), detail


def test_check_extraction_passes_the_right_server_and_fails_a_wrong_layer(stack_factory, tmp_path, tiny):  # noqa: ANN001
    """`eagle3q check-extraction` (the extraction server's first contact): one greedy sample from the generation
    server, through the extraction server, printed raw with the layer ids, shapes and the consistency figure; exit
    0 on the right server, 1 on one whose "final" state is layer L-1."""
    import subprocess
    import sys

    from eagle3q.dev.local import child_env, start_sim

    connector = tmp_path / "connector"
    stack = stack_factory(sim_args=["--target-model", str(tiny), "--hs-dir", str(connector)])
    proc, wrong = start_sim(str(tiny), tmp_path / "logs", extra=["--target-model", str(tiny), "--hs-dir",
                                                                str(connector), "--hs-layer-ids", "2,4,5,7"])
    stack.sims.append(proc)
    results = {}
    for name, url in (("right", stack.sim_urls[0]), ("wrong", wrong)):
        env = child_env({**stack.env, "EAGLE3Q_VLLM_BASE_URLS": stack.sim_urls[0], "EAGLE3Q_HS_VLLM_BASE_URL": url})
        results[name] = subprocess.run([sys.executable, "-m", "eagle3q.cli", "check-extraction"], env=env,
                                       capture_output=True, text=True, timeout=120)
    right, bad = results["right"], results["wrong"]
    assert right.returncode == 0, right.stdout + right.stderr
    assert "token_ids (" in right.stdout and "layer ids asked [2, 4, 5, 8]" in right.stdout
    assert "aux_hidden_states (" in right.stdout and '"offset": 0' in right.stdout
    assert "[FAIL]" not in right.stdout and "all checks passed" in right.stdout
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "[FAIL] the final state predicts the next token" in bad.stdout, bad.stdout
