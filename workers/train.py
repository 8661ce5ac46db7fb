"""The trainer: `eagle3q worker train`. Runs the vocab mapping and the draft training once per run.

Exactly once: the task is sent only by the ledger's `SET fired NX`; a redelivered copy (worker lost mid-training)
resumes from the last checkpoint, and one arriving after the export finds it and does nothing."""

from __future__ import annotations

import logging

from eagle3q.celery_app import TASK_TRAIN, app
from eagle3q.config import get_settings
from eagle3q.schemas import RunRef
from workers.common import RefusedPayload, parse_payload

log = logging.getLogger("eagle3q.workers.train")


@app.task(name=TASK_TRAIN, bind=True, max_retries=None)
def train(self, payload: dict) -> str:  # noqa: ANN001
    try:
        ref = parse_payload(RunRef, payload)
    except RefusedPayload as e:
        return f"refused: {e}"
    from eagle3q.ledger import Ledger
    from eagle3q.store import Store
    from eagle3q.train import TrainingBusy, train_run

    s = get_settings()
    ledger = Ledger.from_url(s.broker_url())
    try:
        result = train_run(ref.run, s, Store(s.store_dir), ledger)
    except TrainingBusy as e:
        # A duplicate delivery while another trainer works on the run: come back later (the lease tells whether the
        # other one is still alive), never train twice at once.
        log.info("%s; retrying in 60 s", e)
        raise self.retry(countdown=60, exc=e) from None
    except Exception as e:
        # Shown in `eagle3q status`, and the lost-message sweep leaves a failed run alone (`eagle3q train` reruns it).
        ledger.set_train_progress(ref.run, state="failed", error=f"{type(e).__name__}: {e}"[:500])
        raise
    return result.summary()
