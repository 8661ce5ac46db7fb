"""Fixtures shared by every test: the tiny target (built locally), a real redis-server, the local stack (real
redis-server, simulator and Celery worker processes), and the checks that every prompt is accounted for."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from eagle3q.control.ledger import Ledger
from eagle3q.dev.local import LocalStack, RedisServer
from eagle3q.dev.tiny import SAMPLE_DATASET, build_model, build_tokenizer
from eagle3q.store import Store


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer + tiny random Llama, built locally once per session."""
    return build_model(tmp_path_factory.mktemp("tiny"))


def _hidden_store(tiny: Path, root: Path, hs_dtype: str) -> Store:
    from eagle3q.extraction.transformers_backend import TransformersExtractor, to_safetensors

    store = Store(root)
    ex = TransformersExtractor(str(tiny), None, "cpu", "float32")
    for i in range(5):
        ids = list(range(3 + i, 23 + 3 * i))
        store.write_hidden("r", f"{i:032x}", to_safetensors(
            ids, [0] * 6 + [1] * (len(ids) - 6), ex.extract([ids])[0],
            {"aux_layer_ids": ex.aux_ids, "final_state": ex.final_state, "dataset": "d", "row": i}, hs_dtype))
    return store


@pytest.fixture(scope="session")
def hidden_run(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A store whose run "r" has 5 samples' hidden-state files, extracted by the real extractor from the tiny
    target (generated tokens from position 6 on)."""
    return _hidden_store(tiny, tmp_path_factory.mktemp("hidden_run"), "bf16")


@pytest.fixture(scope="session")
def hidden_run_fp8(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Store:
    """The same 5 samples stored in fp8 (EAGLE3Q_HS_DTYPE=fp8)."""
    return _hidden_store(tiny, tmp_path_factory.mktemp("hidden_run_fp8"), "fp8")


@pytest.fixture
def dataset() -> Path:
    return SAMPLE_DATASET


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of this test's own, on a free port."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def ledger(redis_server: RedisServer) -> Ledger:
    return Ledger.from_url(redis_server.url)


@pytest.fixture
def stack_factory(tmp_path: Path, tiny: Path) -> Iterator[Callable[..., LocalStack]]:
    stacks: list[LocalStack] = []

    def make(**kw) -> LocalStack:  # noqa: ANN003
        s = LocalStack(tmp_path / f"stack{len(stacks)}", tiny, **kw)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.close()


def _write_jsonl(path: Path, rows: list) -> Path:
    with path.open("w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path


@pytest.fixture
def write_jsonl() -> Callable[[Path, list], Path]:
    """write_jsonl(path, rows): rows as JSON lines (strings are written as they are: bad rows on purpose)."""
    return _write_jsonl


def _assert_accounted(stack: LocalStack, run: str) -> tuple[set[str], dict[str, str]]:
    """Every enqueued id is in exactly one place, and the files agree with the ledger."""
    L = stack.ledger
    enqueued = L.enqueued_ids(run)
    done = L.done_ids(run, "inference")
    rejected = L.rejected(run, "inference")
    assert not done & set(rejected)
    assert done | set(rejected) == enqueued
    assert set(stack.store.sample_ids(run)) == done
    assert set(stack.store.rejection_ids(run, "inference")) == set(rejected)
    c = L.counts(run, "inference")
    assert c.incoming == c.done + c.rejected == len(enqueued)
    assert sum(c.reasons.values()) == c.rejected
    return done, rejected


@pytest.fixture
def assert_accounted() -> Callable[[LocalStack, str], tuple[set[str], dict[str, str]]]:
    """assert_accounted(stack, run) -> (accepted ids, rejected id -> reason), after checking nothing is lost."""
    return _assert_accounted
