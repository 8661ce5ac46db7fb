"""The spine end to end: real redis-server, the simulator over HTTP, real Celery inference workers."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from eagle3q.dev.local import child_env
from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.generate.templates import render_prompt
from eagle3q.sim.server import SimConfig, Simulator


def test_samples_are_the_exact_token_stream(stack_factory, assert_accounted):  # noqa: ANN001
    stack = stack_factory()
    stack.worker("inference", concurrency=4)
    rep = stack.enqueue(SAMPLE_DATASET, "exact", max_samples=12)
    assert rep.enqueued == 12
    stack.wait_settled("exact")
    done, rejected = assert_accounted(stack, "exact")
    assert len(done) == 12 and not rejected
    for sid in done:
        s = stack.store.read_sample("exact", sid)
        body = {"model": s.model, "messages": [m.model_dump() for m in s.messages], "max_tokens": 4096,
                "return_token_ids": True, "chat_template_kwargs": {"thinking": True}}
        direct = httpx.post(f"{stack.sim_urls[0]}/chat/completions", json=body, timeout=10).json()
        expected = direct["prompt_token_ids"] + direct["choices"][0]["token_ids"]
        assert s.input_ids == expected
        assert s.loss_mask == [0] * len(direct["prompt_token_ids"]) + [1] * len(direct["choices"][0]["token_ids"])
        assert s.reasoning == direct["choices"][0]["message"]["reasoning"]


def test_each_wrapping_fault_is_rejected_with_its_reason(stack_factory, tiny, assert_accounted):  # noqa: ANN001
    faults = "truncate=0.15,missing_close=0.15,leak=0.15,null_ids=0.15"
    stack = stack_factory(sim_args=["--faults", faults, "--seed", "3"])
    stack.worker("inference", concurrency=8)
    rep = stack.enqueue(SAMPLE_DATASET, "faults", max_samples=60)
    stack.wait_settled("faults")
    done, rejected = assert_accounted(stack, "faults")

    # What the simulator injected for each prompt, from its own (deterministic, per-prompt) fault draw.
    sim = Simulator(SimConfig(tokenizer=str(tiny), faults={f.split("=")[0]: 0.15 for f in faults.split(",")},
                              seed=3))
    precedence = [("null_ids", "null_token_ids"), ("truncate", "truncated"), ("leak", "marker_in_content"),
                  ("missing_close", "missing_think_close")]
    for sid in done:  # accepted ones had no fault injected
        msgs = [m.model_dump() for m in stack.store.read_sample("faults", sid).messages]
        text = render_prompt(sim.profile, msgs, True)
        assert not [f for f, _ in precedence if sim._prompt_fault(text, f)]
    for sid in rejected:  # the raw response is kept with every rejection
        assert stack.store.read_rejection("faults", "inference", sid).raw is not None
    seen_reasons = set(rejected.values())
    # leak + missing_close together leave no marker to leak: that response has no reasoning at all
    assert {r for _, r in precedence} <= seen_reasons <= {r for _, r in precedence} | {"missing_reasoning"}
    assert rep.enqueued == len(done) + len(rejected)


def test_rejections_match_the_injected_fault(stack_factory, tiny, assert_accounted):  # noqa: ANN001
    """Per prompt: the reason recorded is the one the simulator's fault implies."""
    stack = stack_factory(sim_args=["--faults", "missing_close=0.3,leak=0.3", "--seed", "5"])
    stack.worker("inference", concurrency=8)
    stack.enqueue(SAMPLE_DATASET, "match", max_samples=30)
    stack.wait_settled("match")
    done, rejected = assert_accounted(stack, "match")
    sim = Simulator(SimConfig(tokenizer=str(tiny), faults={"missing_close": 0.3, "leak": 0.3}, seed=5))
    from eagle3q.producer import sampling_of, task_for
    from eagle3q.sources import Prompt, iter_prompts

    sampling = sampling_of(stack.settings)
    checked = 0
    for item in iter_prompts(SAMPLE_DATASET):
        if not isinstance(item, Prompt) or checked >= 30:
            continue
        t = task_for(item, "match", SAMPLE_DATASET.name, stack.settings, sampling)
        text = render_prompt(sim.profile, item.messages, True)
        leak, no_close = sim._prompt_fault(text, "leak"), sim._prompt_fault(text, "missing_close")
        expected = {(True, True): "missing_reasoning", (True, False): "marker_in_content",
                    (False, True): "missing_think_close", (False, False): None}[(leak, no_close)]
        if expected is None:
            assert t.sample_id in done
        else:
            assert rejected.get(t.sample_id) == expected
        checked += 1
    assert checked == 30 and rejected and done


def test_reenqueue_is_idempotent(stack_factory, assert_accounted):  # noqa: ANN001
    stack = stack_factory()
    first = stack.enqueue(SAMPLE_DATASET, "idem", max_samples=15)
    again = stack.enqueue(SAMPLE_DATASET, "idem", max_samples=15)
    assert (first.enqueued, again.enqueued, again.skipped_known) == (15, 0, 15)
    assert stack.broker.llen("inference") == 15  # nothing sent twice
    stack.worker("inference", concurrency=4)
    stack.wait_settled("idem")
    after = stack.enqueue(SAMPLE_DATASET, "idem", max_samples=20)
    assert (after.enqueued, after.skipped_known) == (5, 15)
    stack.wait_settled("idem")
    done, _ = assert_accounted(stack, "idem")
    assert len(done) == 20


def test_counts_add_up_with_10_percent_5xx(stack_factory, assert_accounted):  # noqa: ANN001
    stack = stack_factory(sim_args=["--faults", "5xx=0.1,429=0.03"])
    stack.worker("inference", concurrency=8)
    stack.worker("inference", concurrency=8)
    rep = stack.enqueue(SAMPLE_DATASET, "flaky", max_samples=120)
    stack.wait_settled("flaky", timeout_s=180)
    done, rejected = assert_accounted(stack, "flaky")
    assert rep.enqueued == 120 == len(done)  # transient errors are retried to success: nothing lost
    assert not rejected
    stats = stack.ledger.counts("flaky", "inference").stats
    assert stats.get("retry_http_503", 0) > 0  # the faults really happened and were retried
    # nothing duplicated: one accepted generation per id, whatever the redeliveries
    assert stats["completion_tokens"] == sum(
        len(stack.store.read_sample("flaky", s).input_ids) - stack.store.read_sample("flaky", s).num_prompt_tokens
        for s in done
    )

    out = subprocess.run([sys.executable, "-m", "eagle3q.cli", "status", "--run", "flaky", "--json"],
                         env=child_env(stack.env), capture_output=True, text=True, timeout=60, check=True)
    snap = json.loads(out.stdout)
    inf = snap["stages"]["inference"]
    assert inf["incoming"] == inf["done"] + inf["rejected"] + inf["pending"] == 120
    assert inf["retries"].get("http_503", 0) == stats["retry_http_503"]
    table = subprocess.run([sys.executable, "-m", "eagle3q.cli", "status", "--run", "flaky"],
                           env=child_env(stack.env), capture_output=True, text=True, timeout=60, check=True).stdout
    assert "inference" in table and "120" in table
