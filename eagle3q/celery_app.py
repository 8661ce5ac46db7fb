"""The one Celery app and its routing table. Importable anywhere: no task runs, no torch is imported here."""

from __future__ import annotations

from celery import Celery

from eagle3q.config import Settings, get_settings

QUEUES = ("inference", "hidden_states", "train")
TASK_GENERATE = "eagle3q.inference.generate"
TASK_EXTRACT = "eagle3q.hidden_states.extract"
TASK_TRAIN = "eagle3q.train.train"
ROUTES = {
    TASK_GENERATE: {"queue": "inference"},
    TASK_EXTRACT: {"queue": "hidden_states"},
    TASK_TRAIN: {"queue": "train"},
}


def celery_config(s: Settings) -> dict:
    return {
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
        "worker_prefetch_multiplier": 1,
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
        "task_routes": ROUTES,
        "task_default_queue": "inference",
        "worker_send_task_events": True,
        # Workers send task events (-E) for Flower; the producer's extra "sent" event per task would halve the
        # enqueue rate for a state Flower does not need.
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def broker_key(a: Celery, name: str, option: str | None = None) -> str:
    """The Redis key kombu uses for `name` (a queue, or "unacked" renamed by the transport option `option`), with
    the transport's global key prefix."""
    opts = a.conf.broker_transport_options or {}
    return opts.get("global_keyprefix", "") + (opts.get(option, name) if option else name)


def make_app(s: Settings, include: bool = False) -> Celery:
    """A Celery app for these settings. Producers (and tests) that talk to several brokers make one each: an app
    keeps its connection pool for the broker it first used."""
    a = Celery("eagle3q", set_as_current=False,
               include=["workers.inference", "workers.hidden_states", "workers.train"] if include else None)
    a.conf.update(celery_config(s))
    return a


# The workers' app (`celery -A eagle3q.celery_app`), configured from the environment.
app = make_app(get_settings(), include=True)
