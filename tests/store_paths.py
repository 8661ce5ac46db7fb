"""The files behind a local store's keys, for tests that hand them to a peer's reader, damage them or look at the
layout itself (the package goes through `eagle3q.store.Store` only; tests/unit/test_layout.py)."""

from __future__ import annotations

from pathlib import Path

from eagle3q.store import LocalBlobs, Store


def _local(store: Store) -> LocalBlobs:
    assert isinstance(store.blobs, LocalBlobs), f"{store.url} is not a local store"
    return store.blobs


def run_dir(store: Store, run: str) -> Path:
    return _local(store).path(run)


def train_dir(store: Store, run: str) -> Path:
    return _local(store).path(f"{run}/train")


def hidden_file(store: Store, run: str, sample_id: str) -> Path:
    return _local(store).path(store.hidden_key(run, sample_id))


def sample_file(store: Store, run: str, sample_id: str) -> Path:
    return _local(store).path(store.sample_key(run, sample_id))


def hidden_files(store: Store, run: str) -> list[Path]:
    return [hidden_file(store, run, sid) for sid in store.hidden_ids(run)]


def read_hidden(path: Path, restore: bool = True) -> tuple[dict, str]:
    """A hidden-state file's tensors and final-state side, as the store decodes an object."""
    from eagle3q.store.hidden_format import decode

    return decode(path.read_bytes(), restore)


def load_hidden(path: Path) -> dict:
    return read_hidden(path)[0]
