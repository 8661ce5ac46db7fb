"""The store: every artifact of a run, typed, on a local directory or an S3 bucket (`EAGLE3Q_STORE_URL`). Nothing
else in the package opens a run's files (tests/unit/test_layout.py keeps it so).

Layout under the store's root, `<run>/`:
    samples/<id[:2]>/<id>.json             accepted generations (Sample)
    rejected/<stage>/<id[:2]>/<id>.json    rejections with reason and the raw response (Rejection)
    hidden/<id[:2]>/<id>.safetensors       hidden states (eagle3q.store.hidden_format)
    train/                                 the run's artifacts (ARTIFACTS): manifest, vocabulary, checkpoint, result,
                                           curves, TensorBoard events, the evaluation and the export vLLM loads
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import eagle3q.store.hidden_format as hidden_format
from eagle3q.store.blobs import Blobs, LocalBlobs, S3Options, open_blobs, write_atomic
from eagle3q.store.read_ahead import read_ahead
from eagle3q.store.records import Rejection, Sample
from eagle3q.store.safetensors_format import HEADER_GUESS, Header, NotSafetensors, array, header_length, parse_header

T = TypeVar("T")

# The run's artifacts under train/, by name (ARCHITECTURE.md's table lists who writes and reads each).
MANIFEST = "manifest.json"
VOCAB = "vocab.safetensors"
CHECKPOINT = "checkpoint.safetensors"
RESULT = "result.json"
CURVES = "curves.png"
DDP_RESULT = "ddp-result.json"
TENSORBOARD = "tensorboard"
EVAL = "eval"
EXPORT = "export"
EXPORT_FILES = ("config.json", "model.safetensors")
# Parallel requests for the readers that touch every sample (vocabulary, manifest, bigram table): on S3 each object
# is a round trip, so they are overlapped.
READ_THREADS = 16


class Store:
    def __init__(self, where: Blobs | Path | str, s3: S3Options | None = None):
        self.blobs: Blobs = open_blobs(str(where), s3) if isinstance(where, Path | str) else where

    @classmethod
    def from_settings(cls, s) -> Store:  # noqa: ANN001 - an eagle3q.config.Settings
        return cls(s.store_location(), S3Options(endpoint=s.s3_endpoint, region=s.s3_region,
                                                 timeout_s=s.store_timeout_s, retries=s.store_retries))

    @property
    def url(self) -> str:
        return self.blobs.url

    @property
    def is_local(self) -> bool:
        return self.blobs.is_local

    def check(self, write: bool = True) -> None:
        """StoreError with the cause where the store cannot be used: a worker refuses to start on it."""
        self.blobs.check(write)

    def free_bytes(self) -> int | None:
        """Free space where the store is a directory (or would be created: its nearest existing parent); None for
        an object store (no fixed capacity)."""
        if not isinstance(self.blobs, LocalBlobs):
            return None
        import shutil

        path = self.blobs.root.resolve()
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            return shutil.disk_usage(path).free
        except OSError:  # not mounted here
            return None

    # --- keys ---
    @staticmethod
    def _shard(run: str, kind: str, sample_id: str, suffix: str) -> str:
        return f"{run}/{kind}/{sample_id[:2]}/{sample_id}{suffix}"

    def sample_key(self, run: str, sample_id: str) -> str:
        return self._shard(run, "samples", sample_id, ".json")

    def rejection_key(self, run: str, stage: str, sample_id: str) -> str:
        return self._shard(run, f"rejected/{stage}", sample_id, ".json")

    def hidden_key(self, run: str, sample_id: str) -> str:
        return self._shard(run, "hidden", sample_id, ".safetensors")

    def artifact_key(self, run: str, name: str) -> str:
        return f"{run}/train/{name}"

    # --- samples ---
    def write_sample(self, sample: Sample) -> int:
        data = sample.model_dump_json().encode()
        self.blobs.put(self.sample_key(sample.run, sample.sample_id), data)
        return len(data)

    def read_sample(self, run: str, sample_id: str) -> Sample:
        return Sample.model_validate_json(self.blobs.get(self.sample_key(run, sample_id)))

    def has_sample(self, run: str, sample_id: str) -> bool:
        return self.sample_size(run, sample_id) is not None

    def sample_size(self, run: str, sample_id: str) -> int | None:
        return self.blobs.size(self.sample_key(run, sample_id))

    def sample_ids(self, run: str) -> list[str]:
        return sorted(_stem(k) for k, _ in self.blobs.list(f"{run}/samples/") if k.endswith(".json"))

    # --- rejections ---
    def write_rejection(self, rej: Rejection) -> None:
        self.blobs.put(self.rejection_key(rej.run, rej.stage, rej.sample_id), rej.model_dump_json().encode())

    def read_rejection(self, run: str, stage: str, sample_id: str) -> Rejection:
        return Rejection.model_validate_json(self.blobs.get(self.rejection_key(run, stage, sample_id)))

    def rejection_ids(self, run: str, stage: str) -> list[str]:
        return sorted(_stem(k) for k, _ in self.blobs.list(f"{run}/rejected/{stage}/") if k.endswith(".json"))

    # --- hidden states ---
    def write_hidden(self, run: str, sample_id: str, data: bytes) -> int:
        """The object's bytes (eagle3q.store.hidden_format.encode), whole or not at all; its size."""
        self.blobs.put(self.hidden_key(run, sample_id), data)
        return len(data)

    def hidden_ids(self, run: str) -> list[str]:
        return sorted(_stem(k) for k, _ in self.blobs.list(f"{run}/hidden/") if k.endswith(".safetensors"))

    def hidden_header(self, run: str, sample_id: str) -> Header:
        """The object's header (metadata, shapes, offsets): one ranged read, not the states."""
        return self._header(self.hidden_key(run, sample_id))[0]

    def _header(self, key: str) -> tuple[Header, bytes, int]:
        prefix, size = self.blobs.get_prefix(key, HEADER_GUESS)
        need = header_length(prefix)
        if need > len(prefix):
            prefix += self.blobs.get_ranges(key, [(len(prefix), need)])[0]
        return parse_header(prefix), prefix, size

    def hidden_valid(self, run: str, sample_id: str, expected_len: int) -> int | None:
        """The object's size where it is complete and of `expected_len` tokens (a redelivered task trusts it only
        then), else None: missing, foreign, or of another sample's length."""
        try:
            header, _, size = self._header(self.hidden_key(run, sample_id))
        except (FileNotFoundError, NotSafetensors):
            return None
        ids = header.tensors.get("input_ids")
        ok = ids is not None and ids.shape == (expected_len,) and size == header.file_size
        return size if ok else None

    def hidden_tokens(self, run: str, sample_id: str):  # noqa: ANN201 - (ids, mask) numpy arrays
        """A sample's token ids and loss mask without its states: the header and two ranges."""
        key = self.hidden_key(run, sample_id)
        header, prefix, _ = self._header(key)
        infos = [header.tensors[k] for k in hidden_format.TOKEN_KEYS]
        missing = [(i.start, i.end) for i in infos if i.end > len(prefix)]
        fetched = iter(self.blobs.get_ranges(key, missing) if missing else [])
        return tuple(array(i, prefix[i.start:i.end] if i.end <= len(prefix) else next(fetched)) for i in infos)

    def hidden_bytes(self, run: str, sample_id: str) -> bytes:
        return self.blobs.get(self.hidden_key(run, sample_id))

    def read_hidden(self, run: str, sample_id: str, restore: bool = True) -> tuple[dict, str]:
        """The four tensors (fp8 restored to float32 unless `restore=False`) and the final state's side of the norm."""
        return hidden_format.decode(self.hidden_bytes(run, sample_id), restore)

    def map_samples(self, fn: Callable[[str], T], ids: Iterable[str], threads: int = READ_THREADS) -> Iterator[T]:
        """fn over ids, in order, with `threads` requests in flight on an object store (each object there is a round
        trip) and no more held ahead; serial on a local one."""
        for _, result in read_ahead(fn, ids, 0 if self.is_local else threads):
            yield result

    # --- the run's artifacts (train/) ---
    def put_artifact(self, run: str, name: str, data: bytes) -> None:
        self.blobs.put(self.artifact_key(run, name), data)

    def get_artifact(self, run: str, name: str) -> bytes:
        """FileNotFoundError where the run has none of that name."""
        return self.blobs.get(self.artifact_key(run, name))

    def has_artifact(self, run: str, name: str) -> bool:
        return self.blobs.size(self.artifact_key(run, name)) is not None

    def delete_artifact(self, run: str, name: str) -> None:
        self.blobs.delete(self.artifact_key(run, name))

    def put_json(self, run: str, name: str, obj: Any) -> None:
        self.put_artifact(run, name, json.dumps(obj, indent=2, sort_keys=True).encode())

    def get_json(self, run: str, name: str) -> Any:
        return json.loads(self.get_artifact(run, name))

    def artifact_url(self, run: str, name: str) -> str:
        """Where an artifact is, for messages: a path, or s3://bucket/prefix/..."""
        return f"{self.url.rstrip('/')}/{self.artifact_key(run, name)}"

    def artifact_names(self, run: str, prefix: str) -> list[str]:
        """Names under `train/<prefix>/` (relative to train/)."""
        base = self.artifact_key(run, "")
        folder = f"{base}{prefix.strip('/')}/" if prefix.strip("/") else base
        return sorted(k[len(base):] for k, _ in self.blobs.list(folder))

    def put_dir(self, run: str, prefix: str, local: Path) -> int:
        """Copy a local directory's files under train/<prefix>/ (those whose size changed): how TensorBoard's
        event files, written locally as they grow, reach the store. Returns the files copied."""
        have = dict(self.blobs.list(self.artifact_key(run, prefix.strip("/") + "/")))
        copied = 0
        for p in sorted(x for x in local.rglob("*") if x.is_file()):
            key = self.artifact_key(run, f"{prefix.strip('/')}/{p.relative_to(local).as_posix()}")
            if have.get(key) != p.stat().st_size:
                self.blobs.put(key, p.read_bytes())
                copied += 1
        return copied

    def fetch_dir(self, run: str, prefix: str, dest: Path) -> Path:
        """The artifacts under train/<prefix>/ as files in `dest` (e.g. the export, for `vllm serve`)."""
        names = self.artifact_names(run, prefix)
        if not names:
            raise FileNotFoundError(f"nothing under {self.artifact_url(run, prefix)}")
        for name in names:
            write_atomic(dest / Path(name).relative_to(prefix.strip("/")), self.get_artifact(run, name))
        return dest

    def local_dir(self, run: str, prefix: str, cache: Path | None) -> Path:
        """A directory holding train/<prefix>/: the store's own where it is a directory, else a copy in `cache`
        (which an object store needs)."""
        if isinstance(self.blobs, LocalBlobs):
            return self.blobs.path(self.artifact_key(run, prefix.strip("/")))
        if cache is None:
            raise ValueError(f"{self.url} is an object store: local_dir needs a directory to copy {prefix} into")
        return self.fetch_dir(run, prefix, cache)


def _stem(key: str) -> str:
    return key.rsplit("/", 1)[-1].split(".", 1)[0]
