"""The pipeline's shape, in one place: the stages in order, their Celery task names and queues, the worker role of
each queue (pool, prefetch), the queue payloads, and one `send_*` function per task.

Adding a stage is a change here (a `Stage` and, if it gets its own workers, a `Role`) plus its module under
`eagle3q/stages/` and its task in `eagle3q/celery/tasks.py` (ARCHITECTURE.md lists the files).

Queue messages carry ids and small payloads only; samples and tensors live in the store. Every message is validated
on arrival: a forged or malformed payload is refused, never executed. Importable anywhere: no Celery, no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

SAMPLE_ID = re.compile(r"^[0-9a-f]{32}$")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RUN_NAME_RULE = "run names are 1-64 characters of letters, digits, '_', '.', '-'"
ProfileName = Literal["kimi_k2", "qwen3", "deepseek_r1"]


def check_run_name(v: str) -> str:
    if not RUN_NAME.match(v):
        raise ValueError(RUN_NAME_RULE)
    return v


def _check_id(v: str) -> str:
    if not SAMPLE_ID.match(v):
        raise ValueError("sample ids are 32 lowercase hex digits")
    return v


# --- payloads -------------------------------------------------------------------------------------------------------


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "7" is not a row, "yes" not a bool
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "7" is not a row, "yes" not a bool
    temperature: float = Field(ge=0.0, le=5.0)
    top_p: float = Field(gt=0.0, le=1.0)
    max_tokens: int = Field(gt=0, le=1_000_000)


class InferenceTask(BaseModel):
    """One prompt to generate one assistant turn for."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "7" is not a row, "yes" not a bool
    run: str
    sample_id: str
    dataset: str
    row: int = Field(ge=0)
    turn: int = Field(ge=0)
    model: str
    profile: ProfileName
    thinking: bool
    sampling: Sampling
    messages: list[Message] = Field(min_length=1)

    _run = field_validator("run")(classmethod(lambda cls, v: check_run_name(v)))
    _id = field_validator("sample_id")(classmethod(lambda cls, v: _check_id(v)))


