"""The store: the one I/O seam of a run's artifacts (eagle3q.store.run_store), on a directory or an S3 bucket
(eagle3q.store.blobs), with the hidden-state object's format (eagle3q.store.hidden_format, eagle3q.store.fp8)."""

from eagle3q.store.blobs import LocalBlobs, S3Blobs, S3Options, StoreError, open_blobs, write_atomic
from eagle3q.store.records import Rejection, Sample
from eagle3q.store.run_store import Store

__all__ = ["LocalBlobs", "Rejection", "S3Blobs", "S3Options", "Sample", "Store", "StoreError", "open_blobs",
           "write_atomic"]
