from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3q.tiny import SAMPLE_DATASET, build_model, build_tokenizer
from tests.helpers import Stack


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer + tiny random Llama, built locally once per session."""
    return build_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def dataset() -> Path:
    return SAMPLE_DATASET


@pytest.fixture
def stack_factory(tmp_path: Path, tiny: Path):
    stacks: list[Stack] = []

    def make(**kw) -> Stack:  # noqa: ANN003
        s = Stack(tmp_path / f"stack{len(stacks)}", tiny, **kw)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.close()


def write_jsonl(path: Path, rows: list) -> Path:
    with path.open("w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path
