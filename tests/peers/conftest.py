"""The peers' own code, installed by `make test` (`make peers`: speculators 0.9.0, SpecForge 0.2.0 and
hs-connectors 0.9.0 with --no-deps, plus the two small packages their code paths import). A missing peer stops the
run with the command that installs it, rather than skipping: these tests are the point."""

from __future__ import annotations

import importlib.util

import pytest

PEERS = ("speculators", "specforge", "hs_connectors", "openai", "loguru")


def pytest_configure(config: pytest.Config) -> None:
    missing = [m for m in PEERS if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(f"tests/peers needs {missing}: install them with `make peers`")
