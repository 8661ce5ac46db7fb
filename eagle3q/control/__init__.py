"""The Redis control plane: the ledger (counts, terminal marks, the training trigger), locks, message leases, the
shared in-flight budget and the lost-message sweep. The only package that builds Redis keys (`keys`) or holds the
client; no Celery import here (the sweep gets a send function and the broker's key names from its caller)."""

from __future__ import annotations

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


def connect(url: str, socket_timeout: float = 60) -> redis.Redis:
    """A client whose commands retry through a Redis restart (about five minutes of backoff) instead of failing."""
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        health_check_interval=30,
        socket_connect_timeout=5,
        socket_timeout=socket_timeout,
        retry=Retry(ExponentialBackoff(cap=5.0, base=0.2), 60),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )
