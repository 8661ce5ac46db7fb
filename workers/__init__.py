"""The entry point Celery loads: `celery -A workers worker -Q <queue> -P <pool> -c N` (what `eagle3q worker <role>`
runs), and `celery -A workers flower`. The app, its tasks and its services live in `eagle3q.celery`; this package
only builds the app from the environment's settings, so the library never imports its consumers."""

from eagle3q.celery.app import make_app
from eagle3q.celery.flower import show_declared_queues
from eagle3q.config import get_settings

app = make_app(get_settings(), worker=True)
show_declared_queues()  # Flower's Broker page lists every queue, not only those a running worker consumes
