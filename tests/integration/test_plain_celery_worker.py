"""`celery -A workers worker ...`, started as a user would type it, behaves as `eagle3q worker <role>`: the same
prefetch (from the app's config), pool, concurrency, events, services, and it does the work."""

from __future__ import annotations

import sys
import time

from eagle3q.dev.local import spawn, wait_worker_ready
from eagle3q.dev.tiny import SAMPLE_DATASET


def _stats(stack, name: str) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reply = stack.app.control.inspect([name], timeout=2).stats() or {}
        if name in reply:
            return reply[name]
    raise AssertionError(f"no stats from {name}")


def _conf(stack, name: str) -> dict:  # noqa: ANN001
    return (stack.app.control.inspect([name], timeout=2).conf() or {})[name]


def test_plain_celery_command_equals_eagle3q_worker(stack_factory):  # noqa: ANN001
    stack = stack_factory()
    cmd = [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", "inference", "-P", "threads", "-c", "8",
           "-n", "plain@%h", "-l", "INFO"]
    plain = spawn("plain-inference", cmd, stack.env, stack.tmp / "logs")
    stack.workers.append(plain)
    wait_worker_ready(plain)
    ours = stack.worker("inference", concurrency=8)
    host = ours.name
    a, b = _stats(stack, f"plain@{_hostname()}"), _stats(stack, f"{host}@{_hostname()}")
    assert a["prefetch_count"] == b["prefetch_count"] == 8 * stack.settings.prefetch_multiplier == 16
    assert a["pool"]["max-concurrency"] == b["pool"]["max-concurrency"] == 8
    assert a["pool"]["implementation"] == b["pool"]["implementation"]
    ca, cb = _conf(stack, f"plain@{_hostname()}"), _conf(stack, f"{host}@{_hostname()}")
    assert ca["worker_send_task_events"] is cb["worker_send_task_events"] is True  # Flower sees both (-E)
    log = plain.log.read_text()
    assert "lost-message sweep every" in log and "held messages refreshed every" in log  # the services run

    ours.kill()  # only the plain worker consumes now
    stack.enqueue(SAMPLE_DATASET, "plain", max_samples=12)
    stack.wait_settled("plain")
    assert stack.ledger.counts("plain", "inference").done == 12


def test_plain_gpu_role_reserves_one_message(stack_factory):  # noqa: ANN001
    stack = stack_factory()
    gpu = spawn("plain-hs", [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", "hidden_states",
                             "-P", "solo", "-n", "plainhs@%h", "-l", "INFO"], stack.env, stack.tmp / "logs")
    stack.workers.append(gpu)
    wait_worker_ready(gpu)
    assert _stats(stack, f"plainhs@{_hostname()}")["prefetch_count"] == 1


def _hostname() -> str:
    import socket

    return socket.gethostname()
