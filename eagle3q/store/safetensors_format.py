"""The safetensors container read without torch and without the whole file: an 8-byte little-endian header length,
a JSON header (dtype, shape and byte offsets of each tensor, and string metadata), then the tensors' bytes. So a
reader that needs a sample's token ids, or a file's metadata, fetches a few KB of an object instead of its hidden
states (on S3: one ranged GET for the header, one for the ids and mask)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

# One ranged read that holds the header of any hidden-state file: ~300 B per tensor plus the metadata (~1 KB).
HEADER_GUESS = 16 * 1024
_DTYPES = {"I64": "<i8", "I32": "<i4", "U8": "|u1", "BOOL": "|b1", "F32": "<f4", "F16": "<f2"}


class NotSafetensors(ValueError):
    """Bytes that are not a complete safetensors file (a truncated or foreign object)."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_start: int

    @property
    def file_size(self) -> int:
        """The size a complete file has (its last tensor's end)."""
        return max((t.end for t in self.tensors.values()), default=self.data_start)

    def meta(self, key: str, default: object = None) -> object:
        """A metadata value, JSON-decoded (eagle3q writes every value as JSON)."""
        return json.loads(self.metadata[key]) if key in self.metadata else default


def header_length(prefix: bytes) -> int:
    if len(prefix) < 8:
        raise NotSafetensors("shorter than a safetensors header")
    return 8 + struct.unpack("<Q", prefix[:8])[0]


def parse_header(prefix: bytes) -> Header:
    """From the file's first `header_length` bytes (or more)."""
    end = header_length(prefix)
    if len(prefix) < end or end > 100_000_000:
        raise NotSafetensors("header truncated")
    try:
        raw = json.loads(prefix[8:end])
    except ValueError as e:
        raise NotSafetensors(f"header is not JSON: {e}") from None
    meta = raw.pop("__metadata__", None) or {}
    tensors = {name: TensorInfo(t["dtype"], tuple(t["shape"]), end + t["data_offsets"][0], end + t["data_offsets"][1])
               for name, t in raw.items()}
    return Header(meta, tensors, end)


def array(info: TensorInfo, data: bytes):  # noqa: ANN201 - a numpy array
    """A small integer tensor (ids, mask) from its bytes, as numpy: no torch needed."""
    import numpy as np

    if info.dtype not in _DTYPES:
        raise NotSafetensors(f"dtype {info.dtype} is not read without torch")
    return np.frombuffer(data, dtype=_DTYPES[info.dtype]).reshape(info.shape)
