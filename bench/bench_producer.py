"""(c) the producer's enqueue rate (tasks/s) for 100k prompts, and its peak memory against 10k: flat in the size."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from common import report, synthetic_dataset, workdir

from eagle3q.dev.local import RedisServer

CHILD = textwrap.dedent("""
    import json
    from pathlib import Path
    from eagle3q.celery.app import make_app
    from eagle3q.config import Settings
    from eagle3q.control.ledger import Ledger
    from eagle3q.producer import enqueue
    s = Settings(redis_url={url!r})
    rep = enqueue(make_app(s), Ledger.from_url(s.broker_url()), s, Path({data!r}), {run!r})
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a parent holding torch would show up here
    hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    print(json.dumps({{"enqueued": rep.enqueued, "seconds": rep.seconds, "peak_rss_mb": hwm / 1024}}))
""")


def run(url: str, data: str, name: str) -> dict:
    code = CHILD.format(url=url, data=data, run=name)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> dict:
    base = workdir("producer")
    redis = RedisServer(base / "redis", appendonly=False).start()
    try:
        small = run(redis.url, str(synthetic_dataset(base / "10k.jsonl", 10_000)), "p10k")
        big = run(redis.url, str(synthetic_dataset(base / "100k.jsonl", 100_000)), "p100k")
    finally:
        redis.stop()
    report("producer (c): enqueue, one process", [
        ("10k prompts", f"{small['enqueued'] / small['seconds']:.0f} tasks/s, peak RSS {small['peak_rss_mb']:.0f} MB"),
        ("100k prompts", f"{big['enqueued'] / big['seconds']:.0f} tasks/s, peak RSS {big['peak_rss_mb']:.0f} MB"),
        ("peak memory 100k / 10k", f"{big['peak_rss_mb'] / small['peak_rss_mb']:.2f}  (flat = 1.0)"),
    ])
    return {"small": small, "big": big}


if __name__ == "__main__":
    main()
