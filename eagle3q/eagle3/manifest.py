"""What a run trains on, frozen when its training starts: the sample files, their lengths, and the held-out split.

Hidden states may keep arriving after the trigger (a target below the run's size); a trainer that is killed and
resumed must continue the same schedule, so the list is written once (`<train dir>/manifest.json`) and every later
trainer reads it back. The validation split is by data-set row (all turns of a conversation on the same side), from
a hash of (data set, row): stable across runs and machines, and never trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from eagle3q.store import Store, write_atomic

NAME = "manifest.json"


@dataclass(frozen=True)
class Entry:
    sample_id: str
    tokens: int
    row_key: str  # "<data set>:<row>"


@dataclass(frozen=True)
class Manifest:
    run: str
    train: tuple[Entry, ...]
    val: tuple[Entry, ...]
    val_fraction: float

    def to_json(self) -> bytes:
        def entries(es: tuple[Entry, ...]) -> list[list]:
            return [[e.sample_id, e.tokens, e.row_key] for e in es]

        return json.dumps({"run": self.run, "val_fraction": self.val_fraction, "train": entries(self.train),
                           "val": entries(self.val)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        m = json.loads(data)
        return cls(m["run"], tuple(Entry(*e) for e in m["train"]), tuple(Entry(*e) for e in m["val"]),
                   float(m["val_fraction"]))


def is_validation(row_key: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(row_key.encode()).digest()[:8], "big") / 2**64
    return h < fraction


def _entry(store: Store, run: str, path: Path) -> Entry:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tokens = int(f.get_slice("input_ids").get_shape()[0])
    if "row" in meta and "dataset" in meta:
        key = f"{json.loads(meta['dataset'])}:{json.loads(meta['row'])}"
    else:  # files written before the row was recorded: the sample says
        sample = store.read_sample(run, path.stem)
        key = f"{sample.dataset}:{sample.row}"
    return Entry(path.stem, tokens, key)


def load(store: Store, run: str) -> Manifest:
    """The manifest a trainer froze for the run (FileNotFoundError before the run was trained)."""
    path = store.train_dir(run) / NAME
    if not path.is_file():
        raise FileNotFoundError(f"run {run} has no training manifest ({path}): train it first")
    return Manifest.from_json(path.read_bytes())


def load_or_create(store: Store, run: str, val_fraction: float) -> Manifest:
    """The run's manifest: read back if a trainer wrote it before, else built from the files present now."""
    path = store.train_dir(run) / NAME
    if path.is_file():
        return Manifest.from_json(path.read_bytes())
    entries = [_entry(store, run, p) for p in store.hidden_files(run)]
    val = tuple(e for e in entries if is_validation(e.row_key, val_fraction))
    train = tuple(e for e in entries if not is_validation(e.row_key, val_fraction))
    if not train and val:  # a handful of rows that all hashed to validation: train on them rather than nothing
        train, val = val, ()
    m = Manifest(run, train, val, val_fraction)
    write_atomic(path, m.to_json())
    return m
