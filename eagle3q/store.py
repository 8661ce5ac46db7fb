"""The sample store: a directory (local or shared) with one file per sample and stage, written atomically.

Layout under `<root>/<run>/`:
    samples/<id[:2]>/<id>.json            accepted generations (Sample)
    rejected/<stage>/<id[:2]>/<id>.json   rejections with reason and the raw response
    hidden/<id[:2]>/<id>.safetensors      hidden states
    train/                                checkpoints, logs, the exported draft
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator

from eagle3q.contract import SAMPLE_STAGES, Message, Sampling


class Sample(BaseModel):
    """An accepted generation: the exact token stream the model produced, and where the loss applies."""

    sample_id: str
    run: str
    dataset: str
    row: int
    turn: int
    model: str
    profile: str
    thinking: bool
    sampling: Sampling
    messages: list[Message]
    input_ids: list[int]
    loss_mask: list[int]
    num_prompt_tokens: int
    reasoning: str | None
    content: str | None
    finish_reason: str
    truncated: bool
    endpoint: str
    latency_s: float


class Rejection(BaseModel):
    """Why a sample was rejected by a stage, with the server's raw answer where there was one."""

    sample_id: str
    run: str
    stage: str
    reason: str
    detail: str
    raw: dict | None = None

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, v: str) -> str:
        if v not in SAMPLE_STAGES:
            raise ValueError(f"stage must be one of {SAMPLE_STAGES}")
        return v


class StoreError(OSError):
    """The store could not be written (disk full, permissions, missing mount): retried, never acknowledged as done."""


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same directory + fsync + os.replace: readers see the old file or the whole new one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise StoreError(e.errno, f"cannot write {path}: {e.strerror or e}") from e


class Store:
    def __init__(self, root: Path | str):
        self.root = Path(root)

    def run_dir(self, run: str) -> Path:
        return self.root / run

    def _shard(self, run: str, kind: str, sample_id: str, suffix: str) -> Path:
        return self.root / run / kind / sample_id[:2] / f"{sample_id}{suffix}"

    # --- samples ---
    def sample_path(self, run: str, sample_id: str) -> Path:
        return self._shard(run, "samples", sample_id, ".json")

    def write_sample(self, sample: Sample) -> int:
        data = sample.model_dump_json().encode()
        write_atomic(self.sample_path(sample.run, sample.sample_id), data)
        return len(data)

    def read_sample(self, run: str, sample_id: str) -> Sample:
        return Sample.model_validate_json(self.sample_path(run, sample_id).read_bytes())

    def has_sample(self, run: str, sample_id: str) -> bool:
        return self.sample_path(run, sample_id).is_file()

    # --- rejections ---
    def rejection_path(self, run: str, stage: str, sample_id: str) -> Path:
        return self._shard(run, f"rejected/{stage}", sample_id, ".json")

    def write_rejection(self, rej: Rejection) -> None:
        write_atomic(self.rejection_path(rej.run, rej.stage, rej.sample_id), rej.model_dump_json().encode())

    def read_rejection(self, run: str, stage: str, sample_id: str) -> Rejection:
        return Rejection.model_validate_json(self.rejection_path(run, stage, sample_id).read_bytes())

    # --- hidden states ---
    def hidden_path(self, run: str, sample_id: str) -> Path:
        return self._shard(run, "hidden", sample_id, ".safetensors")

    def hidden_files(self, run: str) -> list[Path]:
        return sorted((self.root / run / "hidden").glob("*/*.safetensors"))

    # --- training ---
    def train_dir(self, run: str) -> Path:
        return self.root / run / "train"

    def write_json(self, path: Path, obj: Any) -> None:
        write_atomic(path, json.dumps(obj, indent=2, sort_keys=True).encode())
