"""Items found on a queue list that are not messages, kept aside with why (never executed, never lost silently)."""

from __future__ import annotations

import json
import time

import redis

from eagle3q.control import keys

KEEP = 10_000  # newest items kept per queue; the count goes on


def set_aside(client: redis.Redis, queue: str, raw: str, why: str) -> None:
    entry = json.dumps({"queue": queue, "why": why, "at": time.time(), "raw": raw[:100_000]})
    p = client.pipeline()
    p.lpush(keys.dead_letters(queue), entry)
    p.ltrim(keys.dead_letters(queue), 0, KEEP - 1)
    p.hincrby(keys.DEAD_LETTER_COUNTS, queue, 1)
    p.execute()


def counts(client: redis.Redis) -> dict[str, int]:
    return {bytes_to_str(k): int(v) for k, v in client.hgetall(keys.DEAD_LETTER_COUNTS).items()}


def bytes_to_str(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