class SampleRef(BaseModel):
    """A sample that an earlier stage accepted (hidden states are extracted for it)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "7" is not a row, "yes" not a bool
    run: str
    sample_id: str

    _run = field_validator("run")(classmethod(lambda cls, v: check_run_name(v)))
    _id = field_validator("sample_id")(classmethod(lambda cls, v: _check_id(v)))


class RunRef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "7" is not a row, "yes" not a bool
    run: str

    _run = field_validator("run")(classmethod(lambda cls, v: check_run_name(v)))


# --- stages and roles -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    name: str  # the ledger's stage name, and the name of its queue
    task: str  # the Celery task name (on the wire: never rename one that has been deployed)
    payload: type[BaseModel]
    per_sample: bool  # counted per sample id in the ledger; False: one task per run (training)

    @property
    def queue(self) -> str:
        return self.name


INFERENCE = Stage("inference", "eagle3q.inference.generate", InferenceTask, per_sample=True)
HIDDEN_STATES = Stage("hidden_states", "eagle3q.hidden_states.extract", SampleRef, per_sample=True)
TRAIN = Stage("train", "eagle3q.train.train", RunRef, per_sample=False)
PIPELINE: tuple[Stage, ...] = (INFERENCE, HIDDEN_STATES, TRAIN)

# The stages the ledger counts per sample, in order: an id accepted by one enters the next.
SAMPLE_STAGES: tuple[str, ...] = tuple(s.name for s in PIPELINE if s.per_sample)
STAGE_BY_NAME = {s.name: s for s in PIPELINE}
STAGE_BY_TASK = {s.task: s for s in PIPELINE}
QUEUES: tuple[str, ...] = tuple(s.queue for s in PIPELINE)
ROUTES = {s.task: {"queue": s.queue} for s in PIPELINE}


def next_stage(stage: str) -> str | None:
    """The per-sample stage an id enters when `stage` accepts it (None after the last)."""
    i = SAMPLE_STAGES.index(stage)
    return SAMPLE_STAGES[i + 1] if i + 1 < len(SAMPLE_STAGES) else None


@dataclass(frozen=True)
class Role:
    """A kind of worker: the queue it consumes and how. Inference is I/O bound: threads, several messages reserved
    per thread. GPU roles run one task at a time in the main process (solo): the model is loaded once per process
    and CUDA never meets fork, and they reserve one message (a second would wait behind a long forward pass)."""

    name: str
    queue: str
    pool: Literal["threads", "solo"]
    gpu: bool

    def prefetch_multiplier(self, configured: int) -> int:
        return configured if self.pool == "threads" else 1

    def concurrency(self, requested: int | None, default_threads: int) -> int:
        return 1 if self.pool == "solo" else (requested or default_threads)


ROLES: dict[str, Role] = {
    "inference": Role("inference", INFERENCE.queue, "threads", gpu=False),
    "hidden_states": Role("hidden_states", HIDDEN_STATES.queue, "solo", gpu=True),
    "train": Role("train", TRAIN.queue, "solo", gpu=True),
}


def role_for_queues(queues: list[str]) -> Role | None:
    """The role of a worker consuming `queues` (the first one that has a role)."""
    by_queue = {r.queue: r for r in ROLES.values()}
    return next((by_queue[q] for q in queues if q in by_queue), None)


# --- sending --------------------------------------------------------------------------------------------------------


class TaskSender(Protocol):
    """What sending needs of a Celery app (`Celery.send_task`)."""

    def send_task(self, name: str, args: Any = ..., **options: Any) -> Any: ...


def signature(key: bytes, task_name: str, payload: Any) -> str:
    """HMAC-SHA256 of a task's name and its payload's canonical JSON (what arrives is what was signed: the payload
    is JSON on the wire, so a worker's decoded dict gives the same bytes)."""
    body = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hmac.new(key, f"{task_name}\n{body}".encode(), hashlib.sha256).hexdigest()


def signature_ok(key: bytes, task_name: str, payload: Any, sig: object) -> bool:
    return isinstance(sig, str) and hmac.compare_digest(sig, signature(key, task_name, payload))


def signing_key(app: object) -> bytes | None:
    """The key an app signs with (`make_app` sets it from EAGLE3Q_TASK_SIGNING_KEY), or None."""
    return getattr(app, "eagle3q_signing_key", None)


def _send(app: TaskSender, stage: Stage, payload: BaseModel, label: str, producer: Any = None) -> None:
    # A short argsrepr: Celery would otherwise repr the whole prompt for every message (a third of the producer's
    # time), and Flower shows the id, which is what one looks up.
    body = payload.model_dump()
    key = signing_key(app)
    kwargs = {"sig": signature(key, stage.task, body)} if key else {}
    app.send_task(stage.task, args=[body], kwargs=kwargs, producer=producer, argsrepr=label, kwargsrepr="{}")


def send_generate(app: TaskSender, task: InferenceTask, producer: Any = None) -> None:
    _send(app, INFERENCE, task, f"{task.run}/{task.sample_id}", producer)


def send_extract(app: TaskSender, run: str, sample_id: str) -> None:
    _send(app, HIDDEN_STATES, SampleRef(run=run, sample_id=sample_id), f"{run}/{sample_id}")


def send_train(app: TaskSender, run: str) -> None:
    _send(app, TRAIN, RunRef(run=run), f"{run}/")


def send_again(app: TaskSender, stage: str, run: str, sample_id: str, payload: str | None) -> None:
    """Send a stage's task once more (the lost-message sweep): inference from its recorded payload, the others from
    their ids. The payload goes through its model like any other send."""
    if stage == INFERENCE.name:
        if payload is None:
            raise ValueError(f"{run}/{sample_id}: an inference task cannot be sent again without its payload")
        send_generate(app, InferenceTask.model_validate(json.loads(payload)))
    elif stage == HIDDEN_STATES.name:
        send_extract(app, run, sample_id)
    elif stage == TRAIN.name:
        send_train(app, run)
    else:
        raise ValueError(f"unknown stage {stage!r}")


def message_ref(task_name: str, payload: Any) -> tuple[str, str, str] | None:
    """The (stage, run, sample id) a message of ours refers to; sample id "" for per-run tasks."""
    stage = STAGE_BY_TASK.get(task_name)
    if stage is None or not isinstance(payload, dict) or "run" not in payload:
        return None
    return stage.name, str(payload["run"]), str(payload.get("sample_id", ""))
