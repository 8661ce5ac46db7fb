"""Where a store's bytes live: a local (or mounted) directory, or an S3-compatible bucket. Keys are '/'-joined paths
under the store's root (`<run>/samples/ab/<id>.json`); the typed layer above (`eagle3q.store.store.Store`) names them.

Visibility: a reader sees no object or the whole object, never a part. Locally: a temp file in the same directory,
fsync, then rename. On S3: one PUT (a multipart upload above 5 MiB, completed as a whole by the server). A put
returns once the bytes are durable, which is what lets the ledger mark a sample done after it.

Errors: a missing key is `FileNotFoundError`; anything else (a full disk, a refused PUT, an unreachable endpoint,
wrong credentials) is `StoreError`, which every stage retries with backoff and never acknowledges as done.

S3 client: obstore (Rust's object_store). Measured against s3fs on the same moto server (docs/performance.md): 2.2
ms against 6.6 ms a 2 KB PUT, 2.1 against 8.2 a GET, 2.7 against 4.6 an 8-byte range, the same 100 MB/s for 8 MB
PUTs; and one wheel with no botocore pins. Credentials come only from the environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, or the instance's role), never from settings files.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol


class StoreError(OSError):
    """The store could not be read or written (disk full, permissions, a refused PUT, an unreachable endpoint):
    retried, never acknowledged as done."""


class Blobs(Protocol):
    """The byte layer under `Store`. `url` names it for messages (a path, or s3://bucket/prefix)."""

    url: str
    is_local: bool

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        """The first `length` bytes (fewer for a shorter object) and the object's whole size, in one request."""
        ...

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]: ...

    def size(self, key: str) -> int | None:
        """The object's size, None where it does not exist."""
        ...

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under `prefix` (a '/'-ended folder), in no particular order."""
        ...

    def delete(self, key: str) -> None: ...

    def check(self, write: bool) -> None:
        """Raise StoreError with the cause when the store cannot be used (a bucket that does not exist, wrong
        credentials, a read-only mount); `write`: also prove that a put and a delete go through."""
        ...


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file in the same directory + fsync + os.replace: readers see the old file or the whole new one. For the
    local store, and for files handed to programs that read a local directory (the peer exports)."""
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


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


class LocalBlobs:
    """A directory: this machine's disk, or a shared mount every worker sees at the same path."""

    is_local = True

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.url = str(self.root)

    def path(self, key: str) -> Path:
        """The file behind a key (the local store only: tests, and tools that hand a directory to vLLM)."""
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        write_atomic(self.path(key), data)

    def _failed(self, e: OSError, key: str) -> OSError:
        """A missing file stays FileNotFoundError; anything else (a file where a directory should be, permissions,
        an I/O error) is the store failing, retried as StoreError."""
        if isinstance(e, FileNotFoundError):
            return e
        return StoreError(e.errno, f"cannot read {self.path(key)}: {e.strerror or e}")

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except OSError as e:
            raise self._failed(e, key) from e

    def get_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        try:
            with self.path(key).open("rb") as f:
                return f.read(length), os.fstat(f.fileno()).st_size
        except OSError as e:
            raise self._failed(e, key) from e

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        out = []
        try:
            with self.path(key).open("rb") as f:
                for start, end in ranges:
                    f.seek(start)
                    out.append(f.read(end - start))
        except OSError as e:
            raise self._failed(e, key) from e
        return out

    def size(self, key: str) -> int | None:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._failed(e, key) from e

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        base = self.path(prefix)
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if _is_temp(name):  # a write in progress (or one a crash left behind): never an object
                    continue
                p = Path(dirpath) / name
                try:
                    yield p.relative_to(self.root).as_posix(), p.stat().st_size
                except FileNotFoundError:  # deleted while listing
                    continue

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as e:
            raise self._failed(e, key) from e

    def check(self, write: bool) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if write:
                probe = ".eagle3q-probe"
                write_atomic(self.root / probe, b"ok")
                self.delete(probe)
        except OSError as e:
            raise StoreError(e.errno, f"the store {self.root} cannot be written: {e.strerror or e}") from e


@dataclass(frozen=True)
class S3Options:
    """From the settings (EAGLE3Q_S3_*); credentials are not here: the environment's AWS_* variables."""

    endpoint: str = ""  # e.g. http://minio:9000; empty: AWS (or AWS_ENDPOINT_URL)
    region: str = "us-east-1"
    timeout_s: float = 60.0
    retries: int = 3  # the client's own retries of one request (5xx, dropped connections), before StoreError
    retry_timeout_s: float = 20.0


