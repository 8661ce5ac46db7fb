"""A background loop with a stop: what the worker services (message leases, the lost-message sweep, the endpoint
prober) run in, so that a worker's shutdown ends them instead of leaving daemon threads behind."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

log = logging.getLogger("eagle3q.periodic")


class Periodic:
    def __init__(self, name: str, every_s: float, fn: Callable[[], object], jitter: float = 0.0,
                 first_at_start: bool = False):
        self.name, self.every_s, self.fn, self.jitter = name, every_s, fn, jitter
        self.first_at_start = first_at_start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _wait(self) -> bool:
        """Sleep one period (with jitter, so that workers started together do not act in step); False once stopped."""
        j = random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else 1.0  # noqa: S311 - not crypto
        return not self._stop.wait(self.every_s * j)

    def _loop(self) -> None:
        if not self.first_at_start and not self._wait():
            return
        while not self._stop.is_set():
            try:
                self.fn()
            except Exception as e:  # noqa: BLE001 - Redis or vLLM may be restarting; the next round tries again
                log.warning("%s failed: %s", self.name, e)
            if not self._wait():
                return

    def start(self) -> Periodic:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
