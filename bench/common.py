"""Shared set-up of the benchmarks: a tiny target, synthetic prompts, and a local stack."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from eagle3q.dev.local import LocalStack
from eagle3q.dev.tiny import build_model, build_tokenizer
from eagle3q.generate.endpoints import parse_gauge


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


class RunningProbe:
    """Polls the simulator's `vllm:num_requests_running` (every 20 ms, in a thread) while a client runs: how long it
    takes the client to fill the server's slots, and how full it keeps them. Where a client loses throughput
    against another at the same latency, this says whether it is the ramp, the steady state or the tail."""

    def __init__(self, url: str, slots: int):
        import threading

        self.url, self.slots = url.rstrip("/").removesuffix("/v1") + "/metrics", slots
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import time

        import httpx

        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                running = parse_gauge(http.get(self.url).text, "vllm:num_requests_running")
                self.samples.append((time.time(), int(running)))
                self._stop.wait(0.02)

    def __enter__(self) -> RunningProbe:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, t0: float, t1: float) -> str:
        """Over [t0, t1] (wall clock): seconds until the slots were 95% full, the mean fill from then until the
        first drop below 95% that lasts to the end (the steady state), and the seconds of that tail."""
        pts = [(t, n) for t, n in self.samples if t0 <= t <= t1]
        full = [t for t, n in pts if n >= 0.95 * self.slots]
        if not full:
            return f"never 95% full (peak {max((n for _, n in pts), default=0)} of {self.slots})"
        ramp_end, tail_start = full[0], full[-1]
        steady = [n for t, n in pts if ramp_end <= t <= tail_start]
        fill = sum(steady) / len(steady) / self.slots
        return f"ramp {ramp_end - t0:.2f} s, steady fill {fill:.3f}, tail {t1 - tail_start:.2f} s"
