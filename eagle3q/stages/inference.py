"""One inference task, start to end: generate, validate, store, count. Idempotent under redelivery.

Order matters for "nothing lost": the sample file is written first, then the sample is handed to the next stage,
then the ledger marks it done. A crash between any two steps is repaired by the redelivered task, which finds the
file, hands it on again (harmless: the next stage is idempotent too) and marks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3q.config import Settings
from eagle3q.contract import INFERENCE, InferenceTask
from eagle3q.control.inflight import InflightLimiter
from eagle3q.control.ledger import Ledger
from eagle3q.generate.endpoints import EndpointPool, check_version
from eagle3q.generate.profiles import ResolvedProfile, get_profile, resolve
from eagle3q.generate.templates import render_prompt
from eagle3q.generate.tokenizer import TokenizerLike, load_tokenizer
from eagle3q.generate.validation import validate
from eagle3q.generate.vllm_client import ChatRequest, PermanentError, TransientError, VLLMClient
from eagle3q.metrics import METRICS
from eagle3q.periodic import Periodic
from eagle3q.store import Rejection, Sample, Store

log = logging.getLogger("eagle3q.inference")
STAGE = INFERENCE.name


@dataclass
class InferenceContext:
    settings: Settings
    store: Store
    ledger: Ledger
    client: VLLMClient
    tokenizer: TokenizerLike
    profiles: dict[str, ResolvedProfile]
    endpoints: EndpointPool
    forward: Callable[[str, str], None]  # (run, sample_id) -> hand the accepted sample to the hidden-state stage
    fire_train: Callable[[str], None] | None = None  # (run) -> send its training task (the trigger decided)
    inflight: InflightLimiter | None = None  # the shared in-flight budget, when enabled
    prober: Periodic | None = None  # polls the endpoints' health and load (several endpoints, or adaptive budget)
    limits: dict[str, int | None] = field(default_factory=dict)  # endpoint -> max_model_len (context_limit)
    versions: dict[tuple[str, str], str | None] = field(default_factory=dict)  # (endpoint, profile) -> checked

    def probe_once(self) -> None:
        self.endpoints.probe(self.client.http)
        if self.inflight is not None:
            self.inflight.observe([e.waiting for e in self.endpoints.endpoints])

    def close(self) -> None:
        if self.prober is not None:
            self.prober.stop()

    def context_limit(self, url: str) -> int | None:
        """The endpoint's max_model_len from its `/v1/models` (asked once per endpoint; None while unknown)."""
        if url not in self.limits:
            try:
                r = self.client.http.get(url.rstrip("/") + "/models", timeout=10)
                data = r.json().get("data") or [{}]
                value = data[0].get("max_model_len")
            except Exception:  # noqa: BLE001 - unreachable now: the request itself will tell; ask again next time
                return None
            self.limits[url] = int(value) if isinstance(value, int) and value > 0 else None
        return self.limits[url]

    def prompt_tokens(self, url: str, model: str, messages: list[dict[str, str]], kwargs: dict, local: str) -> int:
        """The prompt's length as the server renders it: vLLM's `/tokenize` with the messages applies the model's own
        chat template (which may add what our renderer does not know of, e.g. a default system prompt). Falls back to
        the local rendering when the server cannot say."""
        root = url.rstrip("/").removesuffix("/v1")
        body = {"model": model, "messages": messages, "add_generation_prompt": True, "chat_template_kwargs": kwargs}
        try:
            r = self.client.http.post(root + "/tokenize", json=body, timeout=30)
            count = r.json().get("count") if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - no /tokenize (a proxy, an old server): count locally
            count = None
        return int(count) if isinstance(count, int) and count >= 0 else len(self.tokenizer.encode(local))

    def check_server(self, url: str, profile: str) -> None:
        """Once per endpoint and profile: refuse a vLLM too old to serve the profile (ServerTooOld, raised on every
        task until the server is upgraded, so no sample is attempted and none is lost)."""
        if (url, profile) in self.versions:
            return
        version = check_version(self.client.http, url, get_profile(profile).min_vllm, profile)
        if version is None:  # unreachable: the request will say so; check again next time
            return
        self.versions[(url, profile)] = version
        if version:
            log.info("endpoint %s: vLLM %s", url, version)

    def profile(self, name: str) -> ResolvedProfile:
        if name not in self.profiles:
            self.profiles[name] = resolve(get_profile(name), self.tokenizer.token_to_id, self.tokenizer.vocab_size)
        return self.profiles[name]


