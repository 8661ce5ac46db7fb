"""Leases in Redis that one holder at a time owns: the trainer's run lock."""

from __future__ import annotations

import os
import time

from eagle3q.control import keys
from eagle3q.control.ledger import Ledger
from eagle3q.periodic import Periodic

# Release only one's own lease (a holder whose lease ran out must not delete its successor's).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class TrainingBusy(RuntimeError):
    """Another trainer holds this run's lock (a duplicate delivery while the first is still training)."""


class RunLock:
    """A lease in Redis, renewed while its holder lives (a background renewal every third of the lease, whatever
    the holder is doing: counting the vocabulary over 10k files or a long step): a duplicate task waits instead of
    training a second time; a trainer that dies stops renewing, and the redelivered task takes over once the lease
    ends. Without a ledger (training by hand on files) it does nothing."""

    def __init__(self, ledger: Ledger | None, run: str, ttl_s: int = 120):
        self.r = ledger.client if ledger is not None else None
        self.ttl_s = max(1, int(ttl_s))
        self.key = keys.train_lock(run)
        self.token = f"{os.getpid()}-{time.time()}"
        self._renewal = Periodic(f"eagle3q-lock-{run}", self.ttl_s / 3, self.renew)

    def __enter__(self) -> RunLock:
        if self.r is not None:
            if not self.r.set(self.key, self.token, nx=True, ex=self.ttl_s):
                raise TrainingBusy(f"{self.key} is held by {self.r.get(self.key)}")
            self._renewal.start()
        return self

    def renew(self) -> None:
        """Extend one's own lease (a lease already lost to another holder stays theirs)."""
        if self.r is not None:
            self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_s)

    def __exit__(self, *exc: object) -> None:
        self._renewal.stop()
        if self.r is not None:
            self.r.eval(_RELEASE, 1, self.key, self.token)

    @staticmethod
    def held(ledger: Ledger, run: str) -> bool:
        return bool(ledger.client.exists(keys.train_lock(run)))

    @staticmethod
    def holder(ledger: Ledger, run: str) -> str | None:
        return ledger.client.get(keys.train_lock(run))
