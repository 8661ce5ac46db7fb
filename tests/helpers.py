"""The local stack the integration tests run on (real redis-server, simulator and Celery workers)."""

from eagle3q.local import LocalStack as Stack

__all__ = ["Stack"]
