"""The Celery app: `make_app(settings)` builds one; nothing is built at import time.

Producers and tests make an app without tasks (they only send, by name); workers load `workers` (`celery -A workers
worker ...`), whose app has the tasks and the worker services (`eagle3q.celery.bootsteps`). No torch here.
"""

from __future__ import annotations

import sys

from kombu import Queue

from celery import Celery
from celery.apps.worker import Worker
from eagle3q.celery.transport import use_for_redis_urls
from eagle3q.config import Settings
from eagle3q.contract import INFERENCE, QUEUES, ROLES, ROUTES, role_for_queues

WORKER_APP = "workers"  # the `-A` target: the top-level package `workers` holds the worker app


def celery_config(s: Settings) -> dict:
    return {
        # Served by kombu's Redis transport, except that an item that is not a message is set aside instead of
        # killing the consumer (eagle3q.celery.transport, installed by make_app).
        "broker_url": s.broker_url(),
        "result_backend": None,
        "task_ignore_result": True,
        # JSON only: a pickle message is refused by every worker.
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        # A task is acknowledged after it ran; a worker that dies mid-task leaves it to be redelivered.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # The inference role's multiplier (threads); GPU roles reserve one message (`RoleWorker`).
        "worker_prefetch_multiplier": s.prefetch_multiplier,
        "broker_transport_options": {
            "visibility_timeout": s.visibility_timeout_s,
            "unacked_restore_interval": s.restore_sweep_s,
            "unacked_restore_throttle": 1,
        },
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,  # keep trying while Redis restarts
        # Publishing (the producer, hand-offs to the next stage, retries) rides out a Redis restart too: about five
        # minutes of backoff before a publish gives up.
        "task_publish_retry": True,
        "task_publish_retry_policy": {"max_retries": 60, "interval_start": 0.2, "interval_step": 0.5,
                                      "interval_max": 5},
        "broker_pool_limit": max(16, s.inflight_max),
        # Every queue declared, so that Flower and `celery inspect` know them before any worker consumes them.
        "task_queues": [Queue(q, routing_key=q) for q in QUEUES],
        "task_routes": ROUTES,
        "task_default_queue": INFERENCE.queue,
        "worker_send_task_events": s.task_events,
        # Workers send task events (-E) for Flower; the producer's extra "sent" event per task would halve the
        # enqueue rate for a state Flower does not need.
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def make_app(s: Settings, worker: bool = False) -> Celery:
    """A Celery app for these settings. Producers (and tests) that talk to several brokers make one each: an app
    keeps its connection pool for the broker it first used. `worker=True`: with the tasks and worker services."""
    use_for_redis_urls()
    a = Celery("eagle3q", set_as_current=False)
    a.conf.update(celery_config(s))
    # Kept off the config (which `celery inspect conf` shows): the key every send of this app signs with.
    a.eagle3q_signing_key = s.task_signing_key.get_secret_value().encode() if s.task_signing_key else None
    if worker:
        from eagle3q.celery.bootsteps import install
        from eagle3q.celery.tasks import register

        register(a)
        install(a, s)
        a.Worker = a.subclass_with_self(RoleWorker)  # the program `celery worker` runs for this app
    return a


def _queue_names(queues: object) -> list[str]:
    if isinstance(queues, str):
        return [q.strip() for q in queues.split(",") if q.strip()]
    return [str(q) for q in queues or []]


class RoleWorker(Worker):
    """The worker program with the role's policy applied after Celery reads its options, whichever command started
    it (`eagle3q worker` or a plain `celery -A workers worker -Q hidden_states`): a GPU role runs one task at a time
    and reserves one message (Celery's CLI would pass the app's inference multiplier and the CPU count)."""

    def setup_defaults(self, queues: object = None, **kwargs: object) -> None:
        super().setup_defaults(queues=queues, **kwargs)
        role = role_for_queues(_queue_names(queues))
        if role is not None:
            self.prefetch_multiplier = role.prefetch_multiplier(int(self.prefetch_multiplier))
            if role.pool == "solo":
                self.concurrency = 1


def worker_args(role: str, concurrency: int | None, name: str | None, loglevel: str, default_threads: int) -> list[str]:
    """The celery command line of a role: its queue and pool, threads for inference, one task at a time for the GPU
    roles. Events (-E) and prefetch come from the app's config, so the plain command behaves the same."""
    r = ROLES[role]
    c = r.concurrency(concurrency, default_threads)
    return [sys.executable, "-m", "celery", "-A", WORKER_APP, "worker", "-Q", r.queue, "-P", r.pool,
            "-c", str(c), "--without-gossip", "--without-mingle", "-n", f"{name or role}@%h", "--loglevel", loglevel]
