"""Hidden-state files across the ExampleHiddenStatesConnector protocol with vLLM 0.33's own code on one side: a file
written by the connector's own writer (lock held from before the response, released after `save_file`) read by
eagle3q's reader, and the simulator's connector file read by vLLM's own `load_hidden_states` (issue 15)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3q.extraction.vllm_backend import wait_for_lock
from eagle3q.sim.hidden_states import ConnectorWriter
from tests.conformance.vllm_server import VLLM_PYTHON

SCRIPT = Path(__file__).with_name("connector_files.py")
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}


def test_our_reader_waits_for_vllms_writer_and_reads_its_file(tmp_path: Path) -> None:
    t, n, h, delay = 12, 4, 64, 1.5
    path = tmp_path / "connector" / "req-1.safetensors"
    writer = subprocess.Popen([str(VLLM_PYTHON), str(SCRIPT), "write", str(path), str(t), str(n), str(h),
                               str(delay)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line.strip() == "locked", (line, writer.stderr.read() if writer.stderr else "")
        # The response has left vLLM now; the file is being written. The reader must wait for the lock.
        t0 = time.monotonic()
        wait_for_lock(f"{path}.lock", timeout_s=60)
        waited = time.monotonic() - t0
        data = load_file(str(path))
    finally:
        assert writer.wait(timeout=60) == 0, writer.stderr.read() if writer.stderr else ""
    assert waited >= delay * 0.5  # it did not read ahead of the writer
    assert not Path(f"{path}.lock").exists()  # removed by the reader, as vLLM's cleanup_hidden_states does
    hs = (torch.arange(t * n * h, dtype=torch.float32).reshape(t, n, h) / 97.0).to(torch.bfloat16)
    assert torch.equal(data["hidden_states"], hs)
    assert data["token_ids"].tolist() == list(range(3, 3 + t))


def test_vllms_reader_reads_the_simulators_connector_file(tiny: Path, tmp_path: Path) -> None:
    writer = ConnectorWriter(str(tiny), str(tmp_path / "connector"), None)
    ids = list(range(5, 25))
    path = writer.write(ids)
    r = subprocess.run([str(VLLM_PYTHON), str(SCRIPT), "read", path], capture_output=True, text=True, timeout=120,
                       env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    n_layers = len(writer.layer_ids)
    assert seen["hidden_states"] == {"shape": [len(ids), n_layers, writer.extractor.hidden_size],
                                     "dtype": "torch.bfloat16"}
    assert seen["token_ids"] == {"shape": [len(ids)], "dtype": "torch.int64"}
    assert not Path(path).exists() and not Path(f"{path}.lock").exists()  # vLLM's cleanup removed both
