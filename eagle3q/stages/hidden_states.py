"""One hidden-state task: extract for the task's sample and, in the same forward passes, for other accepted
samples of similar length that are waiting (up to the token budget). Every sample still has its own queue message:
a batched one's message later finds the object and does nothing, so batching never loses or duplicates work.
A sample is marked done only after its object is in the store, whole (a PUT returns once it is durable)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from eagle3q.contract import HIDDEN_STATES, SampleRef
from eagle3q.control.ledger import Ledger
from eagle3q.extraction.consistency import Agreement, ConsistencyCheck
from eagle3q.extraction.transformers_backend import (
    Extracted,
    TransformersExtractor,
    check_tensors,
    plan_batches,
    to_safetensors,
)
from eagle3q.metrics import METRICS
from eagle3q.prompt_keys import split_key
from eagle3q.store import Rejection, Sample, Store

log = logging.getLogger("eagle3q.stages.hidden_states")
STAGE = HIDDEN_STATES.name


@dataclass
class HiddenContext:
    store: Store
    ledger: Ledger
    extractor: TransformersExtractor  # or eagle3q.extraction.vllm_backend.VllmExtractor: the same interface
    token_budget: int
    fire_train: Callable[[str], None]
    check: ConsistencyCheck | None = None  # the final state against the tokens (None: EAGLE3Q_HS_CHECK_POSITIONS=0)
    hs_dtype: str = "bf16"  # EAGLE3Q_HS_DTYPE: how the files keep the states

    def close(self) -> None:
        """At worker shutdown (eagle3q.celery.bootsteps): the vLLM backend's connections and threads."""
        close = getattr(self.extractor, "close", None)
        if close is not None:
            close()


def _reject(ctx: HiddenContext, run: str, sid: str, reason: str, detail: str, **stats: int) -> None:
    ctx.store.write_rejection(Rejection(sample_id=sid, run=run, stage=STAGE, reason=reason, detail=detail))
    if ctx.ledger.mark_rejected(run, STAGE, sid, reason, **stats):
        METRICS.rejected(STAGE, reason)
    log.warning("hidden states of %s/%s rejected: %s (%s)", run, sid, reason, detail)


def _meta(ctx: HiddenContext, sample: Sample, agreement: Agreement | None) -> dict:
    ex = ctx.extractor
    meta = {"sample_id": sample.sample_id, "dataset": sample.dataset, "row": sample.row,
            "aux_layer_ids": ex.aux_ids, "num_layers": ex.num_layers, "hidden_size": ex.hidden_size,
            "final_state": ex.final_state, "backend": ex.backend,
            "split_key": split_key(sample.messages)}  # the held-out split's key (eagle3q.draft.manifest)
    if agreement is not None:
        meta["consistency"] = agreement.as_meta()
    return meta


def _agreement(ctx: HiddenContext, s: Sample, ex: Extracted) -> tuple[Agreement | None, dict[str, int]]:
    """The consistency check on the states as they will be stored (bf16, or fp8 restored), and its ledger stats for
    `status`."""
    if ctx.check is None:
        return None, {}
    from eagle3q.store.fp8 import as_stored

    a = ctx.check.agreement(s.sample_id, s.input_ids, s.loss_mask, as_stored(ex.final, ctx.hs_dtype),
                            ctx.extractor.final_state)
    if not a.positions:
        return a, {}
    return a, {"hs_checked": 1, "hs_check_milli": round(a.top1 * 1000)}


