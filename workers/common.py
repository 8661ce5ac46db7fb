"""What every consumer role shares: refusing malformed payloads, and the worker-side metrics exporter."""

from __future__ import annotations

import contextlib
import logging
from typing import TypeVar

from celery.signals import worker_ready
from pydantic import BaseModel, ValidationError

from eagle3q.config import get_settings
from eagle3q.metrics import METRICS
from eagle3q.vllm_client import backoff_s

log = logging.getLogger("eagle3q.workers")
# One INFO line per HTTP request is noise at hundreds of requests per second (and costs the consumers time).
logging.getLogger("httpx").setLevel(logging.WARNING)
M = TypeVar("M", bound=BaseModel)


class RefusedPayload(Exception):
    pass


def parse_payload(model: type[M], payload: object) -> M:
    """Validate a message against its schema. A forged or malformed message is refused (logged, acknowledged, never
    executed), so it cannot loop through redelivery either."""
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        fields = sorted({".".join(str(p) for p in err["loc"]) for err in e.errors()})
        log.error("refused a %s message that fails validation (fields: %s)", model.__name__, ", ".join(fields))
        raise RefusedPayload(f"{model.__name__}: invalid fields {fields}") from None


def retry_store_error(task, ledger, run: str, sample_id: str, stage: str, err: Exception) -> Exception:  # noqa: ANN001
    """The store could not be written: infrastructure, not the sample's fault. Counted, logged loudly and retried
    with capped backoff for as long as it takes; the message is never acknowledged as done meanwhile."""
    s = get_settings()
    ledger.incr(run, stage, "store_errors")
    delay = backoff_s(min(task.request.retries, 8), s.backoff_base_s, s.backoff_max_s)
    log.error("%s/%s: store error %s; retry in %.1fs", run, sample_id, err, delay)
    return task.retry(countdown=delay, exc=err)


def retry_unexpected(task, ledger, run: str, sample_id: str, stage: str, err: Exception) -> Exception:  # noqa: ANN001
    """Anything else (a broker outage outlasting the publish retries, a bug): a failed task would be acknowledged and
    its prompt lost, so it is retried instead and stays "queued" in the counts, with the traceback in the log."""
    s = get_settings()
    log.exception("%s/%s: unexpected error in %s, retrying: %s", run, sample_id, stage, err)
    with contextlib.suppress(Exception):  # Redis itself may be what is down
        ledger.incr(run, stage, "task_errors")
    delay = backoff_s(min(task.request.retries, 8), s.backoff_base_s, s.backoff_max_s)
    return task.retry(countdown=delay, exc=err)


@worker_ready.connect
def _serve_metrics(**_: object) -> None:
    port = get_settings().metrics_port
    if port:
        METRICS.serve(port)
        log.info("worker metrics on :%d/metrics", port)


def _held_tags(consumer) -> list[str]:  # noqa: ANN001 - Celery's worker consumer
    """Delivery tags of every message this worker holds and has not acknowledged (kombu's QoS bookkeeping; the
    channel is looked up each time because a reconnect replaces it)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    qos = getattr(getattr(task_consumer, "channel", None), "qos", None)
    delivered = getattr(qos, "_delivered", None) or {}
    return [str(tag) for tag in list(delivered)]


@worker_ready.connect
def _keep_leases(sender=None, **_: object) -> None:  # noqa: ANN001 - the worker's consumer
    if sender is None:
        return
    import redis

    from eagle3q.celery_app import broker_key
    from eagle3q.leases import keep_leases, refresh_interval_s

    s = get_settings()
    index_key = broker_key(sender.app, "unacked_index", "unacked_index_key")
    every_s = refresh_interval_s(s.visibility_timeout_s)
    keep_leases(redis.Redis.from_url(s.broker_url(), socket_timeout=10), index_key, lambda: _held_tags(sender),
                every_s)
    log.info("held messages refreshed every %.1fs (visibility timeout %ds)", every_s, s.visibility_timeout_s)


@worker_ready.connect
def _start_reconciler(sender=None, **_: object) -> None:  # noqa: ANN001 - the worker's consumer
    s = get_settings()
    if s.reconcile_period_s <= 0 or sender is None:
        return
    from eagle3q.ledger import Ledger
    from eagle3q.reconcile import start_in_background

    start_in_background(sender.app, Ledger.from_url(s.broker_url()), s.reconcile_period_s, s.reconcile_grace_s,
                        s.reconcile_scan_limit)
    log.info("lost-message sweep every %.0fs (grace %.0fs)", s.reconcile_period_s, s.reconcile_grace_s)
