"""The Celery tasks, one per stage, and their retry policy. Thin: each parses its payload (a malformed or forged
message is refused, never executed), gets its stage's per-process context and calls the stage module.

The inference role imports this module too (one app, one routing table) and must stay torch-free: the GPU stages'
heavy imports happen when their first task arrives.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from celery import Celery, Task
from eagle3q.config import get_settings
from eagle3q.contract import (
    HIDDEN_STATES,
    INFERENCE,
    TRAIN,
    InferenceTask,
    RunRef,
    SampleRef,
    Stage,
    send_extract,
    send_train,
    signature_ok,
)
from eagle3q.generate.endpoints import ServerTooOld
from eagle3q.generate.vllm_client import TransientError, backoff_s
from eagle3q.store import StoreError

log = logging.getLogger("eagle3q.tasks")
# One INFO line per HTTP request is noise at hundreds of requests per second (and costs the consumers time).
logging.getLogger("httpx").setLevel(logging.WARNING)
M = TypeVar("M", bound=BaseModel)


class RefusedPayload(Exception):
    pass


def parse_payload(model: type[M], payload: object, stage: Stage | None = None, sig: object = None) -> M:
    """Validate a message against its schema (and, with EAGLE3Q_TASK_SIGNING_KEY set, its signature). A forged or
    malformed message is refused (logged, acknowledged, never executed), so it cannot loop through redelivery."""
    key = get_settings().task_signing_key
    if key is not None and stage is not None and not signature_ok(key.get_secret_value().encode(), stage.task,
                                                                  payload, sig):
        log.error("refused a %s message: %s", model.__name__, "unsigned" if sig is None else "bad signature")
        raise RefusedPayload(f"{model.__name__}: not signed with this deployment's key")
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        fields = sorted({".".join(str(p) for p in err["loc"]) for err in e.errors()})
        log.error("refused a %s message that fails validation (fields: %s)", model.__name__, ", ".join(fields))
        raise RefusedPayload(f"{model.__name__}: invalid fields {fields}") from None


# --- retry policy ---------------------------------------------------------------------------------------------------


def _delay(task: Task) -> float:
    s = get_settings()
    return backoff_s(min(task.request.retries, 8), s.backoff_base_s, s.backoff_max_s)


def retry_store_error(task: Task, ledger, run: str, sample_id: str, stage: str, err: Exception) -> Exception:  # noqa: ANN001
    """The store could not be written: infrastructure, not the sample's fault. Counted, logged loudly and retried
    with capped backoff for as long as it takes; the message is never acknowledged as done meanwhile."""
    ledger.incr(run, stage, "store_errors")
    delay = _delay(task)
    log.error("%s/%s: store error %s; retry in %.1fs", run, sample_id, err, delay)
    return task.retry(countdown=delay, exc=err)


def retry_unexpected(task: Task, ledger, run: str, sample_id: str, stage: str, err: Exception,  # noqa: ANN001
                     reject=None) -> Exception | str:  # noqa: ANN001 - reject: (err) -> the rejection's result
    """Anything else (a broker outage outlasting the publish retries, a bug): a failed task would be acknowledged and
    its prompt lost, so it is retried instead and stays "queued" in the counts, with the traceback in the log. After
    EAGLE3Q_MAX_RETRIES the sample is rejected as `task_error` (`reject`), so a bug that fails every sample ends
    the run with a reason instead of re-sending its tasks for ever; while Redis itself is what fails, the rejection
    cannot be written either and the task keeps retrying."""
    log.exception("%s/%s: unexpected error in %s (try %d): %s", run, sample_id, stage, task.request.retries + 1, err)
    with contextlib.suppress(Exception):  # Redis itself may be what is down
        ledger.incr(run, stage, "task_errors")
    if reject is not None and task.request.retries >= get_settings().max_retries:
        try:
            return reject(err)
        except Exception as e:  # noqa: BLE001
            log.error("%s/%s: could not record the task_error rejection (%s): retrying", run, sample_id, e)
    return task.retry(countdown=_delay(task), exc=err)


# --- per-process contexts (built on the first task, closed by the worker's bootstep at shutdown) ---------------------

_contexts: dict[str, object] = {}
_contexts_lock = threading.Lock()


def _context(stage: str, build):  # noqa: ANN001, ANN202 - build: () -> the stage's context
    with _contexts_lock:
        if stage not in _contexts:
            _contexts[stage] = build()
        return _contexts[stage]


def close_contexts() -> None:
    with _contexts_lock:
        for ctx in _contexts.values():
            close = getattr(ctx, "close", None)
            if close is not None:
                close()
        _contexts.clear()


def _inference_context(app: Celery):  # noqa: ANN202
    from eagle3q.stages.inference import build_context

    s = get_settings()
    return build_context(s, lambda run, sid: send_extract(app, run, sid), concurrency=s.inflight_max,
                         fire_train=lambda run: send_train(app, run))


class ContextError(RuntimeError):
    """A worker cannot build what its stage needs (tokenizer, target model, store, profile): it refuses to start."""


def warm_contexts(app: Celery, queues: list[str] | None) -> None:
    """Build the contexts of the stages this worker consumes (`queues`; None: all) before it takes a task, and
    raise ContextError with the cause when one cannot be built: a consumer without its tokenizer or a hidden-state
    worker without its target would otherwise take every task, fail it and leave the sweep re-sending them for
    ever, with nothing in `status`. A generation server that is not up yet is not a reason: the inference
    consumer asks each endpoint once for its context length and version (measured: building all this on the first
    task, every thread asking the same two questions, put ~0.4 s before the first request of a run,
    bench_throughput.py) and a task that finds it down retries by name."""
    builders = {INFERENCE.queue: (INFERENCE.name, lambda: _inference_context(app)),
                HIDDEN_STATES.queue: (HIDDEN_STATES.name, lambda: _hidden_context(app)),
                TRAIN.queue: (TRAIN.name, lambda: _train_context())}
    for queue, (stage, build) in builders.items():
        if queues and queue not in queues:
            continue
        try:
            ctx = _context(stage, build)
        except Exception as e:  # noqa: BLE001
            raise ContextError(f"the {stage} worker cannot start: {type(e).__name__}: {e}") from e
        if stage == INFERENCE.name:
            for url in [e.url for e in ctx.endpoints.endpoints]:
                with contextlib.suppress(Exception):  # unreachable or too old: the task says so, by name
                    ctx.context_limit(url)
                    ctx.check_server(url, ctx.settings.profile)


def _train_context():  # noqa: ANN202 - the trainer builds its model per run; at start it proves the store works
    from eagle3q.store import Store

    store = Store.from_settings(get_settings())
    store.check()
    return store


def _hidden_context(app: Celery):  # noqa: ANN202
    from eagle3q.control.ledger import Ledger
    from eagle3q.extraction.transformers_backend import TransformersExtractor
    from eagle3q.stages.hidden_states import HiddenContext
    from eagle3q.store import Store

    s = get_settings()
    if not s.target_model:
        raise RuntimeError("EAGLE3Q_TARGET_MODEL is not set: the hidden-state worker needs the target model")
    store = Store.from_settings(s)
    store.check()  # before the target loads: a wrong bucket is said in seconds, not after minutes of loading
    if s.hs_backend == "vllm":  # the serving engine extracts; this worker needs only the target's config
        from eagle3q.extraction.vllm_backend import VllmExtractor

        extractor = VllmExtractor(s.hs_vllm_base_url, s.model, s.target_model, s.aux_layer_ids,
                                  s.hs_vllm_concurrency, s.hs_vllm_timeout_s,
                                  s.vllm_api_key.get_secret_value() if s.vllm_api_key else None)
    else:
        extractor = TransformersExtractor(s.target_model, s.aux_layer_ids, s.device, s.dtype)
    log.info("target %s loaded: L=%d H=%d aux ids %s (vLLM convention)", s.target_model, extractor.num_layers,
             extractor.hidden_size, extractor.aux_ids)
    check = None
    if s.hs_check_positions > 0:
        from eagle3q.extraction.consistency import ConsistencyCheck

        check = ConsistencyCheck(s.target_model, s.hs_check_positions, s.hs_check_min, s.hs_check_min_greedy,
                                 s.device, tokenizer=s.tokenizer or None)
    return HiddenContext(store, Ledger.from_url(s.broker_url()), extractor, s.token_budget,
                         lambda run: send_train(app, run), check, s.hs_dtype)


# --- the tasks ------------------------------------------------------------------------------------------------------


def generate(self: Task, payload: dict, sig: str | None = None) -> str:
    try:
        task = parse_payload(InferenceTask, payload, INFERENCE, sig)
    except RefusedPayload as e:
        return f"refused: {e}"
    from eagle3q.stages.inference import reject_exhausted, reject_task_error, run_inference

    ctx = _context(INFERENCE.name, lambda: _inference_context(self.app))  # built at start (warm_contexts)
    s = ctx.settings
    try:
        return run_inference(task, ctx)
    except TransientError as e:
        if self.request.retries >= s.max_retries:
            reject_exhausted(ctx, task, e)
            return f"rejected:retries_exhausted_{e.kind}"
        ctx.ledger.incr(task.run, INFERENCE.name, f"retry_{e.kind}")
        delay = backoff_s(self.request.retries, s.backoff_base_s, s.backoff_max_s)
        log.warning("%s/%s: %s; retry %d in %.1fs", task.run, task.sample_id, e.kind, self.request.retries + 1, delay)
        raise self.retry(countdown=delay, exc=e) from None
    except StoreError as e:
        raise retry_store_error(self, ctx.ledger, task.run, task.sample_id, INFERENCE.name, e) from None
    except ServerTooOld as e:  # no sample is attempted against it: the task waits, counted, until an upgrade
        ctx.ledger.incr(task.run, INFERENCE.name, "server_too_old")
        log.error("%s/%s not sent: %s", task.run, task.sample_id, e)
        raise self.retry(countdown=s.backoff_max_s, exc=e) from None
    except Exception as e:  # noqa: BLE001
        return _raise_or_return(retry_unexpected(self, ctx.ledger, task.run, task.sample_id, INFERENCE.name, e,
                                                 lambda err: reject_task_error(ctx, task, err)))


def _raise_or_return(outcome: Exception | str) -> str:
    if isinstance(outcome, Exception):
        raise outcome from None
    return outcome


def extract(self: Task, payload: dict, sig: str | None = None) -> str:
    try:
        ref = parse_payload(SampleRef, payload, HIDDEN_STATES, sig)
    except RefusedPayload as e:
        return f"refused: {e}"
    from eagle3q.extraction.vllm_backend import ServerError
    from eagle3q.stages.hidden_states import reject_exhausted, reject_task_error, run_extract

    ctx = _context(HIDDEN_STATES.name, lambda: _hidden_context(self.app))  # built at start (warm_contexts)
    try:
        return run_extract(ref, ctx)
    except ServerTooOld as e:  # an extraction server that drops the final layer: nothing sent, waits for an upgrade
        ctx.ledger.incr(ref.run, HIDDEN_STATES.name, "server_too_old")
        log.error("%s/%s not sent: %s", ref.run, ref.sample_id, e)
        raise self.retry(countdown=get_settings().backoff_max_s, exc=e) from None
    except ServerError as e:  # the extraction server failed or died (EAGLE3Q_HS_BACKEND=vllm): retried as inference is
        s = get_settings()
        if self.request.retries >= s.max_retries:
            return reject_exhausted(ctx, ref, e)
        ctx.ledger.incr(ref.run, HIDDEN_STATES.name, "retry_hs_server")
        delay = _delay(self)
        log.warning("%s/%s: %s; retry %d in %.1fs", ref.run, ref.sample_id, e, self.request.retries + 1, delay)
        raise self.retry(countdown=delay, exc=e) from None
    except StoreError as e:
        raise retry_store_error(self, ctx.ledger, ref.run, ref.sample_id, HIDDEN_STATES.name, e) from None
    except Exception as e:  # noqa: BLE001
        return _raise_or_return(retry_unexpected(self, ctx.ledger, ref.run, ref.sample_id, HIDDEN_STATES.name, e,
                                                 lambda err: reject_task_error(ctx, ref, err)))


def train(self: Task, payload: dict, sig: str | None = None) -> str:
    try:
        ref = parse_payload(RunRef, payload, TRAIN, sig)
    except RefusedPayload as e:
        return f"refused: {e}"
    from eagle3q.control.ledger import Ledger
    from eagle3q.stages.train import TrainingBusy, mark_failed, train_run
    from eagle3q.store import Store

    s = get_settings()
    ledger = Ledger.from_url(s.broker_url())
    if not ledger.train_fired(ref.run):  # only the ledger's trigger sends this task
        log.error("refused a training task for run %s: its training was never triggered", ref.run)
        return "refused: not triggered"
    try:
        result = train_run(ref.run, s, Store.from_settings(s), ledger)
    except TrainingBusy as e:
        # A duplicate delivery while another trainer works on the run: come back in a few seconds (the lease tells
        # whether the other one is still alive; a dead one's run is taken over seconds after its lease ends), never
        # train twice at once.
        wait_s = max(1, min(5, s.train_lock_s))
        log.info("%s; retrying in %d s", e, wait_s)
        raise self.retry(countdown=wait_s, exc=e) from None
    except Exception as e:
        mark_failed(ledger, ref.run, e)
        raise
    return result.summary()


def register(app: Celery) -> None:
    """The three tasks on `app`, under their contract names."""
    for stage, fn in ((INFERENCE, generate), (HIDDEN_STATES, extract), (TRAIN, train)):
        app.task(name=stage.task, bind=True, max_retries=None, shared=False)(fn)  # this app only
