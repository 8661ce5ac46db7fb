"""Several vLLM endpoints behind one consumer: each request goes to the healthy endpoint with the least load, an
endpoint that fails to connect is set aside and comes back once its `/health` answers again."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass
class Endpoint:
    url: str
    in_flight: int = 0
    waiting: float = 0.0  # vllm:num_requests_waiting at the last poll (all clients' load, not only ours)
    down_until: float = 0.0
    failures: int = 0


class EndpointPool:
    def __init__(self, urls: list[str], cooldown_s: float = 5.0, fail_threshold: int = 2):
        if not urls:
            raise ValueError("no vLLM endpoint configured (EAGLE3Q_VLLM_BASE_URLS)")
        self.endpoints = [Endpoint(u.rstrip("/")) for u in urls]
        self.cooldown_s = cooldown_s
        self.fail_threshold = fail_threshold
        self._lock = threading.Lock()
        self._rr = 0

    def acquire(self) -> str:
        """The endpoint to use now (least waiting + in flight); all down means try the one back soonest."""
        now = time.monotonic()
        with self._lock:
            up = [e for e in self.endpoints if e.down_until <= now]
            if up:
                self._rr += 1
                n = len(up)
                # rotate before taking the minimum so that ties spread evenly
                order = up[self._rr % n :] + up[: self._rr % n]
                ep = min(order, key=lambda e: e.waiting + e.in_flight)
            else:
                ep = min(self.endpoints, key=lambda e: e.down_until)
            ep.in_flight += 1
            return ep.url

    def release(self, url: str, ok: bool, connect_failed: bool = False) -> None:
        with self._lock:
            ep = next(e for e in self.endpoints if e.url == url)
            ep.in_flight -= 1
            if ok:
                ep.failures = 0
            elif connect_failed:
                ep.failures += 1
                if ep.failures >= self.fail_threshold:
                    ep.down_until = time.monotonic() + self.cooldown_s

    def probe(self, http: httpx.Client) -> None:
        """Poll `/health` and `/metrics` of every endpoint (run from a background thread)."""
        for ep in self.endpoints:
            root = ep.url[:-3] if ep.url.endswith("/v1") else ep.url
            try:
                healthy = http.get(f"{root}/health", timeout=2.0).status_code == 200
                waiting = parse_waiting(http.get(f"{root}/metrics", timeout=2.0).text) if healthy else 0.0
            except httpx.HTTPError:
                healthy, waiting = False, 0.0
            with self._lock:
                ep.waiting = waiting
                if healthy and ep.down_until > time.monotonic():
                    ep.down_until, ep.failures = 0.0, 0
                elif not healthy:
                    ep.down_until = time.monotonic() + self.cooldown_s


class ServerTooOld(RuntimeError):
    """The endpoint's vLLM cannot serve the profile: every sample would be wrong, so none is attempted."""


def parse_version(text: str) -> tuple[int, int, int] | None:
    """'0.17.0', 'v0.15.1rc1', '0.11.0+cu128' -> (major, minor, patch); None when not a version."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def check_version(http: httpx.Client, base_url: str, minimum: tuple[int, int, int], profile: str) -> str | None:
    """GET <server>/version; raise ServerTooOld below `minimum`. Returns the version, "" when the server answered
    without one (a proxy in front: the requests themselves tell), None when it could not be reached (ask again)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = http.get(root + "/version", timeout=10)
    except httpx.HTTPError:  # not reachable now: no verdict, ask again with the next task
        return None
    try:
        data = r.json() if r.status_code == 200 else {}
    except ValueError:  # answered, not JSON (a proxy's page)
        data = {}
    version = str(data.get("version", "")) if isinstance(data, dict) else ""
    parsed = parse_version(version)
    if parsed is not None and parsed < minimum:
        need = ".".join(map(str, minimum))
        raise ServerTooOld(f"vLLM {version} at {base_url} is older than {need}, the oldest that serves profile "
                           f"{profile} right (the model, its reasoning parser, return_token_ids): upgrade the server "
                           "(docker-compose.yml pins v0.17.0)")
    return version


def parse_gauge(text: str, name: str) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in "{ "):
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except (IndexError, ValueError):
                continue
    return total if found else 0.0


def parse_waiting(text: str) -> float:
    return parse_gauge(text, "vllm:num_requests_waiting")
