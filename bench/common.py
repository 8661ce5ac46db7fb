"""Shared set-up of the benchmarks: a tiny target, synthetic prompts, and a local stack."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from eagle3q.dev.local import LocalStack
from eagle3q.dev.tiny import build_model, build_tokenizer


def workdir(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"eagle3q-bench-{name}-"))


def tiny_target(base: Path, with_model: bool = False) -> Path:
    out = base / "tiny"
    if with_model:
        build_model(out)
    else:
        build_tokenizer(out)
    return out


def synthetic_dataset(path: Path, n: int) -> Path:
    topics = ["binary search", "photosynthesis", "the Roman Empire", "hash tables", "black holes", "recursion"]
    with path.open("w") as f:
        for i in range(n):
            q = f"Question {i}: explain {topics[i % len(topics)]} in {3 + i % 5} sentences."
            f.write(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "."}]}))
            f.write("\n")
    return path


def stack(base: Path, tiny: Path, sim_args: list[str], **env: str) -> LocalStack:
    return LocalStack(base, tiny, sim_args=sim_args, env=dict(env))


def report(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n== {title}")
    for k, v in rows:
        print(f"  {k:<48} {v}")