def build_context(settings: Settings, forward: Callable[[str, str], None], concurrency: int,
                  fire_train: Callable[[str], None] | None = None) -> InferenceContext:
    tok = load_tokenizer(settings.tokenizer)
    rp = resolve(get_profile(settings.profile), tok.token_to_id, tok.vocab_size)  # fail at start-up, not per task
    api_key = settings.vllm_api_key.get_secret_value() if settings.vllm_api_key else None
    ledger = Ledger.from_url(settings.broker_url())
    store = Store.from_settings(settings)
    store.check()  # a bucket that does not exist or wrong credentials: the worker refuses to start, nothing is marked
    ctx = InferenceContext(
        settings=settings,
        store=store,
        ledger=ledger,
        client=VLLMClient(api_key, settings.request_timeout_s, max_connections=max(concurrency, 4),
                          base_urls=settings.vllm_base_urls),
        tokenizer=tok,
        profiles={rp.profile.name: rp},
        endpoints=EndpointPool(settings.vllm_base_urls),
        forward=forward,
        fire_train=fire_train,
    )
    if settings.inflight_mode != "off":
        ctx.inflight = InflightLimiter.from_settings(ledger, settings)
    if len(settings.vllm_base_urls) > 1 or settings.inflight_mode == "adaptive":
        ctx.prober = Periodic("eagle3q-endpoint-probe", settings.inflight_period_s, ctx.probe_once,
                              first_at_start=True).start()
    return ctx


def _accept(ctx: InferenceContext, task: InferenceTask, sample: Sample, nbytes: int | None = None) -> None:
    if nbytes is None:
        nbytes = ctx.store.write_sample(sample)
    ctx.ledger.add_hs_pending(task.run, task.sample_id, len(sample.input_ids))
    ctx.forward(task.run, task.sample_id)
    gen = len(sample.input_ids) - sample.num_prompt_tokens
    if ctx.ledger.mark_done(
        task.run, STAGE, task.sample_id,
        prompt_tokens=sample.num_prompt_tokens, completion_tokens=gen, bytes=nbytes,
        truncated_kept=int(sample.truncated),
    ):
        METRICS.accepted(gen)


def _reject(ctx: InferenceContext, task: InferenceTask, reason: str, detail: str, raw: dict | None) -> None:
    ctx.store.write_rejection(
        Rejection(sample_id=task.sample_id, run=task.run, stage=STAGE, reason=reason, detail=detail, raw=raw)
    )
    if ctx.ledger.mark_rejected(task.run, STAGE, task.sample_id, reason):
        METRICS.rejected(STAGE, reason)
    # A rejection can be a run's last event: it may be what drains the run.
    if ctx.fire_train is not None and ctx.ledger.maybe_fire_train(task.run):
        log.info("run %s drained: training triggered", task.run)
        ctx.fire_train(task.run)
    log.info("rejected %s/%s: %s (%s)", task.run, task.sample_id, reason, detail)


def reject_exhausted(ctx: InferenceContext, task: InferenceTask, err: TransientError) -> None:
    """The retry budget is spent on a transient error: a named rejection, never a silent drop."""
    _reject(ctx, task, f"retries_exhausted_{err.kind}", err.detail, None)


def reject_task_error(ctx: InferenceContext, task: InferenceTask, err: Exception) -> str:
    """The same sample raised unexpected errors through every retry (EAGLE3Q_MAX_RETRIES): a named rejection with
    the last error, so the run drains instead of sending the task again for ever."""
    if ctx.ledger.is_terminal(task.run, STAGE, task.sample_id):
        return "duplicate"
    _reject(ctx, task, "task_error", f"{type(err).__name__}: {err}", None)
    return "rejected:task_error"


