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
    assert not stack.store.blobs.root.exists() or not any(stack.store.blobs.root.rglob("*.json"))
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
    assert not stack.store.blobs.root.exists() or not any(stack.store.blobs.root.rglob("*.json"))

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


SIGNING_KEY = "hmac-key-for-tests-5c2"


def _scan_redis(stack, secrets: tuple[str, ...]) -> int:  # noqa: ANN001
    """Every value of every key, by type; returns how many keys were read."""
    import redis

    r = redis.Redis.from_url(stack.settings.broker_url())
    n = 0
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        parts: list[bytes] = [key]
        if kind == "string":
            parts.append(r.get(key) or b"")
        elif kind == "list":
            parts += r.lrange(key, 0, -1)
        elif kind == "hash":
            for k, v in r.hgetall(key).items():
                parts += [k, v]
        elif kind == "set":
            parts += list(r.smembers(key))
        elif kind == "zset":
            parts += [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
        blob = b"\n".join(parts)
        for secret in secrets:
            assert secret.encode() not in blob, (key, kind)
        n += 1
    return n


def _descendants(pids: list[int]) -> set[int]:
    from pathlib import Path

    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, todo = set(pids), list(pids)
    while todo:
        p = todo.pop()
        for child, par in parent.items():
            if par == p and child not in found:
                found.add(child)
                todo.append(child)
    return found


def test_no_secret_in_redis_values_or_command_lines(stack_factory):  # noqa: ANN001
    from pathlib import Path

    secrets = (PASSWORD, API_KEY, SIGNING_KEY)
    stack = stack_factory(password=PASSWORD, env={"EAGLE3Q_VLLM_API_KEY": API_KEY,
                                                  "EAGLE3Q_TASK_SIGNING_KEY": SIGNING_KEY})
    stack.worker("inference", concurrency=4)
    stack.worker("hidden_states")
    stack.worker("train")
    stack.enqueue(SAMPLE_DATASET, "scan", max_samples=6)
    stack.wait_settled("scan", stages=("inference", "hidden_states"), timeout_s=120)
    deadline = time.monotonic() + 120
    while stack.ledger.train_progress("scan").get("state") != "done" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stack.ledger.train_progress("scan").get("state") == "done"
    assert _scan_redis(stack, secrets) > 10  # meta, counts, open/done sets, queues, kombu's bindings...
    procs = [p.proc.pid for p in [*stack.workers, *stack.sims]] + [stack.redis.proc.pid]
    pids = _descendants(procs)
    assert len(pids) >= len(procs)
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        for secret in secrets:
            assert secret.encode() not in cmdline, cmdline
    for path in stack.store.blobs.root.rglob("*"):
        if path.is_file() and path.suffix == ".json":
            text = path.read_text(errors="replace")
            assert not any(secret in text for secret in secrets), path


def test_signed_deployment_refuses_unsigned_and_badly_signed_tasks(stack_factory):  # noqa: ANN001
    from eagle3q.dev.local import settings_from_env

    stack = stack_factory(env={"EAGLE3Q_TASK_SIGNING_KEY": SIGNING_KEY, "EAGLE3Q_RECONCILE_PERIOD_S": "0"})
    w = stack.worker("inference", concurrency=2)
    stack.worker("hidden_states")
    # The deployment's own producer signs; its tasks run through both stages (the hand-off is signed too).
    stack.enqueue(SAMPLE_DATASET, "signed", max_samples=3, train_target=100)
    stack.wait_settled("signed", stages=("inference", "hidden_states"), timeout_s=120)
    assert stack.ledger.counts("signed", "hidden_states").done == 3
    # Another client of the same broker: registered payloads (it can write the ledger), but no key or a wrong one.
    from pydantic import SecretStr

    from eagle3q.producer import enqueue

    plain = settings_from_env({k: v for k, v in stack.env.items() if k != "EAGLE3Q_TASK_SIGNING_KEY"})
    for run, key in (("unsigned", None), ("wrongkey", SecretStr("not-the-key"))):
        s = plain.model_copy(update={"task_signing_key": key})
        enqueue(make_app(s), stack.ledger, s, SAMPLE_DATASET, run, max_samples=2)
    deadline = time.monotonic() + 30
    while w.log.read_text().count("refused a InferenceTask message: ") < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    log = w.log.read_text()
    assert log.count("refused a InferenceTask message: unsigned") == 2
    assert log.count("refused a InferenceTask message: bad signature") == 2
    for run in ("unsigned", "wrongkey"):
        c = stack.ledger.counts(run, "inference")
        assert c.done == c.rejected == 0 and c.pending == 2  # still queued in the counts: nothing ran
        assert not (stack.store.blobs.root / run).exists()


def test_generation_settings_over_the_workers_limit_are_rejected_by_name(stack_factory, assert_accounted):  # noqa: ANN001
    stack = stack_factory()
    stack.worker("inference", concurrency=2, EAGLE3Q_MAX_TOKENS_LIMIT="1000")  # the producer asks for 4096
    stack.enqueue(SAMPLE_DATASET, "cap", max_samples=3)
    stack.wait_settled("cap")
    done, rejected = assert_accounted(stack, "cap")
    assert not done and set(rejected.values()) == {"over_limit"}
    import httpx

    from eagle3q.generate.endpoints import parse_gauge

    metrics = httpx.get(stack.sim_urls[0][:-3] + "/metrics", timeout=5).text
    assert parse_gauge(metrics, "vllm:request_success_total") == 0  # never sent to the server
