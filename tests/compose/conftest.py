"""The compose tier: the README's `docker compose` commands, run as written against images built on this machine.
Without a Docker engine (none installed, or not root to start one) every test here is skipped with the reason, which
pytest's summary prints (`make test` runs it with -rs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.compose.stack import (
    ARTIFACTS,
    CA_BUNDLE,
    Compose,
    Unavailable,
    base_image,
    build_images,
    docker_engine,
    torch_wheel,
)

PASSWORDS = {"REDIS_PASSWORD": "r3dis-test-pass", "FLOWER_PASSWORD": "fl0wer-test-pass", "FLOWER_USER": "admin"}


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The variables that point compose at images built here (docs/deployment.md, "Without a registry")."""
    try:
        docker_engine()
        base = base_image()
    except Unavailable as e:
        pytest.skip(f"compose tier skipped: {e}")
    env = {"PYTHON_IMAGE": base, "REDIS_IMAGE": base, "TORCH_INDEX_URL": torch_wheel(), "BUILD_CA_BUNDLE": CA_BUNDLE,
           **PASSWORDS}
    build_images(env, tmp_path_factory.mktemp("compose-build"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return env


def env_file(name: str) -> dict[str, str]:
    """deploy/env.cpu or deploy/.env.example as a dict, the way a user copies it to .env."""
    out = {}
    for line in (Path(__file__).resolve().parents[2] / "deploy" / name).read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v
    return out


@pytest.fixture
def compose(images: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., Compose]]:
    """compose(label, base_env_file, **overrides) -> a project; every project is taken down (volumes too) after."""
    made: list[Compose] = []

    def make(label: str, base: str = "env.cpu", **overrides: str) -> Compose:
        env = {**env_file(base), **images, **overrides}
        c = Compose.create(label, env, tmp_path)
        made.append(c)
        return c

    yield make
    for c in made:
        (ARTIFACTS / f"{c.name}.log").write_text(c.logs())
        c.down()
