"""Settings sources, the torch-free inference role, and the shared in-flight budget inside real workers."""

from __future__ import annotations

import subprocess
import sys

import httpx

from eagle3q.config import Settings
from eagle3q.dev.local import child_env
from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.generate.endpoints import parse_gauge


def test_toml_file_and_environment(tmp_path, monkeypatch):  # noqa: ANN001
    cfg = tmp_path / "eagle3q.toml"
    cfg.write_text('model = "Qwen/Qwen3-8B"\nprofile = "qwen3"\nvllm_base_urls = ["http://a:8000/v1", "http://b/v1"]\n'
                   'max_tokens = 1234\n')
    monkeypatch.setenv("EAGLE3Q_CONFIG", str(cfg))
    monkeypatch.setenv("EAGLE3Q_MAX_TOKENS", "999")  # the environment wins over the file
    monkeypatch.setenv("EAGLE3Q_AUX_LAYER_IDS", "2,30,58")
    monkeypatch.setenv("EAGLE3Q_REDIS_PASSWORD", "pw/with:odd@chars")
    s = Settings()
    assert (s.model, s.profile, s.max_tokens) == ("Qwen/Qwen3-8B", "qwen3", 999)
    assert s.vllm_base_urls == ["http://a:8000/v1", "http://b/v1"] and s.aux_layer_ids == [2, 30, 58]
    assert s.broker_url() == "redis://:pw%2Fwith%3Aodd%40chars@localhost:6379/0"
    assert "pw/with" not in repr(s) and "pw" not in s.redacted_url()
    monkeypatch.setenv("EAGLE3Q_VLLM_BASE_URLS", "http://x/v1, http://y/v1")
    assert Settings().vllm_base_urls == ["http://x/v1", "http://y/v1"]


def test_inference_role_never_imports_torch(tiny_tokenizer):  # noqa: ANN001
    code = (
        "import sys\n"
        "import workers, eagle3q.celery.tasks\n"
        "from eagle3q.config import Settings\n"
        "from eagle3q.stages.inference import build_context\n"
        f"ctx = build_context(Settings(tokenizer={str(tiny_tokenizer)!r}), lambda r, s: None, 4)\n"
        "assert ctx.tokenizer.encode('<think>hi</think>')\n"
        "heavy = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]\n"
        "print('heavy:', heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=child_env({}), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_fixed_inflight_budget_holds_across_workers(stack_factory):  # noqa: ANN001
    stack = stack_factory(sim_args=["--ttft", "0.3", "--max-num-seqs", "100"],
                          env={"EAGLE3Q_INFLIGHT_MODE": "fixed", "EAGLE3Q_INFLIGHT_LIMIT": "3"})
    stack.worker("inference", concurrency=8)
    stack.worker("inference", concurrency=8)
    stack.enqueue(SAMPLE_DATASET, "budget", max_samples=24)
    stack.wait_settled("budget")
    metrics = httpx.get(stack.sim_urls[0][:-3] + "/metrics").text
    assert parse_gauge(metrics, "eagle3q_sim_peak_running") == 3  # 16 threads, but 3 in flight at most, and used
    assert stack.ledger.counts("budget", "inference").done == 24


def test_adaptive_budget_follows_the_server(stack_factory):  # noqa: ANN001
    """32 threads against a server that runs 6 at a time: the shared limit comes down to what vLLM runs (its
    queue stays short) while the server stays saturated."""
    from eagle3q.control.inflight import InflightLimiter

    stack = stack_factory(sim_args=["--ttft", "0.4", "--max-num-seqs", "6"],
                          env={"EAGLE3Q_INFLIGHT_MODE": "adaptive", "EAGLE3Q_INFLIGHT_LIMIT": "32",
                               "EAGLE3Q_INFLIGHT_MIN": "2", "EAGLE3Q_INFLIGHT_PERIOD_S": "0.2"})
    stack.worker("inference", concurrency=16)
    stack.worker("inference", concurrency=16)
    stack.enqueue(SAMPLE_DATASET, "adapt", max_samples=120)
    stack.wait_settled("adapt", timeout_s=180)
    limit = InflightLimiter.from_settings(stack.ledger, stack.settings).limit()
    metrics = httpx.get(stack.sim_urls[0][:-3] + "/metrics").text
    assert 5 <= limit <= 12, limit  # down from 32 to about the server's 6 slots, not collapsed to the minimum
    assert parse_gauge(metrics, "eagle3q_sim_peak_running") == 6  # and the server was kept full
    assert stack.ledger.counts("adapt", "inference").done == 120
