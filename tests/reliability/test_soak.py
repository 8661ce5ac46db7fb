"""A bounded soak: 10k prompts through the simulator with faults on; the final counts must add up exactly."""

from __future__ import annotations

import os
import time
from pathlib import Path

N = int(os.environ.get("EAGLE3Q_SOAK_PROMPTS", "10000"))


def test_soak_10k_with_faults(stack_factory, tmp_path: Path, write_jsonl, assert_accounted):  # noqa: ANN001
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i * 7 % 101}?"},
                               {"from": "gpt", "value": "..."}]} for i in range(N)]
    data = write_jsonl(tmp_path / "soak.jsonl", rows)
    faults = "5xx=0.05,429=0.03,drop=0.01,truncate=0.01,missing_close=0.01,leak=0.01,null_ids=0.01"
    stack = stack_factory(sim_args=["--faults", faults, "--ttft", "0", "--itl", "0", "--mean-output-tokens", "24",
                                    "--max-num-seqs", "512"],
                          env={"EAGLE3Q_MAX_RETRIES": "10"})
    for _ in range(2):
        stack.worker("inference", concurrency=24)
    t0 = time.monotonic()
    rep = stack.enqueue(data, "soak")
    assert rep.enqueued == N
    stack.wait_settled("soak", timeout_s=600)
    elapsed = time.monotonic() - t0
    done, rejected = assert_accounted(stack, "soak")
    c = stack.ledger.counts("soak", "inference")
    print(f"\nsoak: enqueued {rep.enqueued} = accepted {len(done)} + rejected {len(rejected)} "
          f"{dict(sorted(c.reasons.items()))} in {elapsed:.0f}s ({N / elapsed:.0f} req/s); "
          f"retries {dict((k, v) for k, v in sorted(c.stats.items()) if k.startswith('retry_'))}")
    assert rep.enqueued == len(done) + len(rejected)
    assert not any(r.startswith("retries_exhausted") for r in rejected.values())
