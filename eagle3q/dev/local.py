"""Local processes for the demo, the tests and the benchmarks: a redis-server on a free port, the simulator, and
Celery workers, each a real process that can be killed and restarted."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from eagle3q.celery.app import make_app
from eagle3q.config import Settings
from eagle3q.control.ledger import Ledger
from eagle3q.store import Store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout_s: float, what: str, every_s: float = 0.1) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001, S110 - not up yet
            pass
        time.sleep(every_s)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s")


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if not path:
        raise RuntimeError("redis-server not found: install it (apt-get install redis-server)")
    return path


@dataclass
class RedisServer:
    workdir: Path
    password: str | None = None
    appendonly: bool = True
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--maxmemory-policy", "noeviction",
            "--logfile", str(self.workdir / "redis.log"),
        ]
        # The password goes in through stdin ("-": read config from it): on the command line, `ps` would show it.
        args.insert(1, "-")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        assert self.proc.stdin is not None
        if self.password:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')  # redis.conf's quoting
            self.proc.stdin.write(f'requirepass "{quoted}"\n'.encode())
        self.proc.stdin.close()
        client = redis.Redis(port=self.port, password=self.password)
        wait_until(client.ping, 20, "redis-server")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def restart(self, down_s: float = 1.0, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        time.sleep(down_s)
        self.start()


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment plus `extra`: children run this interpreter, which has eagle3q installed."""
    env = dict(os.environ)
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def spawn(name: str, args: list[str], env: dict[str, str], logdir: Path) -> Proc:
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"{name}.log"
    f = log.open("ab")
    proc = subprocess.Popen(args, env=child_env(env), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(name, proc, log)


def start_sim(tokenizer: str, logdir: Path, env: dict[str, str] | None = None, port: int | None = None,
              extra: list[str] | None = None) -> tuple[Proc, str]:
    port = port or free_port()
    args = [sys.executable, "-m", "eagle3q.cli", "sim", "--tokenizer", tokenizer, "--port", str(port), *(extra or [])]
    proc = spawn(f"sim-{port}", args, env or {}, logdir)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{base}/health", timeout=1).status_code == 200, 60, "simulator")
    return proc, f"{base}/v1"


def start_worker(role: str, env: dict[str, str], logdir: Path, concurrency: int = 4, name: str | None = None,
                 extra: list[str] | None = None) -> Proc:
    name = name or f"{role}-{free_port()}"
    args = [sys.executable, "-m", "eagle3q.cli", "worker", role, "-c", str(concurrency), "--name", name,
            *(extra or [])]
    return spawn(name, args, env, logdir)


def wait_worker_ready(proc: Proc, timeout_s: float = 90) -> None:
    def ready() -> bool:
        if not proc.alive():
            raise RuntimeError(f"worker {proc.name} exited: {proc.log.read_text()[-3000:]}")
        return "ready." in proc.log.read_text(errors="replace")

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"worker {proc.name} not ready: {proc.log.read_text()[-3000:]}")


def settings_from_env(env: dict[str, str]) -> Settings:
    """The Settings a worker started with `env` will see (values given here win over this process's environment)."""
    return Settings(**{k[len("EAGLE3Q_"):].lower(): v for k, v in env.items() if k.startswith("EAGLE3Q_")})


class LocalStack:
    """redis-server + simulator(s) + workers on this machine, with the settings to reach them."""

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
        if sims and "--target-model" not in (sim_args or []):
            # The word bank's text is not the target's: the hidden-state consistency check would reject it all.
            self.env["EAGLE3Q_HS_CHECK_POSITIONS"] = "0"
        if password:
            self.env["EAGLE3Q_REDIS_PASSWORD"] = password
        self.env.update(env or {})
        self.settings = settings_from_env(self.env)
        self.app = make_app(self.settings)
        self.ledger = Ledger.from_url(self.settings.broker_url())
        # The broker's own keys (queue lists, kombu's unacked hash), for tests that inspect or damage them.
        self.broker = redis.Redis.from_url(self.settings.broker_url(), decode_responses=True)
        self.store = Store.from_settings(self.settings)
        self.workers: list[Proc] = []

    def worker(self, role: str = "inference", concurrency: int = 8, wait: bool = True, **env: str) -> Proc:
        p = start_worker(role, {**self.env, **env}, self.tmp / "logs", concurrency=concurrency)
        self.workers.append(p)
        if wait:
            wait_worker_ready(p)
        return p

    def enqueue(self, dataset: Path, run: str, **kw):  # noqa: ANN003, ANN201
        from eagle3q.producer import enqueue

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
