"""Data-set adapters: every supported form, and bad rows reported with their row numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3q.ids import sample_id
from eagle3q.sources import BadRow, DatasetError, Prompt, iter_prompts

PB = {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]}
MULTI = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Name a prime."},
                           {"from": "gpt", "value": "7"}]}
OPENAI = {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]}


def split(items):  # noqa: ANN001, ANN201
    items = list(items)
    return [i for i in items if isinstance(i, Prompt)], [i for i in items if isinstance(i, BadRow)]


def test_forms_and_turns(tmp_path: Path, write_jsonl):  # noqa: ANN001
    path = write_jsonl(tmp_path / "d.jsonl", [PB, MULTI, OPENAI])
    prompts, bad = split(iter_prompts(path))
    assert not bad
    assert [(p.row, p.turn) for p in prompts] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    # each generated turn is its own sample, with the data set's earlier turns as history
    assert prompts[2].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello"},
                                   {"role": "user", "content": "Name a prime."}]
    assert prompts[3].messages == [{"role": "user", "content": "Capital of France?"}]


def test_bad_rows_are_reported_with_row_numbers_and_the_rest_runs(tmp_path: Path, write_jsonl):  # noqa: ANN001
    rows = [
        PB,
        "{not json",
        {"conversations": "nope"},
        {"conversations": [{"from": "human", "value": 12}]},
        {"conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "alien", "value": "hi"}]},
        {"foo": 1},
        [1, 2],
        {"conversations": [{"from": "human", "value": "x" * 500}]},
        OPENAI,
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with path.open("ab") as f:
        f.write(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')  # latin-1 byte: invalid UTF-8
        f.write(b"\n")
    prompts, bad = split(iter_prompts(path, max_prompt_chars=100))
    assert [p.row for p in prompts] == [0, 9]
    reasons = {b.row: b.reason for b in bad}
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    assert "invalid JSON" in reasons[1]
    assert "not a list" in reasons[2]
    assert "expected a string" in reasons[3]
    assert "empty" in reasons[4]
    assert "unknown role" in reasons[5]
    assert "neither" in reasons[6]
    assert "expected an object" in reasons[7]
    assert "exceeds" in reasons[8]
    assert "invalid UTF-8" in reasons[10]
    assert reasons[11] == "empty line"


def test_parquet_and_truncated_parquet(tmp_path: Path):
    table = pa.Table.from_pylist([PB, MULTI, PB])
    good = tmp_path / "good.parquet"
    pq.write_table(table, good)
    prompts, bad = split(iter_prompts(good))
    assert len(prompts) == 4 and not bad
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    prompts, bad = split(iter_prompts(broken))
    assert not prompts and len(bad) == 1 and "not a readable parquet file" in bad[0].reason


def test_directory_of_files_numbers_rows_across_files(tmp_path: Path, write_jsonl):  # noqa: ANN001
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [PB, PB])
    pq.write_table(pa.Table.from_pylist([OPENAI]), d / "b.parquet")
    prompts, _ = split(iter_prompts(d))
    assert [p.row for p in prompts] == [0, 1, 2]


def test_hf_datasets_directory(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"conversations": PB["conversations"]}, {"conversations": MULTI["conversations"]}])
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hf"))
    prompts, bad = split(iter_prompts(tmp_path / "hf"))
    assert len(prompts) == 3 and not bad
    with pytest.raises(DatasetError):
        list(iter_prompts(tmp_path / "hf", split="test"))


def test_missing_dataset_is_a_clear_error(tmp_path: Path):
    with pytest.raises(DatasetError, match="does not exist"):
        list(iter_prompts(tmp_path / "nope.jsonl"))


def test_sample_ids_are_stable_and_sensitive():
    sampling = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 100}
    a = sample_id("pb", 3, 0, "m", sampling, [{"role": "user", "content": "hi"}])
    assert a == sample_id("pb", 3, 0, "m", dict(reversed(sampling.items())), [{"role": "user", "content": "hi"}])
    assert len(a) == 32
    others = {
        sample_id("pb", 4, 0, "m", sampling, [{"role": "user", "content": "hi"}]),
        sample_id("pb", 3, 1, "m", sampling, [{"role": "user", "content": "hi"}]),
        sample_id("pb", 3, 0, "m2", sampling, [{"role": "user", "content": "hi"}]),
        sample_id("pb", 3, 0, "m", {**sampling, "temperature": 1.0}, [{"role": "user", "content": "hi"}]),
        sample_id("pb", 3, 0, "m", sampling, [{"role": "user", "content": "hello"}]),
    }
    assert a not in others and len(others) == 5
    json.dumps(a)


def test_overlong_line_is_a_bad_row_and_the_next_line_still_reads(tmp_path: Path, monkeypatch):  # noqa: ANN001
    import eagle3q.sources as sources

    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"x" * 5000 + b"\n" + json.dumps(PB).encode() + b"\n" + b"y" * 3000)  # no final newline
    prompts, bad = split(iter_prompts(path))
    assert [(b.row, b.reason) for b in bad] == [(0, "line longer than 0 MiB"), (2, "line longer than 0 MiB")]
    assert [p.row for p in prompts] == [1]


def test_lone_surrogates_and_raw_nul_bytes_are_bad_rows(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "half an emoji \\ud83d"}]}\n'
                     b'{"messages": [{"role": "user", "content": "raw \x00 byte"}]}\n'
                     b'{"messages": [{"role": "user", "content": "escaped \\u0000 is text"}]}\n')
    prompts, bad = split(iter_prompts(path))
    assert {b.row: b.reason for b in bad}.keys() == {0, 1}
    assert "lone surrogate" in bad[0].reason and "invalid JSON" in bad[1].reason
    assert prompts[0].messages[0]["content"] == "escaped \x00 is text"


def test_hub_ids_stream_through_datasets_and_offline_is_a_clear_error(tmp_path: Path):
    """`eagle3q enqueue mlabonne/open-perfectblend`: a hub id goes through `datasets`, streaming. Here there is no
    network (HF_*_OFFLINE=1): the id gives a clear error naming the way out, and a local copy of a hub repo
    streams through the same reader."""
    import subprocess
    import sys

    from eagle3q.dev.local import child_env

    repo = tmp_path / "open-perfectblend"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    pq.write_table(pa.Table.from_pylist([PB, OPENAI | {"source": "x"}, {"text": "no conversation"}] * 2),
                   repo / "data" / "train-00000-of-00001.parquet")
    code = f"""
import json
from pathlib import Path
from eagle3q.sources import BadRow, DatasetError, Prompt, hub_rows, iter_prompts
try:
    list(iter_prompts(Path("mlabonne/open-perfectblend")))
    print("NO ERROR")
except DatasetError as e:
    print("ERR", e)
rows = list(hub_rows({str(repo)!r}))
print(json.dumps([[r.row, r.data is not None] for r in rows]))
"""
    env = child_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    err = next(line for line in out if line.startswith(("ERR", "NO ERROR")))
    assert err.startswith("ERR") and "mlabonne/open-perfectblend" in err and "huggingface-cli download" in err
    assert json.loads(out[-1]) == [[i, True] for i in range(6)]  # all six rows, numbered in order
