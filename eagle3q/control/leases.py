"""Keep the messages a live worker holds from being redelivered, however long their tasks run.

kombu's Redis transport redelivers a message whose score in the `unacked_index` sorted set (its delivery time) is
older than the visibility timeout. Alone, that forces a bad choice: a timeout above the longest task (hours, and a
worker that dies leaves its prompts stalled that long) or a short one (a live long generation runs twice). Every
worker refreshes the score of each message it holds (running, reserved, or waiting for a retry countdown) every
`visibility_timeout / 4` seconds, at most 60 s. The timeout can then be short: a dead worker's messages come back
within minutes, a live worker's never.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from eagle3q.periodic import Periodic


def refresh_interval_s(visibility_timeout_s: float) -> float:
    return max(0.5, min(visibility_timeout_s / 4, 60.0))


def refresh(client: redis.Redis, index_key: str, tags: list[str], now: float | None = None) -> int:
    """Move the delivery time of `tags` to now. XX: a tag acknowledged meanwhile is not added back."""
    if not tags:
        return 0
    now = time.time() if now is None else now
    return int(client.zadd(index_key, {t: now for t in tags}, xx=True, ch=True))


def lease_keeper(client: redis.Redis, index_key: str, held: Callable[[], list[str]], every_s: float) -> Periodic:
    """Not started: the worker's bootstep starts it, and stops it at shutdown."""
    return Periodic("eagle3q-leases", every_s, lambda: refresh(client, index_key, held()))