def run_extract(ref: SampleRef, ctx: HiddenContext) -> str:
    run = ref.run
    if ctx.ledger.is_terminal(run, STAGE, ref.sample_id):
        return "duplicate"
    if not ctx.store.has_sample(run, ref.sample_id):
        if not ctx.ledger.is_open(run, STAGE, ref.sample_id):
            # No accepted sample and never handed to this stage: forged. Nothing is counted or written.
            log.error("refused %s/%s: no accepted sample of that id", run, ref.sample_id)
            return "refused: not registered"
        _reject(ctx, run, ref.sample_id, "sample_missing", "no accepted sample file in the store")
        _after(ctx, run)
        return "rejected:sample_missing"
    anchor = ctx.store.read_sample(run, ref.sample_id)
    size = ctx.store.hidden_valid(run, ref.sample_id, len(anchor.input_ids))
    if size is not None:  # written before a crash, not yet marked
        ctx.ledger.mark_done(run, STAGE, ref.sample_id, tokens=len(anchor.input_ids), bytes=size)
        _after(ctx, run)
        return "duplicate"

    ids = ctx.ledger.claim_hs_batch(run, ref.sample_id, len(anchor.input_ids), ctx.token_budget)
    samples = [anchor]
    for sid in ids[1:]:
        if not ctx.ledger.is_terminal(run, STAGE, sid) and ctx.store.has_sample(run, sid):
            samples.append(ctx.store.read_sample(run, sid))

    outcome = "accepted"
    for group in plan_batches([len(s.input_ids) for s in samples], ctx.token_budget):
        batch = [samples[i] for i in group]
        too_long = [s for s in batch if len(s.input_ids) > ctx.extractor.max_positions]
        for s in too_long:
            _reject(ctx, run, s.sample_id, "hs_too_long", f"{len(s.input_ids)} tokens > {ctx.extractor.max_positions}")
        batch = [s for s in batch if s not in too_long]
        if not batch:
            continue
        t0 = time.monotonic()
        results = ctx.extractor.extract([s.input_ids for s in batch])
        log.info("extracted %d samples (%d tokens) in %.2fs", len(batch), sum(len(s.input_ids) for s in batch),
                 time.monotonic() - t0)
        for s, ex in zip(batch, results, strict=True):
            reason = check_tensors(s.input_ids, ex, ctx.extractor.hidden_size)
            detail = ex.detail or f"{len(s.input_ids)} tokens"
            agreement, stats = _agreement(ctx, s, ex) if reason is None else (None, {})
            greedy = s.sampling.temperature == 0
            if agreement is not None and not ctx.check.passes(agreement, greedy):
                reason = "hs_inconsistent"
                detail = (f"the final state does not predict the sample's next tokens: top-1 agreement "
                          f"{agreement.top1:.3f} over {agreement.positions} generated positions (threshold "
                          f"{ctx.check.threshold(greedy)} for a {'greedy' if greedy else 'sampled'} sample), "
                          f"{agreement.by_offset} with the states shifted by -1/0/+1 tokens"
                          + (f": the states are shifted by {agreement.offset} against the tokens" if agreement.offset
                             else ": a wrong layer, or a server that is not the generating model"))
            if reason is None:
                try:
                    data = to_safetensors(s.input_ids, s.loss_mask, ex, _meta(ctx, s, agreement), ctx.hs_dtype)
                except OverflowError:
                    reason = "hs_nonfinite"
                else:
                    n = ctx.store.write_hidden(run, s.sample_id, data)
            if reason is not None:
                _reject(ctx, run, s.sample_id, reason, detail, **stats)
                if s.sample_id == ref.sample_id:
                    outcome = f"rejected:{reason}"
                continue
            if ctx.ledger.mark_done(run, STAGE, s.sample_id, tokens=len(s.input_ids), bytes=n, **stats):
                METRICS.hidden_written()
    _after(ctx, run)
    return outcome


def reject_exhausted(ctx: HiddenContext, ref: SampleRef, err: Exception) -> str:
    """The extraction server kept failing for this sample through every retry (EAGLE3Q_MAX_RETRIES, with backoff):
    rejected by that name, the server's last error as the detail; the generated sample stays in the store."""
    if ctx.ledger.is_terminal(ref.run, STAGE, ref.sample_id):
        return "duplicate"
    _reject(ctx, ref.run, ref.sample_id, "retries_exhausted_hs_server", str(err))
    _after(ctx, ref.run)
    return "rejected:retries_exhausted_hs_server"


def reject_task_error(ctx: HiddenContext, ref: SampleRef, err: Exception) -> str:
    """Unexpected errors on this sample through every retry: rejected as `task_error` with the last one."""
    if ctx.ledger.is_terminal(ref.run, STAGE, ref.sample_id):
        return "duplicate"
    _reject(ctx, ref.run, ref.sample_id, "task_error", f"{type(err).__name__}: {err}")
    _after(ctx, ref.run)
    return "rejected:task_error"


def _after(ctx: HiddenContext, run: str) -> None:
    if ctx.ledger.maybe_fire_train(run):
        log.info("run %s reached its training target: training triggered", run)
        ctx.fire_train(run)
