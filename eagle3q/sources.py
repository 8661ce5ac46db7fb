"""Data-set adapters: JSONL, parquet and HF `datasets` directories, in open-perfectblend / ShareGPT
(`conversations` with from/value) or OpenAI (`messages` with role/content) form.

Rows are streamed (memory stays flat in the data set's size). A bad row never stops the run: it is reported with
its row number and reason, and the rest goes on. Each assistant turn of a row becomes one prompt (`Prompt`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}


@dataclass
class Prompt:
    row: int
    turn: int
    messages: list[dict[str, str]]


@dataclass
class BadRow:
    row: int
    reason: str


@dataclass
class Row:
    row: int
    data: Any  # the decoded row, or None when `error` is set
    error: str = ""


class DatasetError(ValueError):
    """The data set as a whole cannot be read (missing path, unknown format)."""


def normalize(data: Any) -> list[dict[str, str]]:
    """A row in any supported form -> [{"role", "content"}]. Raises ValueError with the reason."""
    if not isinstance(data, dict):
        raise ValueError(f"row is a {type(data).__name__}, expected an object")
    if "conversations" in data:
        turns, rkey, ckey = data["conversations"], "from", "value"
    elif "messages" in data:
        turns, rkey, ckey = data["messages"], "role", "content"
    else:
        raise ValueError("row has neither 'conversations' nor 'messages'")
    if not isinstance(turns, list) or not turns:
        raise ValueError("conversation is empty or not a list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ValueError(f"turn {i} is not an object")
        role = t.get(rkey, t.get("role"))
        content = t.get(ckey, t.get("content"))
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise ValueError(f"turn {i} has unknown role {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"turn {i} content is {type(content).__name__}, expected a string")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud83d" escapes decode to a lone surrogate: no server takes it
            raise ValueError(f"turn {i} content is not valid Unicode (lone surrogate at character {e.start})") from None
        out.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    return out


def prompts_of(row: int, messages: list[dict[str, str]], max_prompt_chars: int) -> list[Prompt]:
    """One prompt per assistant turn to generate: the history up to each user turn that ends a prefix.

    Earlier assistant turns come from the data set; each generated turn is its own sample."""
    prompts: list[Prompt] = []
    for i, m in enumerate(messages):
        if m["role"] != "user":
            continue
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else "assistant"
        if nxt != "assistant":
            continue  # two user turns in a row: the next one carries the request
        if not m["content"].strip():
            raise ValueError(f"user turn {i} is empty")
        history = messages[: i + 1]
        size = sum(len(h["content"]) for h in history)
        if size > max_prompt_chars:
            raise ValueError(f"prompt of {size} characters exceeds the limit of {max_prompt_chars}")
        prompts.append(Prompt(row=row, turn=len(prompts), messages=history))
    if not prompts:
        raise ValueError("no user turn to answer")
    return prompts


# --- readers -------------------------------------------------------------------------------------------------------


# A longer line is a bad row, read past in pieces: a file without newlines (a binary under a .jsonl name) never has
# to fit in memory.
MAX_LINE_BYTES = 64 << 20


def _lines(f: IO[bytes]) -> Iterator[bytes | None]:
    """The file's lines; None for a line over MAX_LINE_BYTES (skipped to its end)."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                pass
            yield None
        else:
            yield raw


def _jsonl_rows(path: Path, start: int) -> Iterator[Row]:
    with path.open("rb") as f:
        for i, raw in enumerate(_lines(f)):
            row = start + i
            if raw is None:
                yield Row(row, None, f"line longer than {MAX_LINE_BYTES >> 20} MiB")
                continue
            if not raw.strip():
                yield Row(row, None, "empty line")
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Row(row, None, f"invalid UTF-8 at byte {e.start}")
                continue
            try:
                yield Row(row, json.loads(text))
            except json.JSONDecodeError as e:
                yield Row(row, None, f"invalid JSON: {e.msg} at column {e.colno}")


