"""Typed payloads. Queue messages carry ids and small payloads only; samples and tensors live in the store.

Every message is validated on arrival: a forged or malformed payload is refused, never executed.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SAMPLE_ID = re.compile(r"^[0-9a-f]{32}$")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(ge=0.0, le=5.0)
    top_p: float = Field(gt=0.0, le=1.0)
    max_tokens: int = Field(gt=0, le=1_000_000)


def _check_run(v: str) -> str:
    if not RUN_NAME.match(v):
        raise ValueError("run names are 1-64 characters of letters, digits, '_', '.', '-'")
    return v


def _check_id(v: str) -> str:
    if not SAMPLE_ID.match(v):
        raise ValueError("sample ids are 32 lowercase hex digits")
    return v


class InferenceTask(BaseModel):
    """One prompt to generate one assistant turn for."""

    model_config = ConfigDict(extra="forbid")
    run: str
    sample_id: str
    dataset: str
    row: int = Field(ge=0)
    turn: int = Field(ge=0)
    model: str
    profile: Literal["kimi_k2", "qwen3", "deepseek_r1"]
    thinking: bool
    sampling: Sampling
    messages: list[Message] = Field(min_length=1)

    _run = field_validator("run")(classmethod(lambda cls, v: _check_run(v)))
    _id = field_validator("sample_id")(classmethod(lambda cls, v: _check_id(v)))


class SampleRef(BaseModel):
    """A sample that an earlier stage accepted (hidden states are extracted for it)."""

    model_config = ConfigDict(extra="forbid")
    run: str
    sample_id: str

    _run = field_validator("run")(classmethod(lambda cls, v: _check_run(v)))
    _id = field_validator("sample_id")(classmethod(lambda cls, v: _check_id(v)))


class RunRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run: str

    _run = field_validator("run")(classmethod(lambda cls, v: _check_run(v)))


class Sample(BaseModel):
    """An accepted generation: the exact token stream the model produced, and where the loss applies."""

    sample_id: str
    run: str
    dataset: str
    row: int
    turn: int
    model: str
    profile: str
    thinking: bool
    sampling: Sampling
    messages: list[Message]
    input_ids: list[int]
    loss_mask: list[int]
    num_prompt_tokens: int
    reasoning: str | None
    content: str | None
    finish_reason: str
    truncated: bool
    endpoint: str
    latency_s: float


class Rejection(BaseModel):
    sample_id: str
    run: str
    stage: Literal["inference", "hidden_states"]
    reason: str
    detail: str
    raw: dict | None = None
