"""A local stack for integration tests: real redis-server, the real simulator and real Celery worker processes."""

from __future__ import annotations

import time
from pathlib import Path

from eagle3q.celery_app import make_app
from eagle3q.config import Settings
from eagle3q.ledger import Ledger
from eagle3q.local import Proc, RedisServer, start_sim, start_worker, wait_worker_ready
from eagle3q.producer import EnqueueReport, enqueue
from eagle3q.store import Store


class Stack:
    def __init__(self, tmp: Path, tiny: Path, sim_args: list[str] | None = None, password: str | None = None,
                 env: dict[str, str] | None = None, sims: int = 1):
        self.tmp, self.tiny = tmp, tiny
        self.redis = RedisServer(tmp / "redis", password=password).start()
        self.sims: list[Proc] = []
        urls = []
        for _ in range(sims):
            proc, url = start_sim(str(tiny), tmp / "logs", extra=["--ttft", "0.005", "--itl", "0.0002",
                                                                  *(sim_args or [])])
            self.sims.append(proc)
            urls.append(url)
        self.sim_urls = urls
        self.env = {
            "EAGLE3Q_REDIS_URL": self.redis.url,
            "EAGLE3Q_VLLM_BASE_URLS": ",".join(urls),
            "EAGLE3Q_TOKENIZER": str(tiny),
            "EAGLE3Q_TARGET_MODEL": str(tiny),
            "EAGLE3Q_STORE_DIR": str(tmp / "store"),
            "EAGLE3Q_BACKOFF_BASE_S": "0.05",
            "EAGLE3Q_BACKOFF_MAX_S": "0.5",
            "EAGLE3Q_REQUEST_TIMEOUT_S": "5",
            "EAGLE3Q_MAX_TOKENS": "4096",
            "EAGLE3Q_TOKEN_BUDGET": "4096",
            "EAGLE3Q_DRAFT_VOCAB_SIZE": "512",
        }
        if password:
            self.env["EAGLE3Q_REDIS_PASSWORD"] = password
        self.env.update(env or {})
        self.settings = Settings(**{k[len("EAGLE3Q_"):].lower(): v for k, v in self.env.items()})
        self.app = make_app(self.settings)
        self.ledger = Ledger.from_url(self.settings.broker_url())
        self.store = Store(self.settings.store_dir)
        self.workers: list[Proc] = []

    def worker(self, role: str = "inference", concurrency: int = 8, wait: bool = True, **env: str) -> Proc:
        p = start_worker(role, {**self.env, **env}, self.tmp / "logs", concurrency=concurrency)
        self.workers.append(p)
        if wait:
            wait_worker_ready(p)
        return p

    def enqueue(self, dataset: Path, run: str, **kw) -> EnqueueReport:  # noqa: ANN003
        return enqueue(self.app, self.ledger, self.settings, dataset, run, **kw)

    def wait_settled(self, run: str, stages: tuple[str, ...] = ("inference",), timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            counts = [self.ledger.counts(run, s) for s in stages]
            if all(c.pending == 0 and c.incoming > 0 for c in counts):
                return
            time.sleep(0.2)
        raise AssertionError(f"run {run} not settled: {[self.ledger.counts(run, s) for s in stages]}\n"
                             + "\n".join(w.log.read_text()[-2000:] for w in self.workers))

    def close(self) -> None:
        for p in [*self.workers, *self.sims]:
            p.kill()
        self.redis.stop()
