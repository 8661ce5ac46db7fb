"""The vLLM hidden-state backend's checks on what the connector wrote, and its wait on the connector's lock."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from eagle3q.extraction.vllm_backend import ServerError, VllmExtractor, wait_for_lock


def test_connector_files_are_checked_before_use(tiny):  # noqa: ANN001
    ex = VllmExtractor("http://127.0.0.1:9/v1", "m", str(tiny), None)
    ids = [5, 6, 7, 8]
    good = {"token_ids": torch.tensor(ids), "hidden_states": torch.randn(4, 4, 64).bfloat16()}
    out = ex._check(ids, good)
    assert out.reason is None and out.aux.shape == (4, 3 * 64) and out.final.shape == (4, 64)
    torch.testing.assert_close(out.final, good["hidden_states"][:, 3].float())  # the last layer is the final state
    assert ex._check([5, 6, 7, 9], good).reason == "hs_prompt_mismatch"
    three = {"token_ids": torch.tensor(ids), "hidden_states": torch.randn(4, 3, 64)}  # final state not configured
    bad = ex._check(ids, three)
    assert bad.reason == "hs_length_mismatch" and "[2, 4, 5, 8]" in bad.detail
    ex.close()


def test_the_reader_waits_for_the_writers_lock(tmp_path):  # noqa: ANN001
    lock = tmp_path / "x.safetensors.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the connector is still writing
    with pytest.raises(ServerError, match="still holds"):
        wait_for_lock(str(lock), timeout_s=0.2)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    wait_for_lock(str(lock), timeout_s=1)
    assert not lock.exists()
    wait_for_lock(str(lock), timeout_s=1)  # no lock at all: nothing to wait for


def test_status_counts_the_connectors_backlog(tmp_path):  # noqa: ANN001
    from eagle3q.status import connector_backlog

    assert connector_backlog("") is None
    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "b.safetensors").write_bytes(b"x" * 5)
    (tmp_path / "b.safetensors.lock").write_bytes(b"")
    assert connector_backlog(str(tmp_path)) == {"dir": str(tmp_path), "files": 2, "bytes": 15}


def test_the_breaker_fails_fast_while_the_server_is_down(tiny):  # noqa: ANN001
    from eagle3q.extraction.vllm_backend import Breaker

    now = [0.0]
    b = Breaker(threshold=3, cooldown_s=10, clock=lambda: now[0])
    for _ in range(2):
        b.record(False)
        b.check()  # below the threshold: still calling
    b.record(False)
    with pytest.raises(ServerError, match="3 times in a row"):
        b.check()
    now[0] = 11.0
    b.check()  # the cooldown is over: one more try
    b.record(True)
    assert b.failures == 0 and b.opened_at is None
    ex = VllmExtractor("http://127.0.0.1:9/v1", "m", str(tiny), None)  # nothing listens there
    for _ in range(3):
        with pytest.raises(ServerError, match="unreachable"):
            ex.extract([[1, 2, 3]])
    with pytest.raises(ServerError, match="in a row"):  # now without a connection attempt
        ex.extract([[1, 2, 3]])
    ex.close()
