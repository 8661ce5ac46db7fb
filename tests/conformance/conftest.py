"""The conformance tier: vLLM 0.33.0's own OpenAI server (its venv `.venv-vllm`, built by `make vllm-venv`, which
`make test` runs) with only the engine core swapped for the test double in `engine_double.py`. A missing venv stops
the run with the command that builds it, rather than skipping: these tests are the authority on the wire. The servers
live as long as this package's tests (about 650 MB each)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conformance.vllm_server import VLLM_PYTHON, VLLM_VENV, VLLMServer, start_vllm


def pytest_configure(config: pytest.Config) -> None:
    if not VLLM_PYTHON.exists():
        raise pytest.UsageError(f"tests/conformance needs vLLM's venv at {VLLM_VENV}: build it with `make vllm-venv`")


@pytest.fixture(scope="package")
def vllm_factory(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., VLLMServer]]:
    """vllm_factory(template, parser, *flags) -> a server, shared by every test asking for the same one."""
    workdir = tmp_path_factory.mktemp("vllm")
    servers: dict[tuple, VLLMServer] = {}

    def get(template: str = "kimi_k2", parser: str = "kimi_k2", *extra: str) -> VLLMServer:
        key = (template, parser, extra)
        if key not in servers or servers[key].proc.poll() is not None:
            servers[key] = start_vllm(tiny, workdir, template, parser, list(extra))
        return servers[key]

    yield get
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="package")
def kimi(vllm_factory: Callable[..., VLLMServer]) -> VLLMServer:
    """Kimi-K2.5's template and vLLM's kimi_k2 reasoning parser (the reference deployment)."""
    return vllm_factory("kimi_k2", "kimi_k2")
