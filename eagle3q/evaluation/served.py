"""Acceptance as vLLM measures it: the exported draft served by a running vLLM (`--speculative-config '{"method":
"eagle3", "model": EXPORT, "num_speculative_tokens": k}'`), the held-out prompts sent to it, and the mean acceptance
length read from the engine's own counters (`/metrics`, before and after; deltas, so a server that has served other
traffic still gives this run's figure):

    mean acceptance length = 1 + delta(vllm:spec_decode_num_accepted_tokens_total)
                                 / delta(vllm:spec_decode_num_drafts_total)
    acceptance rate at draft position i = delta(..._num_accepted_tokens_per_pos_total{position=i}) / delta(drafts)

Prompts go as token ids to /v1/completions (the same ids the offline loop starts from), greedy, `ignore_eos` and
exactly `max_new` tokens each, so both loops decode the same stream. Offline accuracy that does not hold in serving
(a wrong layer order, a d2t off by one, a norm applied twice) shows here as a gap between the two figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_DRAFTS = "vllm:spec_decode_num_drafts"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    accepted: float
    per_position: dict[int, float]

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafts - other.drafts, self.accepted - other.accepted,
                            {p: n - other.per_position.get(p, 0.0) for p, n in self.per_position.items()})


@dataclass(frozen=True)
class ServedAcceptance:
    mean_length: float  # 1 + accepted / drafts
    per_position: list[float]  # acceptance rate at draft position 0..k-1
    drafts: int
    prompts: int

    @classmethod
    def pooled(cls, parts: list[ServedAcceptance]) -> ServedAcceptance:
        """Several measurements as one (the counters summed): e.g. every out-of-domain category together."""
        drafts = sum(p.drafts for p in parts)
        k = len(parts[0].per_position)
        return cls(1 + sum((p.mean_length - 1) * p.drafts for p in parts) / drafts,
                   [sum(p.per_position[i] * p.drafts for p in parts) / drafts for i in range(k)], drafts,
                   sum(p.prompts for p in parts))


def spec_counters(metrics_text: str) -> SpecCounters:
    """The speculative-decoding counters of a Prometheus exposition, summed over engines (and models)."""
    drafts = accepted = 0.0
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if not s.name.endswith("_total"):  # counters also expose `_created` timestamps
                continue
            if s.name == f"{_DRAFTS}_total":
                drafts += s.value
            elif s.name == f"{_ACCEPTED}_total":
                accepted += s.value
            elif s.name == f"{_PER_POS}_total":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    return SpecCounters(drafts, accepted, per_pos)


def served_acceptance(base_url: str, model: str, prompts: Sequence[Sequence[int]], max_new: int,
                      api_key: str | None = None, concurrency: int = 1, timeout_s: float = 600) -> ServedAcceptance:
    """Run the prompts through a speculating vLLM (`base_url` ends in /v1) and read its acceptance. Nothing else
    should be sending to that server meanwhile (its counters are global)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s, headers=headers) as http:
        def counters() -> SpecCounters:
            r = http.get(f"{root}/metrics")
            r.raise_for_status()
            if _DRAFTS not in r.text:
                raise RuntimeError(f"{root} reports no speculative decoding: is it started with --speculative-config?")
            return spec_counters(r.text)

        def send(ids: Sequence[int]) -> None:
            body = {"model": model, "prompt": list(ids), "max_tokens": max_new, "temperature": 0.0,
                    "ignore_eos": True}
            r = http.post(f"{root}/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{root} answered {r.status_code}: {r.text[:300]}")
            got = r.json()["usage"]["completion_tokens"]
            if got != max_new:
                raise RuntimeError(f"{root} generated {got} tokens, asked {max_new} (is the context too short?)")

        before = counters()
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            list(pool.map(send, prompts))
        delta = counters() - before
    if delta.drafts <= 0:
        raise RuntimeError(f"{root} made no drafts for {len(prompts)} prompts")
    rates = [delta.per_position[p] / delta.drafts for p in sorted(delta.per_position)]
    return ServedAcceptance(1 + delta.accepted / delta.drafts, rates, int(delta.drafts), len(prompts))
