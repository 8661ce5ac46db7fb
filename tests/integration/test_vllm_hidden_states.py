"""The hidden-state stage through the serving engine (`EAGLE3Q_HS_BACKEND=vllm`): the simulator plays a vLLM with
extract_hidden_states and the ExampleHiddenStatesConnector, the workers read its files; the result equals the
transformers backend's, and the connector's directory is left empty."""

from __future__ import annotations

import torch

from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.eagle3.extract import TransformersExtractor, load_hidden


def test_pipeline_with_the_vllm_hidden_state_backend(stack_factory, tmp_path, tiny):  # noqa: ANN001
    connector = tmp_path / "connector"
    stack = stack_factory(sim_args=["--target-model", str(tiny), "--hs-dir", str(connector)],
                          env={"EAGLE3Q_HS_BACKEND": "vllm", "EAGLE3Q_TRAIN_TARGET": "1000"})
    stack.env["EAGLE3Q_HS_VLLM_BASE_URL"] = stack.sim_urls[0]
    stack.worker("inference", concurrency=4)
    stack.worker("hidden_states", EAGLE3Q_HS_VLLM_BASE_URL=stack.sim_urls[0])
    stack.enqueue(SAMPLE_DATASET, "hsv", max_samples=8)
    stack.wait_settled("hsv", stages=("inference", "hidden_states"), timeout_s=120)
    done = stack.ledger.done_ids("hsv", "hidden_states")
    assert len(done) == 8 and not stack.ledger.rejected("hsv", "hidden_states")
    ref = TransformersExtractor(str(tiny), None, "cpu", "float32")
    for sid in done:
        sample = stack.store.read_sample("hsv", sid)
        ours = load_hidden(stack.store.hidden_path("hsv", sid))
        want = ref.extract([sample.input_ids])[0]
        assert torch.equal(ours["input_ids"], torch.tensor(sample.input_ids))
        torch.testing.assert_close(ours["aux_hidden_states"].float(), want.aux, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(ours["hidden_state"].float(), want.final, atol=3e-2, rtol=3e-2)
    from safetensors import safe_open

    with safe_open(str(stack.store.hidden_path("hsv", next(iter(done)))), framework="pt") as f:
        meta = f.metadata()
    assert meta["backend"] == '"vllm"' and meta["final_state"] == '"pre_norm"'
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
    assert len(list(stack.store.run_dir("hskill").glob("hidden/*/*.safetensors"))) == 40
    # A request the killed worker had in flight may leave its connector file behind (status counts it); no more.
    assert len(list(connector.glob("*.safetensors"))) <= 8
