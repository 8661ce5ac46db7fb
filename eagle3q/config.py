"""Settings: `EAGLE3Q_*` environment variables, then an optional TOML file (`EAGLE3Q_CONFIG`), then defaults.

Secrets (Redis password, vLLM API key) are `SecretStr`: they come from the environment or the file and never show in
repr, logs or `eagle3q status`.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from eagle3q.contract import ProfileName


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EAGLE3Q_", extra="ignore")

    # --- broker / ledger ---
    redis_url: str = "redis://localhost:6379/0"
    redis_password: SecretStr | None = None
    # A message unacknowledged this long is redelivered, unless the worker holding it is alive: every worker
    # refreshes the delivery time of what it holds (eagle3q.control.leases), so this bounds how long a dead worker's
    # prompts wait, not how long a generation may take.
    visibility_timeout_s: int = 600
    # How often each worker looks for unacknowledged messages whose visibility timeout has passed (kombu's default
    # sweep is every ~100 s).
    restore_sweep_s: int = 30
    # Messages an inference consumer reserves per thread (GPU roles always take 1). 2, not 1: with 1, a thread that
    # finishes waits for the broker round trip before its next request, which cost 6% of throughput at 32 in flight
    # (bench/bench_throughput.py); with 2 the next message is already local. Still bounded: 2 x threads per worker.
    prefetch_multiplier: int = 2
    # Workers send task events (received, started, succeeded: Flower's task list and worker stats). Measured with
    # bench/bench_overhead.py: 1-2 ms of a task's 4-5 ms queue overhead, nothing at 32 in flight in bench (a). Off,
    # Flower still shows the queues (read from the broker) and the workers, not the tasks.
    task_events: bool = True
    # Lost-message sweep (eagle3q.control.reconcile): every worker runs it, one at a time. An id the broker no longer
    # holds in two sweeps `grace` apart is sent again. 0 turns it off.
    reconcile_period_s: float = 30.0
    reconcile_grace_s: float = 60.0
    reconcile_scan_limit: int = 20000  # longer queues (a backlog still draining) are not scanned

    # --- producer ---
    # Prompts of a run waiting for generation (queued or in flight) that the producer allows: it waits, and tops up
    # as they finish. This keeps Redis memory flat in the data set's size (a queued prompt is ~2 KB: its message and
    # its registered payload) and the inference queue under `reconcile_scan_limit`. 0: no cap.
    max_queued: int = 5000

    # --- store (eagle3q.store) ---
    # Where a run's artifacts live: a local path (a directory on this machine, or a mount every worker shares) or
    # s3://bucket/prefix on an S3-compatible object store (workers on machines that share no disk). Empty: store_dir.
    # S3 credentials come from the environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN).
    store_url: str = ""
    store_dir: Path = Path("var/store")
    s3_endpoint: str = ""  # e.g. http://minio:9000 (MinIO, Ceph RGW, moto); empty: AWS itself, or AWS_ENDPOINT_URL
    s3_region: str = "us-east-1"
    store_timeout_s: float = 60.0  # one store request
    store_retries: int = 3  # the client's retries of one request before the stage's own retry (StoreError) takes over

    # --- vLLM ---
    # Comma-separated in the environment (or a JSON list).
    vllm_base_urls: Annotated[list[str], NoDecode] = ["http://localhost:8000/v1"]
    vllm_api_key: SecretStr | None = None
    model: str = "moonshotai/Kimi-K2.5"
    profile: ProfileName = "kimi_k2"
    thinking: bool = True
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 8192
    request_timeout_s: float = 1800.0
    # "reject": a generation cut by max_tokens is rejected with reason `truncated`; "keep": accepted but flagged.
    truncation_policy: Literal["reject", "keep"] = "reject"
    tokenizer: str = ""  # path or hub id of the target's tokenizer; required by the inference consumers
    expose_reasoning_content: bool = False  # simulator only: also send the old `reasoning_content` field

    # Workers refuse to generate more than this for any task, whoever sent it (a registered task over it is rejected
    # as `over_limit`); the producer refuses to start with a larger `max_tokens`.
    max_tokens_limit: int = 131072
    # When set, every task is signed (HMAC-SHA256 over its name and payload) and workers refuse unsigned or badly
    # signed ones: for a broker that other clients can write to. Producers and workers need the same key.
    task_signing_key: SecretStr | None = None

    # --- retries (transient errors only) ---
    max_retries: int = 6
    backoff_base_s: float = 2.0
    backoff_max_s: float = 300.0

    # --- in-flight control (shared across all consumers through Redis) ---
    inflight_mode: Literal["off", "fixed", "adaptive"] = "off"
    inflight_limit: int = 128
    inflight_min: int = 4
    inflight_max: int = 512
    inflight_period_s: float = 2.0  # how often consumers poll vLLM's /metrics and may adjust the adaptive limit

    # --- hidden states ---
    target_model: str = ""  # path or hub id of the target model (transformers backend)
    # vLLM convention: id 0 = embeddings, id k = output of layer k-1. Default [2, L//2, L-3].
    aux_layer_ids: Annotated[list[int] | None, NoDecode] = None
    device: str = "cpu"
    dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    token_budget: int = 16384  # tokens per forward (padded batch size x longest)
    # "transformers": the target in this process; "vllm": a vLLM serving it with extract_hidden_states and the
    # ExampleHiddenStatesConnector (eagle3q.extraction.vllm_backend), writing to a directory this worker can read.
    hs_backend: Literal["transformers", "vllm"] = "transformers"
    hs_vllm_base_url: str = "http://localhost:8001/v1"
    hs_vllm_concurrency: int = 8  # requests in flight per hidden-state worker
    hs_vllm_timeout_s: float = 600.0
    # The consistency check (eagle3q.extraction.consistency): on this many generated positions a sample, the final state
    # through the target's norm and LM head must predict the next token at least `hs_check_min` of the time
    # (`hs_check_min_greedy` for a sample generated at temperature 0), or the sample is rejected as hs_inconsistent.
    # 0 = off (needed where the samples are not the target's own text, such as the simulator's word bank).
    hs_check_positions: int = 32
    hs_check_min: float = 0.4
    hs_check_min_greedy: float = 0.8
    # How the store keeps the states: bf16, or fp8 (e4m3 with a float32 scale per token and layer: half the bytes,
    # eagle3q.store.fp8); training and export-data read both.
    hs_dtype: Literal["bf16", "fp8"] = "bf16"
    # The connector's shared_storage_path as this machine sees it (only for `status`: its backlog and bytes).
    hs_connector_dir: str = ""

    # --- training ---
    train_target: int = 0  # samples with hidden states that trigger training; 0 = all accepted once the run drains
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    # SpecForge's defaults (EAGLE itself trains 40 epochs).
    epochs: int = 10
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    # Tokens per optimizer step (samples packed up to it; each sample's backward accumulates into the step).
    train_batch_tokens: int = 16384
    # Data-parallel training processes on this machine (its GPUs; gloo CPU processes without): > 1 starts torchrun.
    train_processes: int = 1
    # Share of prompts held out of training (by a hash of the conversation's opening: eagle3q.prompt_keys), evaluated
    # every epoch and by eval-draft.
    val_fraction: float = 0.02
    grad_clip: float = 0.5
    max_len: int = 4096
    checkpoint_every: int = 200
    # Samples the trainer fetches ahead of the one it is on (threads reading the store while the model computes): on
    # an object store each sample is a round trip, and without this the trainer would wait for every one.
    train_read_ahead: int = 16
    init_lm_head: bool = True  # the draft's LM head and final norm start as the target's (draft-vocab rows)
    # The draft's norms (eagle3q.draft.model.NORM_LAYOUTS): speculators' three (an RMSNorm over the aux states
    # before fc, the hidden state normed before the residual, the next TTT step fed the normed output), which vLLM
    # runs and which measured better out of domain (docs/performance.md); or EAGLE-3's original layout, for a
    # server that reads only that one.
    draft_norms: Literal["speculators", "eagle3"] = "speculators"
    # The trainer's run lock: renewed in the background while training, so a trainer that dies frees its run this
    # long after it died (a redelivered training task then takes over from the checkpoint).
    train_lock_s: int = 60
    seed: int = 0

    # --- metrics ---
    metrics_port: int = 0  # 0 = no Prometheus exporter in workers

    @field_validator("redis_password", "vllm_api_key", "task_signing_key", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        # compose passes `${VAR:-}` as an empty string: no secret, not an empty one (an empty signing key would
        # make workers refuse every task)
        return None if v == "" else v

    @field_validator("vllm_base_urls", mode="before")
    @classmethod
    def _split_urls(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [u.strip() for u in v.split(",") if u.strip()]
        return v

    @field_validator("aux_layer_ids", mode="before")
    @classmethod
    def _split_ids(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v.strip():
                return None
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [int(u) for u in v.split(",") if u.strip()]
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("EAGLE3Q_CONFIG")
        if path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"EAGLE3Q_CONFIG points to {path!r}, which is not a file")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    def store_location(self) -> str:
        """EAGLE3Q_STORE_URL, or the local EAGLE3Q_STORE_DIR."""
        return self.store_url or str(self.store_dir)

    def broker_url(self) -> str:
        """The Redis URL with the password put in (for Celery and redis-py). Never log this; log `redacted_url`."""
        if self.redis_password is None:
            return self.redis_url
        parts = urlsplit(self.redis_url)
        host = parts.hostname or "localhost"
        netloc = f":{quote(self.redis_password.get_secret_value(), safe='')}@{host}"
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def redacted_url(self) -> str:
        parts = urlsplit(self.redis_url)
        host = parts.hostname or "localhost"
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, f"{host}{port}", parts.path, "", ""))


ENV_KEYS: frozenset[str] = frozenset(f"EAGLE3Q_{name.upper()}" for name in Settings.model_fields) | {"EAGLE3Q_CONFIG"}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
