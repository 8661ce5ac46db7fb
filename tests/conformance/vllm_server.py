"""Starting vLLM 0.33.0's own OpenAI server (its venv `.venv-vllm`) with the engine core swapped for the test double
(`engine_double.py`), through `vllm serve`'s own argument parsing, on a free port."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from eagle3q.dev.local import free_port
from eagle3q.dev.tiny import build_served_model
from eagle3q.dev.vllm_engine import stop_group, wait_healthy

ROOT = Path(__file__).parents[2]
VLLM_VENV = Path(os.environ.get("EAGLE3Q_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SERVE = Path(__file__).parent / "serve.py"
MODEL = "moonshotai/Kimi-K2.5"
MAX_MODEL_LEN = 1024


@dataclass
class VLLMServer:
    """One `vllm serve` process (real frontend, engine double) on a free port."""

    template: str
    parser: str
    url: str  # .../v1
    model_dir: Path
    proc: subprocess.Popen
    log: Path

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        stop_group(self.proc, grace_s=20)


def start_vllm(tiny: Path, workdir: Path, template: str, parser: str, extra: list[str] | None = None,
               env: dict[str, str] | None = None, extra_eos: tuple[str, ...] = ()) -> VLLMServer:
    name = "-".join((template, *(t.strip("<|>") for t in extra_eos)))
    model_dir = build_served_model(tiny, workdir / f"model-{name}", template, extra_eos)
    port = free_port()
    log = workdir / f"vllm-{template}-{parser}-{port}.log"
    args = [str(VLLM_PYTHON), str(SERVE), str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL, "--reasoning-parser", parser, "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "16", "--disable-uvicorn-access-log", *(extra or [])]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("EAGLE3Q_", "VIRTUAL_ENV"))}
    child_env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                      "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                      **(env or {})})
    with log.open("ab") as f:
        proc = subprocess.Popen(args, env=child_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=workdir)
    server = VLLMServer(template, parser, f"http://127.0.0.1:{port}/v1", model_dir, proc, log)
    wait_healthy(proc, server.root, log, 180)
    return server
