"""The GPU consumer: `eagle3q worker hidden_states` (solo pool, one task at a time, the target loaded once).

torch is imported when the first task arrives, not at module import: the inference role imports this module too
(one app, one routing table) and must stay torch-free."""

from __future__ import annotations

import logging

from eagle3q.celery_app import TASK_EXTRACT, TASK_TRAIN, app
from eagle3q.config import get_settings
from eagle3q.schemas import RunRef, SampleRef
from eagle3q.store import StoreError
from workers.common import RefusedPayload, parse_payload, retry_store_error, retry_unexpected

log = logging.getLogger("eagle3q.workers.hidden_states")
_ctx = None


def _fire_train(run: str) -> None:
    app.send_task(TASK_TRAIN, args=[RunRef(run=run).model_dump()])


def context():  # noqa: ANN201
    global _ctx
    if _ctx is None:
        from eagle3q.hidden_stage import HiddenContext
        from eagle3q.hidden_states import TransformersExtractor
        from eagle3q.ledger import Ledger
        from eagle3q.store import Store

        s = get_settings()
        if not s.target_model:
            raise RuntimeError("EAGLE3Q_TARGET_MODEL is not set: the hidden-state worker needs the target model")
        extractor = TransformersExtractor(s.target_model, s.aux_layer_ids, s.device, s.dtype)
        log.info("target %s loaded: L=%d H=%d aux ids %s (vLLM convention)", s.target_model, extractor.num_layers,
                 extractor.hidden_size, extractor.aux_ids)
        _ctx = HiddenContext(Store(s.store_dir), Ledger.from_url(s.broker_url()), extractor, s.token_budget,
                             _fire_train)
    return _ctx


@app.task(name=TASK_EXTRACT, bind=True, max_retries=None)
def extract(self, payload: dict) -> str:  # noqa: ANN001
    try:
        ref = parse_payload(SampleRef, payload)
    except RefusedPayload as e:
        return f"refused: {e}"
    from eagle3q.hidden_stage import run_extract

    ctx = context()
    try:
        return run_extract(ref, ctx)
    except StoreError as e:
        raise retry_store_error(self, ctx.ledger, ref.run, ref.sample_id, "hidden_states", e) from None
    except Exception as e:  # noqa: BLE001
        raise retry_unexpected(self, ctx.ledger, ref.run, ref.sample_id, "hidden_states", e) from None
