"""Read-ahead: the objects a consumer will need next, fetched on threads while it works on the current one.

The trainer knows its whole schedule in advance (the manifest, the seed and the step fix every batch), so it hands
the order of the samples it will read and takes them back one by one; `depth` bounds how many are held or in flight
(memory: depth x a sample's bytes). On a local disk this costs nothing; on an object store it turns a round trip per
sample into one that overlaps the model's forward and backward (bench/bench_store.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import TypeVar

T = TypeVar("T")

def read_ahead(fetch: Callable[[str], T], ids: Iterable[str], depth: int) -> Iterator[tuple[str, T]]:
    """(id, fetch(id)) in the order of `ids` (a lazy iterable is fine), at most `depth` fetched ahead. An error
    fetching one is raised when the consumer reaches it."""
    it = iter(ids)
    if depth <= 0:
        for sid in it:
            yield sid, fetch(sid)
        return
    pool = ThreadPoolExecutor(max_workers=min(depth, 16), thread_name_prefix="eagle3q-read-ahead")
    window: deque[tuple[str, Future[T]]] = deque()
    try:
        for sid in islice(it, depth):
            window.append((sid, pool.submit(fetch, sid)))
        while window:
            sid, fut = window.popleft()
            for nxt in islice(it, 1):
                window.append((nxt, pool.submit(fetch, nxt)))
            yield sid, fut.result()
    finally:
        for _, fut in window:
            fut.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
