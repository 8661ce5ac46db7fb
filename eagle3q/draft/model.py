"""The EAGLE-3 draft: one Llama decoder layer over [input_layernorm(embed(token)); hidden_norm(h)], with `fc: 3H->H`
folding the target's three auxiliary states into h for the first step, and an LM head over the draft vocabulary.

Weight names are the ones vLLM's `LlamaForCausalLMEagle3` loads (`midlayer.*`, `fc`, `norm`, `lm_head`).

Training-time test (TTT): step k of row t feeds token x[t+1+k] with the draft's own output of step k-1, at position
t+k, and attends to the step-0 keys of rows <= t plus its own chain's keys of steps 1..k, exactly what the draft sees
at inference when it speculates k tokens after position t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3q.target import text_config

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling: dict | None = None  # the target's, carried into the export for vLLM
    # The three norms of speculators' drafts (vLLM runs each; NORM_LAYOUTS): the hidden state normed before the
    # residual is taken, an RMSNorm over the concatenated aux states before `fc`, and the next TTT step fed the
    # normed output instead of the pre-norm one. False is EAGLE-3's original layout (and vLLM's default).
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False

    @classmethod
    def from_target(cls, cfg: dict, draft_vocab_size: int, norms: str = "speculators") -> DraftConfig:
        """The draft for a target's config; `norms` names one of NORM_LAYOUTS (Settings.draft_norms)."""
        if norms not in NORM_LAYOUTS:
            raise ValueError(f"draft norms {norms!r}: expected one of {sorted(NORM_LAYOUTS)}")
        cfg = text_config(cfg)
        h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(
            hidden_size=h,
            intermediate_size=int(cfg.get("intermediate_size", 4 * h)),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or h // heads),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=min(draft_vocab_size, int(cfg["vocab_size"])),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta_of(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling=rope_scaling_of(cfg),
            **NORM_LAYOUTS[norms],
        )

    def norms(self) -> dict[str, bool]:
        return {flag: getattr(self, flag) for flag in NORM_FLAGS}


NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "norm_output")
# speculators' trainer sets all three by default (0.9). On the tiny target (1,000 samples x 5 epochs, 3 seeds) they
# lift our trainer's acceptance at k = 5 from 2.23 to 2.25 held out and from 1.46 to 1.55 out of domain
# (docs/performance.md, learning curve).
NORM_LAYOUTS: dict[str, dict[str, bool]] = {
    "speculators": dict.fromkeys(NORM_FLAGS, True),
    "eagle3": dict.fromkeys(NORM_FLAGS, False),
}


def rope_theta_of(cfg: dict) -> float:
    """transformers v5 configs carry `rope_parameters` ({"rope_type", "rope_theta", ...}); v4 a top-level
    `rope_theta` (and `rope_scaling`)."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def rope_scaling_of(cfg: dict) -> dict | None:
    params = cfg.get("rope_parameters")
    if params and params.get("rope_type", "default") != "default":
        return {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = cfg.get("rope_scaling")
    return dict(scaling) if scaling else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's half-split layout). x [B, heads, T, d], pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: list[KV]) -> torch.Tensor:
        """x [B, T, 2H]; `cache` holds (k, v) of earlier TTT steps (step 0 first); this step's are appended."""
        c = self.c
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cache.append((k, v))
        scale = 1.0 / math.sqrt(c.head_dim)
        k0, v0 = cache[0]
        s = k0.shape[-2]  # step-0 rows; a later step may run on the last t of them only (inference: t = 1)
        main = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, S] over step-0 keys, causal
        causal = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(diagonal=s - t)
        main = main.masked_fill(~causal, float("-inf"))
        diag = [((q * ki).sum(-1) * scale).unsqueeze(-1) for ki, _ in cache[1:]]  # own chain, steps 1..k
        w = torch.softmax(torch.cat([main, *diag], -1).float(), -1).to(q.dtype)
        out = w[..., :s] @ v0
        for i, (_, vi) in enumerate(cache[1:]):
            out = out + w[..., s + i : s + i + 1] * vi
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, cache: list) -> torch.Tensor:
        if self.c.norm_before_residual:
            h = self.hidden_norm(h)
            residual = h
        else:
            residual = h
            h = self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(emb), h], -1)
        x = residual + self.self_attn(x, pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    def __init__(self, c: DraftConfig, embed_weight: torch.Tensor):
        super().__init__()
        self.c = c
        # The target's embeddings, frozen (not exported: vLLM shares the target's).
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)
        self.input_norm = RMSNorm(3 * c.hidden_size, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [.., 3H] folded into the first step's hidden state [.., H]."""
        return self.fc(self.input_norm(aux) if self.input_norm is not None else aux)

    def step(self, tokens: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, cache: list[KV]) -> KV:
        """One TTT step over all rows: (logits over the draft vocab, the hidden state for the next step)."""
        out = self.midlayer(self.embed_tokens(tokens), h, pos, cache)
        normed = self.norm(out)
        return self.lm_head(normed), normed if self.c.norm_output else out

    def exported_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}
