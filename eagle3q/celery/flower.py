"""Flower's queue list, made to show every queue of the pipeline.

Flower 2 lists the queues that running workers consume and falls back to the app's declared queues only when no
worker answers, so with only inference workers up the hidden-state and training queues vanish from its Broker page
(and from its queue-length metrics) however many messages they hold. This puts the declared queues beside the active
ones. Flower has no plugin hook; its handlers are already imported when Celery's CLI loads its sub-commands, so the
`-A workers` app patches them here and `celery -A workers flower` needs nothing else.
"""

from __future__ import annotations

import sys


def show_declared_queues() -> bool:
    """Patch Flower's handlers if Flower is loaded (a worker process has it imported too: harmless there). True
    when the patch is in place."""
    views = sys.modules.get("flower.views")
    if views is None:
        return False
    base = views.BaseHandler
    if getattr(base, "_eagle3q_declared_queues", False):
        return True
    active = base.get_active_queue_names

    def get_active_queue_names(self) -> list[str]:  # noqa: ANN001
        declared = {q.name for q in self.capp.conf.task_queues or [] if q.name}
        return sorted(set(active(self)) | declared)

    base.get_active_queue_names = get_active_queue_names
    base._eagle3q_declared_queues = True
    return True
