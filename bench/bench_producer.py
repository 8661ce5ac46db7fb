"""(c) the producer: enqueue rate (tasks/s) and peak memory for 100k prompts against 10k, and what it leaves in
Redis: without a backlog cap Redis grows with the data set; with the cap (EAGLE3Q_MAX_QUEUED) it is flat. Also the
time to the first task on the queue, with and without the cap (the producer's share of enqueue-to-first-result)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import redis as redis_py
from common import report, synthetic_dataset, workdir

from eagle3q.dev.local import RedisServer

CAP = 5000

CHILD = textwrap.dedent("""
    import json
    from pathlib import Path
    from eagle3q.celery.app import make_app
    from eagle3q.config import Settings
    from eagle3q.control.ledger import Ledger
    from eagle3q.producer import enqueue
    s = Settings(redis_url={url!r})
    # No consumers here: with a cap the producer fills the backlog and stops (wait=False), as it would wait.
    rep = enqueue(make_app(s), Ledger.from_url(s.broker_url()), s, Path({data!r}), {run!r}, max_queued={cap},
                  wait=False)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a parent holding torch would show up here
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps({{"enqueued": rep.enqueued, "seconds": rep.seconds, "peak_rss_mb": hwm / 1024,
                      "first_sent_s": rep.first_sent_s}}))
""")


def run(server: RedisServer, data: str, name: str, cap: int) -> dict:
    client = redis_py.Redis.from_url(server.url)
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    code = CHILD.format(url=server.url, data=data, run=name, cap=cap)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["redis_mb"] = (int(client.info("memory")["used_memory"]) - before) / 2**20
    return res


def main() -> dict:
    base = workdir("producer")
    server = RedisServer(base / "redis", appendonly=False).start()
    try:
        d10, d100 = (str(synthetic_dataset(base / f"{n // 1000}k.jsonl", n)) for n in (10_000, 100_000))
        small, big = run(server, d10, "p10k", 0), run(server, d100, "p100k", 0)
        small_cap, big_cap = run(server, d10, "c10k", CAP), run(server, d100, "c100k", CAP)
    finally:
        server.stop()
    ms = 1000
    report("producer (c): enqueue, one process", [
        ("10k prompts, no cap", f"{small['enqueued'] / small['seconds']:.0f} tasks/s, peak RSS "
                                f"{small['peak_rss_mb']:.0f} MB, Redis +{small['redis_mb']:.1f} MB"),
        ("100k prompts, no cap", f"{big['enqueued'] / big['seconds']:.0f} tasks/s, peak RSS "
                                 f"{big['peak_rss_mb']:.0f} MB, Redis +{big['redis_mb']:.1f} MB"),
        ("producer peak memory 100k / 10k", f"{big['peak_rss_mb'] / small['peak_rss_mb']:.2f}  (flat = 1.0)"),
        ("Redis memory 100k / 10k, no cap", f"{big['redis_mb'] / small['redis_mb']:.2f}  (grows with the data)"),
        (f"Redis memory 100k / 10k, cap {CAP}", f"{big_cap['redis_mb'] / small_cap['redis_mb']:.2f}  (flat = 1.0; "
                                                f"{big_cap['redis_mb']:.1f} MB for {big_cap['enqueued']} queued)"),
        ("first task on the queue, cap / no cap", f"{big_cap['first_sent_s'] * ms:.1f} ms / "
                                                  f"{big['first_sent_s'] * ms:.1f} ms"),
    ])
    return {"small": small, "big": big, "small_cap": small_cap, "big_cap": big_cap}


if __name__ == "__main__":
    main()
