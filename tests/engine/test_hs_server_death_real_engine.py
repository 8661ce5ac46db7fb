"""An extraction server that dies after answering: vLLM's stock `ExampleHiddenStatesConnector` on a CPU engine
answers the request (the lock file is pre-created, the path returned), then kills the engine when it copies the
states (`pin_memory=True` needs CUDA). The client finds the lock free and no file: a server failure for the breaker,
retried as one by the task, then the sample is rejected by name; every prompt stays accounted for."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from eagle3q.dev.local import LocalStack
from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.dev.vllm_engine import Engine, extraction_args, start_engine
from eagle3q.extraction.transformers_backend import default_aux_ids
from eagle3q.extraction.vllm_backend import ServerError, VllmExtractor
from tests.engine.conftest import MODEL


@pytest.fixture(scope="module")
def dying(tiny: Path, tmp_path_factory: pytest.TempPathFactory, engines: list[Engine]) -> tuple[Engine, Path]:
    tmp = tmp_path_factory.mktemp("engine-dying")
    args = extraction_args([*default_aux_ids(8), 8], tmp / "connector")
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    del kv["kv_connector_module_path"]
    kv["kv_connector"] = "ExampleHiddenStatesConnector"  # vLLM's own, CUDA-only copy
    args[args.index("--kv-transfer-config") + 1] = json.dumps(kv)
    e = start_engine(tiny, tmp / "srv", MODEL, args)
    engines.append(e)
    return e, tmp / "connector"


def test_answered_then_died_is_a_server_failure(dying: tuple[Engine, Path], tiny: Path) -> None:
    engine, _ = dying
    ex = VllmExtractor(engine.url, MODEL, str(tiny), None, concurrency=1, timeout_s=60)
    try:
        with pytest.raises(ServerError, match="never written.*died after answering"):
            ex.extract([list(range(5, 40))])
        assert ex.breaker.failures == 1
        deadline = time.monotonic() + 30
        while engine.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not engine.alive()  # the engine really is gone, not just slow
        with pytest.raises(ServerError, match="unreachable"):
            ex.extract([list(range(5, 40))])
        assert ex.breaker.failures == 2
    finally:
        ex.close()


def test_samples_behind_a_dead_extraction_server_are_rejected_by_name(
        dying: tuple[Engine, Path], stack_factory: Callable[..., LocalStack], assert_accounted: Callable) -> None:
    engine, connector = dying
    assert not engine.alive()  # killed by the test above
    stack = stack_factory(env={"EAGLE3Q_HS_BACKEND": "vllm", "EAGLE3Q_HS_VLLM_BASE_URL": engine.url,
                               "EAGLE3Q_HS_CONNECTOR_DIR": str(connector), "EAGLE3Q_MAX_RETRIES": "2",
                               "EAGLE3Q_TRAIN_TARGET": "1000"})
    stack.worker("inference", concurrency=4)
    hs = stack.worker("hidden_states", concurrency=1)
    stack.enqueue(SAMPLE_DATASET, "dead", max_samples=4)
    stack.wait_settled("dead", stages=("inference", "hidden_states"), timeout_s=180)
    accepted, _ = assert_accounted(stack, "dead")
    rejected = stack.ledger.rejected("dead", "hidden_states")
    assert len(rejected) == len(accepted) == 4
    assert set(rejected.values()) == {"retries_exhausted_hs_server"}, rejected
    assert stack.ledger.stat("dead", "hidden_states", "retry_hs_server") >= 4 * 2
    log = hs.log.read_text()
    assert "unreachable" in log and "unexpected error" not in log  # not retried as a bug