class S3Blobs:
    """An S3-compatible bucket (AWS S3, MinIO, Ceph RGW, R2, moto), through obstore."""

    is_local = False

    def __init__(self, url: str, opts: S3Options | None = None):
        from obstore.store import S3Store

        opts = opts or S3Options()
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"EAGLE3Q_STORE_URL {url!r} names no bucket: s3://bucket/prefix")
        self.url = url.rstrip("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        config: dict = {"region": opts.region}
        client: dict = {"timeout": timedelta(seconds=opts.timeout_s), "connect_timeout": timedelta(seconds=5)}
        if opts.endpoint:
            config["endpoint"] = opts.endpoint
            # Path-style requests (http://host/bucket/key): what MinIO, Ceph and moto serve.
            config["virtual_hosted_style_request"] = False
            if opts.endpoint.startswith("http://"):
                client["allow_http"] = True
        self._s3 = S3Store(bucket, prefix=self.prefix or None, config=config, client_options=client,
                           retry_config={"max_retries": opts.retries,
                                         "retry_timeout": timedelta(seconds=opts.retry_timeout_s)})

    def _err(self, e: Exception, what: str, key: str) -> OSError:
        if isinstance(e, FileNotFoundError):  # obstore's NotFoundError is raised as one
            return FileNotFoundError(f"{self.url}/{key}")
        return StoreError(f"cannot {what} {self.url}/{key}: {_first_line(e)}")

    def put(self, key: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self._s3, key, data)
        except Exception as e:  # noqa: BLE001 - every obstore error becomes ours
            raise self._err(e, "write", key) from e

    def get(self, key: str) -> bytes:
        import obstore

        try:
            return obstore.get(self._s3, key).bytes().to_bytes()
        except Exception as e:  # noqa: BLE001
            raise self._err(e, "read", key) from e

    def get_prefix(self, key: str, length: int) -> tuple[bytes, int]:
        import obstore

        try:
            r = obstore.get(self._s3, key, options={"range": (0, length)})
            return r.bytes().to_bytes(), int(r.meta["size"])
        except Exception as e:  # noqa: BLE001
            raise self._err(e, "read", key) from e

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        import obstore

        try:
            got = obstore.get_ranges(self._s3, key, starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
            return [g.to_bytes() for g in got]
        except Exception as e:  # noqa: BLE001
            raise self._err(e, "read", key) from e

    def size(self, key: str) -> int | None:
        import obstore

        try:
            return int(obstore.head(self._s3, key)["size"])
        except Exception as e:  # noqa: BLE001
            err = self._err(e, "read", key)
            if isinstance(err, FileNotFoundError):
                return None
            raise err from e

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        import obstore

        try:
            for chunk in obstore.list(self._s3, prefix.rstrip("/"), chunk_size=1000):
                for meta in chunk:
                    yield meta["path"], int(meta["size"])
        except Exception as e:  # noqa: BLE001
            raise self._err(e, "list", prefix) from e

    def delete(self, key: str) -> None:
        import obstore

        try:
            obstore.delete(self._s3, key)
        except Exception as e:  # noqa: BLE001
            err = self._err(e, "delete", key)
            if not isinstance(err, FileNotFoundError):
                raise err from e

    def check(self, write: bool) -> None:
        """One listing (a missing bucket or wrong credentials answer it with the server's own error), and with
        `write` a probe object put and deleted (a read-only key)."""
        try:
            next(iter(self.list(".eagle3q-probe")), None)
            if write:
                self.put(".eagle3q-probe", b"ok")
                self.delete(".eagle3q-probe")
        except OSError as e:
            raise StoreError(f"the store {self.url} cannot be {'written' if write else 'read'}: {e}") from e


def _first_line(e: Exception) -> str:
    """obstore's messages carry the request and the whole error chain over many lines: the server's own code and
    message where it answered (NoSuchBucket, SignatureDoesNotMatch, ...), else the first line."""
    import re

    text = str(e)
    code, msg = re.search(r"<Code>([^<]*)</Code>", text), re.search(r"<Message>([^<]*)</Message>", text)
    if code:
        return f"{code.group(1)}: {msg.group(1) if msg else ''}".strip()
    return text.strip().splitlines()[0][:400] if text.strip() else type(e).__name__


def open_blobs(url: str, s3: S3Options | None = None) -> LocalBlobs | S3Blobs:
    """`s3://bucket/prefix`, or a local path (the default: a directory on this machine or a shared mount)."""
    if url.startswith("s3://"):
        return S3Blobs(url, s3)
    if "://" in url:
        raise ValueError(f"EAGLE3Q_STORE_URL {url!r}: a local path or s3://bucket/prefix")
    return LocalBlobs(url)
