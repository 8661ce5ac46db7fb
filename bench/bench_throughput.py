"""(a) eagle3q end-to-end req/s vs the ideal max_num_seqs / latency, vs a plain asyncio + semaphore client and vs
speculators' own response-regeneration client (its wheel, `make peers`), at the same concurrency, against the same
simulator, with the same prompts, in the same run; at 32, 128 and 256 requests in flight (EAGLE3Q_BENCH_LEVELS).

The reference run is Kimi-K2.5 at 128 in flight, ~600 completion tokens, 0.6 req/s: requests of ~200 s. Scaled
down so a level takes under two minutes on 2 cores, each level keeps the shape (the server's max_num_seqs equals
the concurrency, latency mostly inter-token) and about the same request rate (~40-50 req/s, what these cores
serve with room for the clients): latency grows with the concurrency, as it does on the real server. eagle3q runs
the layout a user would: EAGLE3Q_BENCH_PROCS consumer processes (2, one per core) sharing the threads."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
from common import RunningProbe, report, stack, synthetic_dataset, tiny_target, workdir

from eagle3q.control import keys
from eagle3q.sources import Prompt, iter_prompts

LEVELS = tuple(int(x) for x in os.environ.get("EAGLE3Q_BENCH_LEVELS", "32,128,256").split(","))
RATE = 45.0  # req/s each level is shaped for: latency = concurrency / RATE
PROCS = int(os.environ.get("EAGLE3Q_BENCH_PROCS", "2"))  # consumer processes sharing the C threads
# EAGLE3Q_BENCH_PIN=1: the server on a core of its own, every client (the plain one, speculators', eagle3q's
# consumers, Redis, the producer) on the rest. Measured: it does not help eagle3q on 2 cores (its consumers then
# share one core: 0.915-0.928 of the plain client), so the default shares the cores.
PIN = os.environ.get("EAGLE3Q_BENCH_PIN", "0") == "1" and len(os.sched_getaffinity(0)) >= 2
# EAGLE3Q_BENCH_POOL=gevent: the consumers as Celery's gevent pool (one process, greenlets, the peer's shape: one
# event loop) instead of the inference role's threads.
POOL = os.environ.get("EAGLE3Q_BENCH_POOL", "threads")
SECONDS = 30  # per client and level: start-up and the last wave weigh as little as in a real (hours-long) run


def shape(c: int) -> tuple[list[str], int]:
    """The simulator's flags and the number of prompts for `c` in flight: TTFT 0.3 s, 100 tokens on average, the
    inter-token latency that makes a request last c / RATE seconds (32: 0.71 s; 128: 2.8 s; 256: 5.7 s)."""
    latency = c / RATE
    itl = max(0.0, (latency - 0.3) / 100)
    return (["--ttft", "0.3", "--itl", f"{itl:.5f}", "--mean-output-tokens", "100", "--max-num-seqs", str(c)],
            int(RATE * SECONDS))


async def plain_client(url: str, prompts: list[list[dict]], concurrency: int) -> tuple[float, float]:
    """What users write today: asyncio, a semaphore, httpx. Returns (req/s, mean latency)."""
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def one(messages: list[dict]) -> None:
            async with sem:
                t = time.monotonic()
                r = await client.post(f"{url}/chat/completions", json={
                    "model": "moonshotai/Kimi-K2.5", "messages": messages, "max_tokens": 4096,
                    "return_token_ids": True, "chat_template_kwargs": {"thinking": True}})
                r.raise_for_status()
                json.dumps(r.json()["choices"][0]["token_ids"])
                latencies.append(time.monotonic() - t)

        t0 = time.monotonic()
        await asyncio.gather(*(one(m) for m in prompts))
        return len(prompts) / (time.monotonic() - t0), sum(latencies) / len(latencies)


def speculators_client(url: str, data: Path, tokenizer: Path, n: int, concurrency: int, out: Path) -> float | None:
    """speculators' `regenerate_responses` (its aiohttp workers, request, retries and sample building) over the same
    prompts. Returns req/s, or None when the peer is not installed."""
    import importlib

    try:  # the module, not the function of the same name that `speculators.cli` exports
        regen = importlib.import_module("speculators.cli.regenerate_responses")
    except ImportError:
        return None
    from eagle3q.generate.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tokenizer))
    regen.build_detokenizer = lambda model: tok.decode  # its --model is our served name, not a tokenizer path
    t0 = time.monotonic()
    asyncio.run(regen._run(
        endpoint=f"{url}/chat/completions", model="moonshotai/Kimi-K2.5", dataset_name=str(data), split=None,
        subset=None, limit=n, concurrency=concurrency, max_tokens=4096, sampling_params={}, outfile=str(out),
        resume=False, language_filter=None, max_retries=3, reasoning_effort_dist=None, temperature_dist=None,
        seed=0))
    rps = n / (time.monotonic() - t0)
    rows = sum(1 for _ in out.open())
    assert rows == n, f"speculators wrote {rows} of {n} samples"
    return rps


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of the process (sched_setaffinity on a pid moves its main thread only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            continue


def gevent_worker(st, concurrency: int):  # noqa: ANN001, ANN201 - a LocalStack, its Proc
    """The inference consumer on Celery's gevent pool: the role's own command line with `-P gevent`."""
    from eagle3q.celery.app import worker_args
    from eagle3q.dev.local import free_port, spawn, wait_worker_ready

    name = f"inference-gevent-{free_port()}"
    args = worker_args("inference", concurrency, name, "INFO", concurrency)
    args[args.index("-P") + 1] = "gevent"
    p = spawn(name, args, st.env, st.tmp / "logs")
    st.workers.append(p)
    wait_worker_ready(p)
    return p


def level(c: int) -> dict:
    sim, n = shape(c)
    base = workdir(f"throughput-{c}")
    tiny = tiny_target(base)
    data = synthetic_dataset(base / "prompts.jsonl", n)
    prompts = [p.messages for p in iter_prompts(data) if isinstance(p, Prompt)]
    st = stack(base, tiny, sim, EAGLE3Q_REQUEST_TIMEOUT_S="120")  # the test stacks' 5 s is below 256's latency
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_cores = {cores[0]}, set(cores[1:])
    if PIN:
        pin(st.sims[0].proc.pid, server_core)
        pin(st.redis.proc.pid, client_cores)
        pin(os.getpid(), client_cores)
    fills = {}
    try:
        with RunningProbe(st.sim_urls[0], c) as probe:
            t0 = time.time()
            plain_rps, latency = asyncio.run(plain_client(st.sim_urls[0], prompts, c))
            fills["plain"] = probe.summary(t0, time.time())
        ideal = c / latency
        with RunningProbe(st.sim_urls[0], c) as probe:
            t0 = time.time()
            peer_rps = speculators_client(st.sim_urls[0], data, tiny, n, c, base / "speculators.jsonl")
            fills["speculators"] = probe.summary(t0, time.time())
        for _ in range(PROCS):
            threads = POOL == "threads"
            worker = st.worker("inference", concurrency=c // PROCS) if threads else gevent_worker(st, c // PROCS)
            if PIN:
                pin(worker.proc.pid, client_cores)
        import eagle3q.producer  # noqa: F401 - imported before the clock starts, as the clients' modules are
        with RunningProbe(st.sim_urls[0], c) as probe:
            t0 = time.time()
            st.enqueue(data, "bench")
            st.wait_settled("bench", timeout_s=600)
            # The end is when the last sample was marked done (the ledger's own timestamp), not when the 0.2 s poll
            # above noticed: the plain client's clock stops with its last response too.
            last = st.broker.zrange(keys.done("bench", "inference"), -1, -1, withscores=True)[0][1]
            fills["eagle3q"] = probe.summary(t0, last)
        ours = n / (last - t0)
        cn = st.ledger.counts("bench", "inference")
        assert cn.done == n, cn
        ids = sorted(st.ledger.done_ids("bench", "inference"))
        our_latency = sum(st.store.read_sample("bench", i).latency_s for i in ids) / len(ids)
    finally:
        st.close()
    where = f"server on core {cores[0]}, clients on {sorted(client_cores)}" if PIN else "shared cores"
    report(f"throughput (a): same simulator, same {n} prompts, {c} in flight, eagle3q as {PROCS} processes x "
           f"{c // PROCS} {'threads' if POOL == 'threads' else POOL + ' greenlets'} ({where})", [
        ("mean request latency (plain client)", f"{latency:.3f} s"),
        ("ideal max_num_seqs / latency", f"{ideal:.1f} req/s"),
        ("plain asyncio + semaphore client", f"{plain_rps:.1f} req/s ({plain_rps / ideal:.3f} of ideal)"),
        ("eagle3q (enqueue -> validated samples on disk)", f"{ours:.1f} req/s ({ours / ideal:.3f} of ideal)"),
        ("mean request latency seen by eagle3q consumers", f"{our_latency:.3f} s"),
        ("speculators' regenerate_responses", f"{peer_rps:.1f} req/s ({peer_rps / plain_rps:.3f} of plain)"
         if peer_rps else "not installed (make peers)"),
        ("eagle3q / plain client", f"{ours / plain_rps:.3f}"),
    ] + ([("eagle3q / speculators' client", f"{ours / peer_rps:.3f}  (goal >= 1.00)")] if peer_rps else [])
      + [(f"server slots, {name}", fill) for name, fill in fills.items()])
    return {"concurrency": c, "ideal": ideal, "plain": plain_rps, "eagle3q": ours, "ratio": ours / plain_rps,
            "speculators": peer_rps, "vs_speculators": ours / peer_rps if peer_rps else None}


def main() -> list[dict]:
    return [level(c) for c in LEVELS]


if __name__ == "__main__":
    main()