def run_inference(task: InferenceTask, ctx: InferenceContext) -> str:
    """Returns "accepted", "rejected:<reason>", "duplicate" or "refused:...". Raises TransientError (retry) or
    StoreError (retry)."""
    if ctx.ledger.is_terminal(task.run, STAGE, task.sample_id):
        return "duplicate"
    if ctx.ledger.open_payload(task.run, STAGE, task.sample_id) != task.model_dump_json():
        # Not what the producer registered (it records every payload before sending): a forged or altered task is
        # refused by name and touches no count, no store and no server.
        log.error("refused %s/%s: not registered by the producer (unknown id or altered payload)", task.run,
                  task.sample_id)
        return "refused: not registered"
    if task.sampling.max_tokens > ctx.settings.max_tokens_limit:
        # Registered, so it must end somewhere: a named rejection, not a generation this deployment does not allow.
        _reject(ctx, task, "over_limit", f"max_tokens {task.sampling.max_tokens} > EAGLE3Q_MAX_TOKENS_LIMIT "
                f"{ctx.settings.max_tokens_limit}", None)
        return "rejected:over_limit"
    size = ctx.store.sample_size(task.run, task.sample_id)
    if size is not None:  # written, but the mark was lost with a crash
        _accept(ctx, task, ctx.store.read_sample(task.run, task.sample_id), nbytes=size)
        return "duplicate"

    s = task.sampling
    rp = ctx.profile(task.profile)
    messages = [m.model_dump() for m in task.messages]
    url = ctx.endpoints.acquire()
    try:
        ctx.check_server(url, task.profile)
    except Exception:
        ctx.endpoints.release(url, True)
        raise
    max_tokens = s.max_tokens
    limit = ctx.context_limit(url)
    if limit is not None:
        # Sized to the context: vLLM refuses max_tokens over max_model_len, and silently caps prompt + max_tokens
        # over it (the sample then ends as `truncated`).
        prompt = render_prompt(rp.profile, messages, task.thinking)
        # A token covers at least one byte of the text (byte-level BPE, tiktoken; SentencePiece adds at most a
        # prefix space): when the bytes fit with a margin for what the model's own template adds (a default system
        # turn), so do the tokens, and the hot path asks nobody. Near the limit the server counts.
        fits = len(prompt.encode()) + 256 + max_tokens <= limit
        kwargs = rp.profile.chat_template_kwargs(task.thinking)
        room = limit if fits else limit - ctx.prompt_tokens(url, task.model, messages, kwargs, prompt)
        if room <= 0:
            ctx.endpoints.release(url, True)
            _reject(ctx, task, "prompt_too_long", f"the prompt fills the context of {limit} tokens", None)
            return "rejected:prompt_too_long"
        max_tokens = min(max_tokens, room)
    req = ChatRequest(
        model=task.model,
        messages=messages,
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=max_tokens,
        chat_template_kwargs=rp.profile.chat_template_kwargs(task.thinking),
    )
    slot = ctx.inflight.acquire() if ctx.inflight is not None else None
    t0 = time.monotonic()
    ok, connect_failed = False, False
    METRICS.in_flight(+1)
    try:
        raw = ctx.client.chat(url, req)
        ok = True
    except TransientError as e:
        connect_failed = e.kind in {"connect", "dropped"}
        if ctx.inflight is not None:
            ctx.inflight.on_overload(e.kind)
        raise
    except PermanentError as e:
        _reject(ctx, task, e.reason, e.detail, e.raw)
        return f"rejected:{e.reason}"
    finally:
        METRICS.in_flight(-1)
        latency = time.monotonic() - t0
        ctx.endpoints.release(url, ok, connect_failed)
        if slot is not None:
            ctx.inflight.release(slot)

    v = validate(raw, rp, ctx.tokenizer, task.thinking, ctx.settings.truncation_policy)
    if not v.ok:
        _reject(ctx, task, v.reason, v.detail, raw)
        return f"rejected:{v.reason}"
    assert v.prompt_ids is not None and v.gen_ids is not None
    sample = Sample(
        sample_id=task.sample_id,
        run=task.run,
        dataset=task.dataset,
        row=task.row,
        turn=task.turn,
        model=task.model,
        profile=task.profile,
        thinking=task.thinking,
        sampling=task.sampling,
        messages=task.messages,
        # The exact stream the model saw and produced; never rebuilt through the chat template.
        input_ids=v.prompt_ids + v.gen_ids,
        loss_mask=[0] * len(v.prompt_ids) + [1] * len(v.gen_ids),
        num_prompt_tokens=len(v.prompt_ids),
        reasoning=v.reasoning,
        content=v.content,
        finish_reason=v.finish_reason,
        truncated=v.truncated,
        endpoint=url,
        latency_s=round(latency, 4),
    )
    _accept(ctx, task, sample)
    return "accepted"
