"""(b) req/s with 1, 2 and 4 consumer processes against a simulator with room for all of them."""

from __future__ import annotations

import time

from common import report, stack, synthetic_dataset, tiny_target, workdir

PER_PROC = 8
SIM = ["--ttft", "0.6", "--itl", "0.0005", "--mean-output-tokens", "60", "--max-num-seqs", "256"]


def main() -> dict:
    base = workdir("scaling")
    tiny = tiny_target(base)
    results = {}
    for procs in (1, 2, 4):
        n = 120 * procs
        data = synthetic_dataset(base / f"p{procs}.jsonl", n)
        st = stack(base / f"s{procs}", tiny, SIM)
        try:
            for _ in range(procs):
                st.worker("inference", concurrency=PER_PROC)
            t0 = time.monotonic()
            st.enqueue(data, f"scale{procs}")
            st.wait_settled(f"scale{procs}", timeout_s=600)
            results[procs] = n / (time.monotonic() - t0)
        finally:
            st.close()
    report("scaling (b): consumer processes x 8 threads each", [
        (f"{p} process(es)", f"{r:.1f} req/s  ({r / results[1]:.2f}x of one, ideal {p}x)") for p, r in results.items()
    ])
    return results


if __name__ == "__main__":
    main()
