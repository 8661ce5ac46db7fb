"""Celery consumers, one module per role. Thin: the work is done by the eagle3q library."""
