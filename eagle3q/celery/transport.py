"""kombu's Redis transport, with one change: an item on a queue list that is not a kombu message (garbage, a
truncated write, another application's data) is moved aside instead of killing the consumer.

kombu decodes each BRPOP reply in `Channel._brpop_read`; a JSONDecodeError there is an "unrecoverable error" and
the worker process exits, so one bad item kills one worker after another (a restart policy only hides it). Here the
item is pushed to the queue's dead-letter list (`eagle3q.control.dead_letters`), logged with its queue, counted,
and the worker goes on. `eagle3q status` shows the dead letters.

Selected for `redis://` and `rediss://` URLs by `use_for_redis_urls` (called by `make_app`), not by Celery's
`broker_transport` option: with that option the connection's URL becomes `eagle3q.celery.transport:Transport://...`
and tools that read the scheme (Flower's Broker page and queue lengths) no longer recognise Redis.
"""

from __future__ import annotations

import logging
from queue import Empty

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from celery import Celery
from eagle3q.control.dead_letters import set_aside

log = logging.getLogger("eagle3q.transport")


class Channel(kombu_redis.Channel):
    def _decode_or_set_aside(self, queue: str, item: bytes | str) -> dict | None:
        raw = bytes_to_str(item)
        try:
            message = loads(raw)
            self.Message(message, channel=self)  # what the consumer will build: fails on a non-message too
            return message
        except Exception as e:  # noqa: BLE001 - anything that is not a message of ours is set aside, never fatal
            why = f"{type(e).__name__}: {e}"[:200]
            try:
                set_aside(self.client, queue, raw, why)
            except Exception as err:  # noqa: BLE001 - Redis down: the item is dropped, but the worker lives
                log.error("could not set aside a bad item from queue %s: %s", queue, err)
            log.error("set aside an item on queue %s that is not a message (%s): %r", queue, why, raw[:120])
            return None

    def _brpop_read(self, **options):  # noqa: ANN003, ANN202 - kombu's signature; its body, decode guarded
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # a ConnectionError: disconnect so that the next iteration reconnects
                self.client.connection.disconnect()
                raise
            if not dest__item:
                raise Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            message = self._decode_or_set_aside(dest, item)
            if message is None:
                raise Empty()
            self.connection._deliver(message, dest)
            return True
        finally:
            self._in_poll = None
            flush = getattr(self, "_flush_brpop_reauth", None)  # kombu >= 5.7
            if flush is not None:
                flush()


class Transport(kombu_redis.Transport):
    Channel = Channel


ALIAS = f"{__name__}:Transport"


def use_for_redis_urls() -> None:
    """`redis://` and `rediss://` connections made in this process use this transport (kombu's alias table)."""
    from kombu import transport

    for scheme in ("redis", "rediss"):
        transport.TRANSPORT_ALIASES[scheme] = ALIAS


def broker_key(a: Celery, name: str, option: str | None = None) -> str:
    """The Redis key kombu uses for `name` (a queue, or "unacked" renamed by the transport option `option`), with
    the transport's global key prefix."""
    opts = a.conf.broker_transport_options or {}
    return opts.get("global_keyprefix", "") + (opts.get(option, name) if option else name)
