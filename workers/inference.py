"""The inference consumer: `celery -A eagle3q.celery_app worker -Q inference -P threads -c N`.

Light on purpose: no torch import, so consumers start fast and scale out on CPU machines."""

from __future__ import annotations

import logging
import threading

from eagle3q.celery_app import TASK_EXTRACT, TASK_GENERATE, app
from eagle3q.config import get_settings
from eagle3q.inference import InferenceContext, build_context, reject_exhausted, run_inference
from eagle3q.schemas import InferenceTask, SampleRef
from eagle3q.store import StoreError
from eagle3q.vllm_client import TransientError, backoff_s
from workers.common import RefusedPayload, parse_payload, retry_store_error, retry_unexpected

log = logging.getLogger("eagle3q.workers.inference")
_ctx: InferenceContext | None = None
_ctx_lock = threading.Lock()


def _forward(run: str, sample_id: str) -> None:
    app.send_task(TASK_EXTRACT, args=[SampleRef(run=run, sample_id=sample_id).model_dump()],
                  argsrepr=f"{run}/{sample_id}", kwargsrepr="{}")


def context() -> InferenceContext:
    """Built once per worker process (tokenizer, HTTP pool, Redis) and shared by its threads."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            s = get_settings()
            _ctx = build_context(s, _forward, concurrency=s.inflight_max)
        return _ctx


@app.task(name=TASK_GENERATE, bind=True, max_retries=None)
def generate(self, payload: dict) -> str:  # noqa: ANN001
    try:
        task = parse_payload(InferenceTask, payload)
    except RefusedPayload as e:
        return f"refused: {e}"
    ctx = context()
    s = ctx.settings
    try:
        return run_inference(task, ctx)
    except TransientError as e:
        if self.request.retries >= s.max_retries:
            reject_exhausted(ctx, task, e)
            return f"rejected:retries_exhausted_{e.kind}"
        ctx.ledger.incr(task.run, "inference", f"retry_{e.kind}")
        delay = backoff_s(self.request.retries, s.backoff_base_s, s.backoff_max_s)
        log.warning("%s/%s: %s; retry %d in %.1fs", task.run, task.sample_id, e.kind, self.request.retries + 1, delay)
        raise self.retry(countdown=delay, exc=e) from None
    except StoreError as e:
        raise retry_store_error(self, ctx.ledger, task.run, task.sample_id, "inference", e) from None
    except Exception as e:  # noqa: BLE001
        raise retry_unexpected(self, ctx.ledger, task.run, task.sample_id, "inference", e) from None
