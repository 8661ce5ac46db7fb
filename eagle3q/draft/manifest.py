"""What a run trains on, frozen when its training starts: the sample files, their lengths, and the held-out split.

Hidden states may keep arriving after the trigger (a target below the run's size); a trainer that is killed and
resumed must continue the same schedule, so the list is written once (the store's `train/manifest.json`) and every later
trainer reads it back. The validation split is by prompt content (`eagle3q.prompt_keys.split_key`: the opening of the
conversation, normalized), from its hash: every turn of a conversation, every repeat of a prompt and every row that
opens alike fall on one side, so no held-out prompt is a training prompt. Stable across runs and machines. (Until
2026-12 the split hashed (data set, row), and a data set that repeats prompts put copies on both sides; a manifest
frozen then is read back as it is.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from eagle3q.store import Store
from eagle3q.store.run_store import MANIFEST as NAME


@dataclass(frozen=True)
class Entry:
    sample_id: str
    tokens: int
    split_key: str  # "prompt:<digest>" (or "<data set>:<row>" for files of samples no longer in the store)


@dataclass(frozen=True)
class Manifest:
    run: str
    train: tuple[Entry, ...]
    val: tuple[Entry, ...]
    val_fraction: float

    def to_json(self) -> bytes:
        def entries(es: tuple[Entry, ...]) -> list[list]:
            return [[e.sample_id, e.tokens, e.split_key] for e in es]

        return json.dumps({"run": self.run, "val_fraction": self.val_fraction, "train": entries(self.train),
                           "val": entries(self.val)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        m = json.loads(data)
        return cls(m["run"], tuple(Entry(*e) for e in m["train"]), tuple(Entry(*e) for e in m["val"]),
                   float(m["val_fraction"]))


def is_validation(split_key: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(split_key.encode()).digest()[:8], "big") / 2**64
    return h < fraction


def entry_for(store: Store, run: str, sample_id: str) -> Entry:
    """A sample's entry from its hidden-state object's header (one ranged read, not its states)."""
    from eagle3q.prompt_keys import split_key
    from eagle3q.store.hidden_format import token_count

    header = store.hidden_header(run, sample_id)
    tokens = token_count(header)
    if "split_key" in header.metadata:
        return Entry(sample_id, tokens, str(header.meta("split_key")))
    if store.has_sample(run, sample_id):  # objects written before the key was recorded: the sample's messages
        return Entry(sample_id, tokens, split_key(store.read_sample(run, sample_id).messages))
    return Entry(sample_id, tokens, f"{header.meta('dataset', '?')}:{header.meta('row', -1)}")


def entries_for(store: Store, run: str, ids: list[str]) -> list[Entry]:
    return list(store.map_samples(lambda sid: entry_for(store, run, sid), ids))


def split_report(m: Manifest) -> dict[str, int | str]:
    """For result.json and `eval-draft`: how many distinct prompts each side holds, and how many samples repeat a
    prompt (exact duplicates of the data set, or turns of one conversation), every one on a single side."""
    train, val = {e.split_key for e in m.train}, {e.split_key for e in m.val}
    return {"by": "prompt", "train_samples": len(m.train), "train_prompts": len(train), "val_samples": len(m.val),
            "val_prompts": len(val), "repeated_samples": len(m.train) + len(m.val) - len(train) - len(val),
            "prompts_on_both_sides": len(train & val)}


def load(store: Store, run: str) -> Manifest:
    """The manifest a trainer froze for the run (FileNotFoundError before the run was trained)."""
    try:
        return Manifest.from_json(store.get_artifact(run, NAME))
    except FileNotFoundError:
        raise FileNotFoundError(f"run {run} has no training manifest ({store.artifact_url(run, NAME)}): "
                                "train it first") from None


def load_or_create(store: Store, run: str, val_fraction: float) -> Manifest:
    """The run's manifest: read back if a trainer wrote it before, else built from the objects present now."""
    try:
        return Manifest.from_json(store.get_artifact(run, NAME))
    except FileNotFoundError:
        pass
    entries = entries_for(store, run, store.hidden_ids(run))
    val = tuple(e for e in entries if is_validation(e.split_key, val_fraction))
    train = tuple(e for e in entries if not is_validation(e.split_key, val_fraction))
    if not train and val:  # a handful of rows that all hashed to validation: train on them rather than nothing
        train, val = val, ()
    m = Manifest(run, train, val, val_fraction)
    store.put_artifact(run, NAME, m.to_json())
    return m