def _table_rows(batches: Iterator[Any], start: int, label: str) -> Iterator[Row]:
    row = start
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt data
            yield Row(row, None, f"{label}: cannot read further ({type(e).__name__}: {e})")
            return
        for data in batch.to_pylist():
            yield Row(row, data)
            row += 1


def _parquet_rows(path: Path, start: int) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001
        yield Row(start, None, f"{path.name}: not a readable parquet file ({type(e).__name__}: {e})")
        return
    yield from _table_rows(iter(pf.iter_batches(batch_size=1024)), start, path.name)


def _arrow_rows(path: Path, start: int) -> Iterator[Row]:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    except Exception:  # noqa: BLE001 - not a stream: try the file format
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path)))
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            yield from _table_rows(batches, start, path.name)
            return
        except Exception as e:  # noqa: BLE001
            yield Row(start, None, f"{path.name}: not a readable arrow file ({type(e).__name__}: {e})")
            return
    yield from _table_rows(iter(reader), start, path.name)


def data_files(path: Path, split: str = "train") -> list[Path]:
    """The files of a data set: one file, an HF `save_to_disk` directory (Dataset or DatasetDict), or a directory of
    JSONL / parquet / arrow files."""
    if not path.exists():
        raise DatasetError(f"data set {path} does not exist")
    if path.is_file():
        return [path]
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DatasetError(f"{path} has splits {splits}; choose one with --split")
        path = path / split
    if (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text())
        return [path / f["filename"] for f in state.get("_data_files", [])]
    files = sorted(p for p in path.rglob("*") if p.suffix in {".jsonl", ".json", ".parquet", ".arrow"} and p.is_file())
    files = [p for p in files if p.name not in {"dataset_info.json", "state.json", "dataset_dict.json"}]
    if not files:
        raise DatasetError(f"no .jsonl, .parquet or .arrow files under {path}")
    return files


# `owner/name` that is not a local path: a Hugging Face hub data set, as its card's users type it.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: Path) -> bool:
    return not path.exists() and HUB_ID.match(str(path)) is not None


def hub_rows(name: str, split: str = "train") -> Iterator[Row]:
    """A data set through `datasets`, streaming (1.4M rows of open-perfectblend never sit in memory): a hub id, or
    anything `datasets.load_dataset` reads (a local copy of a hub repo works offline)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError("reading hub data sets needs the `datasets` package (pip install 'eagle3q[hf]')") from None
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
        rows = iter(ds)
        first = next(rows, None)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, no such split, unreadable files: all one answer
        raise DatasetError(
            f"cannot load the data set {name!r} (split {split!r}) through `datasets`: {type(e).__name__}: {e}. "
            f"Without network, download it first (`huggingface-cli download --repo-type dataset {name} "
            "--local-dir DIR`) and enqueue DIR") from None
    if first is None:
        return
    yield Row(0, first)
    try:
        for i, data in enumerate(rows, start=1):
            yield Row(i, data)
    except Exception as e:  # noqa: BLE001 - the stream broke: stop loudly; a re-run resumes (ids are stable)
        raise DatasetError(f"reading {name!r} stopped: {type(e).__name__}: {e}; run enqueue again to go on") from None


def read_rows(path: Path, split: str = "train") -> Iterator[Row]:
    if is_hub_id(path):
        yield from hub_rows(str(path), split)
        return
    start = 0
    for f in data_files(path, split):
        reader = {".parquet": _parquet_rows, ".arrow": _arrow_rows}.get(f.suffix, _jsonl_rows)
        last = start - 1
        for r in reader(f, start):
            last = r.row
            yield r
        start = last + 1


def iter_prompts(path: Path, max_prompt_chars: int = 200_000, split: str = "train") -> Iterator[Prompt | BadRow]:
    for r in read_rows(path, split):
        if r.error:
            yield BadRow(r.row, r.error)
            continue
        try:
            yield from prompts_of(r.row, normalize(r.data), max_prompt_chars)
        except ValueError as e:
            yield BadRow(r.row, str(e))
