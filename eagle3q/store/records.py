"""The JSON records of the store: an accepted generation (Sample) and a stage's rejection (Rejection)."""

from __future__ import annotations

from pydantic import BaseModel, field_validator

from eagle3q.contract import SAMPLE_STAGES, Message, Sampling


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
    """Why a sample was rejected by a stage, with the server's raw answer where there was one."""

    sample_id: str
    run: str
    stage: str
    reason: str
    detail: str
    raw: dict | None = None

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, v: str) -> str:
        if v not in SAMPLE_STAGES:
            raise ValueError(f"stage must be one of {SAMPLE_STAGES}")
        return v
