"""Flower, started the way compose starts it (`celery -A workers flower`), lists every queue of the pipeline with
its message count while only inference workers run."""

from __future__ import annotations

import sys
import time

import httpx

from eagle3q.contract import QUEUES, send_extract, send_train
from eagle3q.dev.local import free_port, spawn, wait_until


def test_flower_lists_queues_no_worker_consumes(stack_factory):  # noqa: ANN001
    stack = stack_factory()
    stack.worker("inference", concurrency=2)
    for i in range(3):  # waiting for a hidden-state worker that is not running
        send_extract(stack.app, "fl", f"{i:032x}")
    send_train(stack.app, "fl")
    port = free_port()
    flower = spawn("flower", [sys.executable, "-m", "celery", "-A", "workers", "flower", f"--port={port}",
                              "--address=127.0.0.1"],
                   {**stack.env, "FLOWER_BASIC_AUTH": "admin:pw-flower"}, stack.tmp / "logs")
    try:
        url, auth = f"http://127.0.0.1:{port}", ("admin", "pw-flower")
        wait_until(lambda: httpx.get(f"{url}/healthcheck", timeout=2).status_code == 200, 60, "flower")
        assert httpx.get(f"{url}/api/workers", timeout=10).status_code == 401  # the password is required

        def queues() -> dict[str, int]:
            body = httpx.get(f"{url}/api/queues/length", auth=auth, timeout=10).json()
            return {q["name"]: q["messages"] for q in body["active_queues"]}

        # Flower has seen the inference worker (so it no longer falls back to the declared queues by itself) ...
        wait_until(lambda: any(w.startswith("inference") for w in
                               httpx.get(f"{url}/api/workers", auth=auth, timeout=10).json()), 60, "worker in flower")
        time.sleep(1)
        got = queues()
        # ... and still lists every queue, with what each holds
        assert set(QUEUES) <= set(got), got
        assert got["hidden_states"] == 3 and got["train"] == 1
        page = httpx.get(f"{url}/broker", auth=auth, timeout=10).text
        assert all(q in page for q in QUEUES)
    finally:
        flower.kill()
