"""JSON only, validated payloads, and secrets that never reach logs or status output."""

from __future__ import annotations

import subprocess
import sys
import time

from eagle3q.celery.app import make_app
from eagle3q.config import Settings
from eagle3q.contract import HIDDEN_STATES, INFERENCE, TRAIN, InferenceTask
from eagle3q.dev.local import child_env
from eagle3q.dev.tiny import SAMPLE_DATASET

PASSWORD = "s3cr3t-redis-pw-7a1"
API_KEY = "sk-live-secret-key-9f3"


def _valid_payload(stack) -> dict:  # noqa: ANN001
    from eagle3q.producer import sampling_of, task_for
    from eagle3q.sources import Prompt, iter_prompts

    p = next(i for i in iter_prompts(SAMPLE_DATASET) if isinstance(i, Prompt))
    return task_for(p, "sec", "d", stack.settings, sampling_of(stack.settings)).model_dump()


TASK_GENERATE, TASK_EXTRACT, TASK_TRAIN = INFERENCE.task, HIDDEN_STATES.task, TRAIN.task


def test_app_is_json_only():
    app = make_app(Settings(), worker=True)
    assert app.conf.accept_content == ["json"] and app.conf.task_serializer == "json"
    assert app.conf.result_accept_content == ["json"]


def test_pickle_and_forged_messages_are_refused(stack_factory):  # noqa: ANN001
    stack = stack_factory()
    w = stack.worker("inference", concurrency=2)
    good = _valid_payload(stack)
    stack.app.send_task(TASK_GENERATE, args=[good], serializer="pickle")
    forged = [
        {**good, "run": "../../etc"},  # path traversal through the run name
        {**good, "sample_id": "not-hex"},
        {**good, "extra": "field"},  # unknown fields are refused, not ignored
        {**good, "messages": []},
        {**good, "sampling": {"temperature": 0.6, "top_p": 0.95, "max_tokens": -5}},
        {**good, "row": "7"},  # strict: no coercion of wrong types
        {**good, "thinking": "yes"},
        {**good, "turn": True},
        {**good, "sampling": {**good["sampling"], "max_tokens": "64"}},
        "just a string",
    ]
    for f in forged:
        stack.app.send_task(TASK_GENERATE, args=[f])
    stack.app.send_task(TASK_EXTRACT, args=[{"run": "sec", "sample_id": "../../x"}])
    stack.app.send_task(TASK_TRAIN, args=[{"run": "a b"}])
    deadline = time.monotonic() + 30
    while w.log.read_text().count("refused a") < 10 and time.monotonic() < deadline:
        time.sleep(0.2)
    log = w.log.read_text()
    assert "Refusing to deserialize untrusted content of type pickle" in log
    assert log.count("refused a InferenceTask message") == 10
    assert not stack.store.root.exists() or not any(stack.store.root.rglob("*.json"))
    assert not stack.broker.keys("e3q:sec:*") and not stack.broker.keys("e3q:../*")

    # Schema-valid but never registered by the producer: an invented id, an altered payload, a GPU-stage ref to a
    # sample that does not exist, a training task for a run that never fired. Refused, nothing counted or stored.
    invented = {**good, "sample_id": "f" * 32}
    stack.ledger.open_tasks("sec", {good["sample_id"]: InferenceTask.model_validate(good).model_dump_json()})
    altered = {**good, "sampling": {**good["sampling"], "max_tokens": 1_000_000}}
    hs = stack.worker("hidden_states")
    tr = stack.worker("train")
    for f in (invented, altered):
        stack.app.send_task(TASK_GENERATE, args=[f])
    stack.app.send_task(TASK_EXTRACT, args=[{"run": "forged", "sample_id": "e" * 32}])
    stack.app.send_task(TASK_TRAIN, args=[{"run": "forged"}])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (w.log.read_text().count("not registered") < 2
                                           or "refused forged/" not in hs.log.read_text()
                                           or "never triggered" not in tr.log.read_text()):
        time.sleep(0.2)
    assert w.log.read_text().count("not registered by the producer") == 2
    assert "refused forged/" in hs.log.read_text() and "never triggered" in tr.log.read_text()
    assert not stack.ledger.run_exists("forged") and not stack.broker.keys("e3q:forged:*")
    assert stack.ledger.enqueued_ids("sec") == set() and stack.ledger.counts("sec", "inference").done == 0
    assert not stack.store.root.exists() or not any(stack.store.root.rglob("*.json"))

    # the worker is fine and does real work afterwards
    stack.app.send_task(TASK_GENERATE, args=[good])
    deadline = time.monotonic() + 30
    while stack.ledger.counts("sec", "inference").done < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stack.ledger.counts("sec", "inference").done == 1 and w.alive()


def test_secrets_never_appear_in_logs_or_status(stack_factory):  # noqa: ANN001
    stack = stack_factory(password=PASSWORD, sim_args=["--faults", "5xx=0.4"],
                          env={"EAGLE3Q_VLLM_API_KEY": API_KEY})
    w = stack.worker("inference", concurrency=4, EAGLE3Q_METRICS_PORT="0")
    stack.enqueue(SAMPLE_DATASET, "secret", max_samples=10)
    stack.wait_settled("secret")
    outputs = [w.log.read_text()]
    for args in (["status", "--run", "secret"], ["status", "--run", "secret", "--json"]):
        r = subprocess.run([sys.executable, "-m", "eagle3q.cli", *args], env=child_env(stack.env),
                           capture_output=True, text=True, timeout=60, check=True)
        outputs += [r.stdout, r.stderr]
    assert stack.ledger.counts("secret", "inference").stats.get("retry_http_503", 0) > 0
    assert "503" in outputs[0]  # the logs did talk about the failures
    for text in outputs:
        assert PASSWORD not in text and API_KEY not in text
    assert PASSWORD not in repr(stack.settings) and API_KEY not in repr(stack.settings)
    assert "**" in outputs[0]  # Celery's banner shows the broker URL masked
