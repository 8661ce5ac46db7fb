"""Reading vLLM's speculative-decoding counters: an exposition written by prometheus_client with vLLM's metric and
label names (two engines), `_created` samples left out, deltas between two scrapes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from eagle3q.evaluation.served import spec_counters


def _exposition(drafts: list[int], accepted: list[int], per_pos: list[list[int]]) -> str:
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    c_d = Counter("vllm:spec_decode_num_drafts", "drafts", labels, registry=reg)
    c_a = Counter("vllm:spec_decode_num_accepted_tokens", "accepted", labels, registry=reg)
    c_p = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos", [*labels, "position"], registry=reg)
    for eng, (d, a, pp) in enumerate(zip(drafts, accepted, per_pos, strict=True)):
        c_d.labels("m", str(eng)).inc(d)
        c_a.labels("m", str(eng)).inc(a)
        for pos, n in enumerate(pp):
            c_p.labels("m", str(eng), str(pos)).inc(n)
    return generate_latest(reg).decode()


def test_counters_are_summed_over_engines_without_created_samples() -> None:
    text = _exposition([10, 30], [12, 28], [[8, 4], [20, 8]])
    assert "_created" in text  # the trap: a timestamp per counter, larger than any count
    c = spec_counters(text)
    assert (c.drafts, c.accepted, c.per_position) == (40, 40, {0: 28, 1: 12})


def test_delta_between_scrapes_gives_this_runs_acceptance() -> None:
    before = spec_counters(_exposition([5], [3], [[2, 1]]))
    after = spec_counters(_exposition([25], [33], [[17, 16]]))
    d = after - before
    assert (d.drafts, d.accepted, d.per_position) == (20, 30, {0: 15, 1: 15})
    assert 1 + d.accepted / d.drafts == 2.5


def test_a_server_without_speculation_has_no_counters() -> None:
    c = spec_counters('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
                      'vllm:num_requests_running{engine="0"} 0.0\n')
    assert (c.drafts, c.accepted, c.per_position) == (0, 0, {})
