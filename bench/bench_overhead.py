"""(d) per-task overhead of the queue with a zero-latency simulator: the same request + validation + store work
done in a plain loop, against the same work as Celery tasks through Redis (one worker thread, one in flight)."""

from __future__ import annotations

import time

from common import report, stack, synthetic_dataset, tiny_target, workdir

from eagle3q.control import keys
from eagle3q.producer import sampling_of, task_for
from eagle3q.sources import Prompt, iter_prompts
from eagle3q.stages.inference import build_context, run_inference

N = 400
SIM = ["--ttft", "0", "--itl", "0", "--mean-output-tokens", "32"]


def main() -> dict:
    base = workdir("overhead")
    tiny = tiny_target(base)
    data = synthetic_dataset(base / "prompts.jsonl", N)
    st = stack(base, tiny, SIM)
    try:
        s = st.settings
        sampling = sampling_of(s)
        tasks = [task_for(p, "direct", data.name, s, sampling) for p in iter_prompts(data) if isinstance(p, Prompt)]
        ctx = build_context(s, forward=lambda run, sid: None, concurrency=1)
        st.ledger.open_tasks("direct", {t.sample_id: t.model_dump_json() for t in tasks})  # as the producer does
        t0 = time.monotonic()
        for t in tasks:
            run_inference(t, ctx)
        direct = (time.monotonic() - t0) / N
        st.worker("inference", concurrency=1)
        t_wall = time.time()
        st.enqueue(data, "queued")
        st.wait_settled("queued", timeout_s=600)
        # The end is the ledger's timestamp of the last sample marked done, not the settle poll's (0.2 s steps).
        last = st.broker.zrange(keys.done("queued", "inference"), -1, -1, withscores=True)[0][1]
        queued = (last - t_wall) / N
    finally:
        st.close()
    report("queue overhead (d): zero-latency simulator, one at a time", [
        ("direct call (request + validation + store + ledger)", f"{direct * 1000:.2f} ms/task"),
        ("through Celery + Redis", f"{queued * 1000:.2f} ms/task"),
        ("overhead of the queue", f"{(queued - direct) * 1000:.2f} ms/task ({queued / direct:.2f}x)"),
    ])
    return {"direct_ms": direct * 1000, "queued_ms": queued * 1000}


if __name__ == "__main__":
    main()
