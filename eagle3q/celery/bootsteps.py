"""The worker services, as Celery bootsteps with a start and a stop (they end with the worker instead of running on
as daemon threads):

- `MessageLeases` (consumer step): refreshes the delivery time of every message this worker holds, so the
  visibility timeout bounds how long a dead worker's messages wait, not how long a task may run
  (`eagle3q.control.leases`). A consumer step: a reconnect stops and starts it with the new channel.
- `WorkerServices` (worker step): the stages' contexts built before the first task, or the worker refuses to
  start with the cause, also in `status` (`eagle3q.celery.tasks.warm_contexts`); the lost-message sweep
  (`eagle3q.control.reconcile`), the Prometheus exporter (`EAGLE3Q_METRICS_PORT`), and at shutdown the stages'
  per-process contexts (the endpoint prober among them).
"""

from __future__ import annotations

import contextlib
import logging

from celery import Celery, bootsteps
from eagle3q.celery.transport import broker_key
from eagle3q.config import Settings
from eagle3q.contract import send_again
from eagle3q.control import connect
from eagle3q.control.leases import lease_keeper, refresh_interval_s
from eagle3q.control.ledger import Ledger
from eagle3q.control.reconcile import Reconciler, sweeper
from eagle3q.metrics import METRICS
from eagle3q.periodic import Periodic

log = logging.getLogger("eagle3q.bootsteps")


def held_tags(consumer) -> list[str]:  # noqa: ANN001 - Celery's worker consumer
    """Delivery tags of every message this worker holds and has not acknowledged (kombu's QoS bookkeeping; the
    channel is looked up each time because a reconnect replaces it)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    qos = getattr(getattr(task_consumer, "channel", None), "qos", None)
    delivered = getattr(qos, "_delivered", None) or {}
    return [str(tag) for tag in list(delivered)]


class MessageLeases(bootsteps.StartStopStep):
    requires = ("celery.worker.consumer.tasks:Tasks",)
    settings: Settings

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001, ANN003
        super().__init__(parent, **kwargs)
        self.keeper: Periodic | None = None

    def start(self, c) -> None:  # noqa: ANN001 - the consumer
        s = self.settings
        every_s = refresh_interval_s(s.visibility_timeout_s)
        index_key = broker_key(c.app, "unacked_index", "unacked_index_key")
        self.keeper = lease_keeper(connect(s.broker_url(), socket_timeout=10), index_key, lambda: held_tags(c),
                                   every_s).start()
        log.info("held messages refreshed every %.1fs (visibility timeout %ds)", every_s, s.visibility_timeout_s)

    def stop(self, c) -> None:  # noqa: ANN001
        if self.keeper is not None:
            self.keeper.stop()
            self.keeper = None

    shutdown = stop


class WorkerServices(bootsteps.StartStopStep):
    settings: Settings

    def __init__(self, parent, **kwargs) -> None:  # noqa: ANN001, ANN003
        super().__init__(parent, **kwargs)
        self.sweep: Periodic | None = None
        self.metrics_server = None

    def start(self, w) -> None:  # noqa: ANN001 - the worker
        s, app = self.settings, w.app
        consumed = app.amqp.queues.consume_from  # None: every queue (no -Q)
        from eagle3q.celery.tasks import ContextError, warm_contexts

        role = f"{'+'.join(sorted(consumed)) if consumed else 'all'}@{w.hostname}"
        ledger = Ledger.from_url(s.broker_url())
        try:
            warm_contexts(app, list(consumed) if consumed else None)
        except ContextError as e:
            # Celery stops the worker on an exception here ("Unrecoverable error", exit 1); `status` shows why.
            log.critical("%s", e)
            with contextlib.suppress(Exception):
                ledger.worker_refused(role, str(e))
            raise
        with contextlib.suppress(Exception):
            ledger.worker_started(role)
        if s.metrics_port:
            self.metrics_server = METRICS.serve(s.metrics_port)
            log.info("worker metrics on :%d/metrics", s.metrics_port)
        if s.reconcile_period_s > 0:
            rec = Reconciler(Ledger.from_url(s.broker_url()), lambda *ref: send_again(app, *ref),
                             grace_s=s.reconcile_grace_s, scan_limit=s.reconcile_scan_limit,
                             queue_key=lambda queue: broker_key(app, queue),
                             unacked_key=broker_key(app, "unacked", "unacked_key"),
                             lock_s=s.reconcile_period_s * 0.8)
            self.sweep = sweeper(rec, s.reconcile_period_s).start()
            log.info("lost-message sweep every %.0fs (grace %.0fs)", s.reconcile_period_s, s.reconcile_grace_s)

    def stop(self, w) -> None:  # noqa: ANN001
        from eagle3q.celery.tasks import close_contexts

        if self.sweep is not None:
            self.sweep.stop()
            self.sweep = None
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server = None
        close_contexts()

    shutdown = stop


def install(app: Celery, s: Settings) -> None:
    """Add the services to `app`'s worker and consumer blueprints, bound to these settings."""
    app.steps["consumer"].add(type("MessageLeases", (MessageLeases,), {"settings": s}))
    app.steps["worker"].add(type("WorkerServices", (WorkerServices,), {"settings": s}))
