"""Model profiles: the reasoning markers, end-of-turn token and chat-template switch of each model family.

Token ids are resolved against the real tokenizer at start-up (`resolve`), never assumed; where a profile knows the
published ids (Kimi-K2.5), a tokenizer large enough to be the real one must agree with them or start-up fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Profile:
    name: str
    think_open: str
    think_close: str
    end_of_turn: str
    # The chat-template kwarg that switches thinking (None: the model always thinks).
    thinking_kwarg: str | None
    # True when the generation prompt already ends with `think_open` (thinking on): the stream starts inside reasoning.
    prompt_opens_think: bool
    # Ids published for the real tokenizer; checked when the tokenizer's vocabulary is large enough to be it.
    known_ids: dict[str, int] = field(default_factory=dict)
    # Tokens of the chat template, for the simulator's renderer and the tiny local tokenizer.
    template_tokens: tuple[str, ...] = ()
    # The oldest vLLM that serves the family right: `return_token_ids` arrived in 0.10.2; Kimi-K2.5 and the
    # kimi_k2 reasoning parser in 0.15.
    min_vllm: tuple[int, int, int] = (0, 10, 2)

    def chat_template_kwargs(self, thinking: bool) -> dict[str, bool]:
        return {self.thinking_kwarg: thinking} if self.thinking_kwarg else {}


KIMI_K2 = Profile(
    name="kimi_k2",
    think_open="<think>",
    think_close="</think>",
    end_of_turn="<|im_end|>",
    thinking_kwarg="thinking",
    prompt_opens_think=True,
    known_ids={
        "<think>": 163606,
        "</think>": 163607,
        "<|im_end|>": 163586,
        "<|im_user|>": 163587,
        "<|im_assistant|>": 163588,
        "<|im_middle|>": 163601,
    },
    template_tokens=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
    min_vllm=(0, 15, 0),
)

QWEN3 = Profile(
    name="qwen3",
    think_open="<think>",
    think_close="</think>",
    end_of_turn="<|im_end|>",
    thinking_kwarg="enable_thinking",
    prompt_opens_think=False,
    template_tokens=("<|im_start|>", "<|im_end|>"),
)

DEEPSEEK_R1 = Profile(
    name="deepseek_r1",
    think_open="<think>",
    think_close="</think>",
    end_of_turn="<｜end▁of▁sentence｜>",
    thinking_kwarg=None,
    prompt_opens_think=True,  # R1's updated template forces "<think>\n" into the generation prompt
    template_tokens=("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
)

PROFILES: dict[str, Profile] = {p.name: p for p in (KIMI_K2, QWEN3, DEEPSEEK_R1)}
ALL_SPECIAL_TOKENS: tuple[str, ...] = tuple(
    dict.fromkeys(t for p in PROFILES.values() for t in (p.think_open, p.think_close, *p.template_tokens))
)


@dataclass(frozen=True)
class ResolvedProfile:
    profile: Profile
    open_id: int
    close_id: int
    end_id: int


class ProfileMismatch(RuntimeError):
    pass


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}") from None


def resolve(profile: Profile, token_to_id, vocab_size: int) -> ResolvedProfile:
    """Look the markers up in the tokenizer; fail loudly if one is missing or disagrees with the published id."""
    ids = {}
    for tok in (profile.think_open, profile.think_close, profile.end_of_turn):
        tid = token_to_id(tok)
        if tid is None:
            raise ProfileMismatch(f"profile {profile.name}: token {tok!r} is not a single token in this tokenizer")
        ids[tok] = tid
    if vocab_size > max(profile.known_ids.values(), default=1 << 62):
        for tok, expected in profile.known_ids.items():
            got = token_to_id(tok)
            if got != expected:
                raise ProfileMismatch(f"profile {profile.name}: {tok!r} is id {got}, expected {expected}")
    return ResolvedProfile(profile, ids[profile.think_open], ids[profile.think_close], ids[profile.end_of_turn])
