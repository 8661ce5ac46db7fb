"""Injected server faults, bad data sets and an unwritable store: clear outcomes, nothing lost."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3q.dev.tiny import SAMPLE_DATASET

OUTPUT_REASONS = {"truncated", "missing_think_close", "marker_in_content", "null_token_ids", "missing_reasoning"}


def test_faults_at_20_percent(stack_factory, assert_accounted):  # noqa: ANN001
    faults = "5xx=0.05,429=0.04,timeout=0.03,drop=0.03,truncate=0.02,missing_close=0.02,leak=0.02,null_ids=0.02"
    stack = stack_factory(sim_args=["--faults", faults, "--seed", "11", "--hang-s", "30"],
                          env={"EAGLE3Q_REQUEST_TIMEOUT_S": "1.5", "EAGLE3Q_MAX_RETRIES": "8"})
    stack.worker("inference", concurrency=12)
    stack.worker("inference", concurrency=12)
    rep = stack.enqueue(SAMPLE_DATASET, "f20", max_samples=150)
    stack.wait_settled("f20", timeout_s=300)
    done, rejected = assert_accounted(stack, "f20")
    assert len(done) + len(rejected) == rep.enqueued == 150
    # permanent faults: rejected with the reason of their fault; transient ones: retried until they succeed
    assert set(rejected.values()) <= OUTPUT_REASONS, set(rejected.values())
    assert len(rejected) >= 5
    retries = {k: v for k, v in stack.ledger.counts("f20", "inference").stats.items() if k.startswith("retry_")}
    for kind in ("retry_http_503", "retry_http_429", "retry_timeout", "retry_dropped"):
        assert retries.get(kind, 0) > 0, retries


def test_retry_budget_is_respected(stack_factory, assert_accounted):  # noqa: ANN001
    stack = stack_factory(sim_args=["--faults", "5xx=1.0"], env={"EAGLE3Q_MAX_RETRIES": "2"})
    stack.worker("inference", concurrency=4)
    stack.enqueue(SAMPLE_DATASET, "budget", max_samples=6)
    stack.wait_settled("budget", timeout_s=120)
    done, rejected = assert_accounted(stack, "budget")
    assert not done and set(rejected.values()) == {"retries_exhausted_http_503"} and len(rejected) == 6
    metrics = httpx.get(stack.sim_urls[0][:-3] + "/metrics").text
    faults = next(line for line in metrics.splitlines() if 'fault="5xx"' in line)
    assert float(faults.split()[-1]) == 6 * 3  # the first try and exactly two retries each, no more


def test_bad_data_sets_report_rows_and_the_rest_runs(stack_factory, tmp_path: Path, write_jsonl, assert_accounted):  # noqa: ANN001
    stack = stack_factory(sim_args=["--max-model-len", "300"])
    d = tmp_path / "data"
    d.mkdir()
    good = {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                              {"from": "gpt", "value": "Paris"}]}
    rows = [
        good,
        {"conversations": [{"from": "human", "value": 42}]},  # wrong type
        {"text": "no conversation here"},  # missing field
        {"messages": [{"role": "user", "content": ""}]},  # empty prompt
        {"messages": [{"role": "user", "content": "tell me more " * 400}]},  # beyond the server's context
        {"messages": [{"role": "user", "content": "Name three primes."}]},
    ]
    write_jsonl(d / "a.jsonl", rows)
    with (d / "a.jsonl").open("ab") as f:
        f.write(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n')  # invalid UTF-8
    table = pa.Table.from_pylist([good, good])
    pq.write_table(table, d / "b.parquet")
    full = (d / "b.parquet").read_bytes()
    (d / "c.parquet").write_bytes(full[: len(full) // 2])  # truncated file
    rep = stack.enqueue(d, "bad")
    bad = {b.row: b.reason for b in rep.bad_rows}
    assert set(bad) == {1, 2, 3, 6, 9}, bad
    assert "expected a string" in bad[1] and "neither" in bad[2] and "empty" in bad[3]
    assert "invalid UTF-8" in bad[6] and "not a readable parquet file" in bad[9]
    # the three good rows + the huge one are enqueued (the two parquet rows are duplicates of row 0: same prompt,
    # different rows, so different ids)
    assert rep.enqueued == 5
    stack.worker("inference", concurrency=4)
    stack.wait_settled("bad")
    done, rejected = assert_accounted(stack, "bad")
    assert len(done) == 4 and list(rejected.values()) == ["prompt_too_long"]
    assert len(stack.ledger.bad_rows("bad")) == 5  # kept for `eagle3q bad-rows`


def test_unwritable_store_is_retried_never_acknowledged(stack_factory, tmp_path: Path, assert_accounted):  # noqa: ANN001
    """The store fails after the worker started (a mount lost mid-run; at start the worker refuses it, see
    test_store_s3): every write is retried, counted and loud, and nothing is marked until it is back."""
    blocked = tmp_path / "store-blocked"
    # The first answers come a second after the prompts are sent: the store is gone by then.
    stack = stack_factory(env={"EAGLE3Q_STORE_DIR": str(blocked)}, sim_args=["--ttft", "1.0"])
    w = stack.worker("inference", concurrency=4)
    stack.enqueue(SAMPLE_DATASET, "disk", max_samples=8)
    blocked.rmdir()
    blocked.write_text("a file where the store directory should be")  # root ignores permissions; this it cannot
    deadline = time.monotonic() + 60
    while stack.ledger.counts("disk", "inference").stats.get("store_errors", 0) < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    c = stack.ledger.counts("disk", "inference")
    assert c.stats.get("store_errors", 0) >= 8 and c.done == 0 and c.rejected == 0 and c.pending == 8
    assert "store error" in w.log.read_text()  # loud
    blocked.unlink()  # the operator fixes the mount: the kept tasks finish by themselves
    blocked.mkdir()
    stack.wait_settled("disk", timeout_s=120)
    done, rejected = assert_accounted(stack, "disk")
    assert len(done) == 8 and not rejected
    json.dumps(c.stats)


def test_hostile_rows_end_in_named_places(stack_factory, tmp_path: Path, write_jsonl, assert_accounted):  # noqa: ANN001
    """Near-limit CJK and emoji prompts, a 5 MB line, NUL bytes, lone surrogates, rows without an assistant turn:
    each row is a prompt (accepted or rejected by name) or a bad row, and the text survives byte for byte."""
    limit = 2000
    cjk, emoji = "你好世界，" * (limit // 5 - 1), "🙂🚀🧪👩\u200d💻" * (limit // 6 - 1)
    rows = [
        {"messages": [{"role": "user", "content": cjk}]},  # 0: just under the character limit
        {"messages": [{"role": "user", "content": emoji}]},  # 1: ZWJ sequences, 4-byte characters
        {"messages": [{"role": "user", "content": "你" * (limit + 1)}]},  # 2: just over it
        {"messages": [{"role": "user", "content": "x" * 5_000_000}]},  # 3: a 5 MB line
        {"messages": [{"role": "user", "content": "before\x00after: what is 2+2?"}]},  # 4: an escaped NUL is text
        '{"messages": [{"role": "user", "content": "raw \x00 NUL"}]}',  # 5: a raw NUL byte is not JSON
        '{"messages": [{"role": "user", "content": "half an emoji \\ud83d"}]}',  # 6: lone surrogate
        {"messages": [{"role": "system", "content": "You are helpful."}]},  # 7: nothing to answer
        {"messages": [{"role": "assistant", "content": "An answer to nothing."}]},  # 8: nothing to answer
        {"messages": [{"role": "user", "content": "Name a prime."}]},  # 9: no assistant turn: answer it
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "user", "content": "Name two colours."}]},  # 10: two user turns: the last is asked
    ]
    data = write_jsonl(tmp_path / "hostile.jsonl", rows)
    assert data.stat().st_size > 5_000_000
    stack = stack_factory()
    rep = stack.enqueue(data, "hostile", max_prompt_chars=limit)
    bad = {b.row: b.reason for b in rep.bad_rows}
    assert set(bad) == {2, 3, 5, 6, 7, 8}, bad
    assert "exceeds the limit" in bad[2] and "exceeds the limit" in bad[3] and "invalid JSON" in bad[5]
    assert "lone surrogate" in bad[6] and bad[7] == bad[8] == "no user turn to answer"
    assert rep.enqueued == 5
    stack.worker("inference", concurrency=4)
    stack.wait_settled("hostile")
    done, rejected = assert_accounted(stack, "hostile")
    assert not rejected, rejected
    by_row = {stack.store.read_sample("hostile", sid).row: stack.store.read_sample("hostile", sid) for sid in done}
    assert set(by_row) == {0, 1, 4, 9, 10}
    for row, sample in by_row.items():
        assert sample.messages[-1].content == rows[row]["messages"][-1]["content"]  # byte for byte


def test_a_vllm_too_old_for_the_profile_gets_no_request_and_loses_nothing(stack_factory, assert_accounted):  # noqa: ANN001
    stack = stack_factory(sim_args=["--vllm-version", "0.11.0"])  # before Kimi-K2.5 and its kimi_k2 parser
    w = stack.worker("inference", concurrency=2)
    stack.enqueue(SAMPLE_DATASET, "old", max_samples=3)
    deadline = time.monotonic() + 30
    while stack.ledger.stat("old", "inference", "server_too_old") < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    c = stack.ledger.counts("old", "inference")
    assert c.done == c.rejected == 0 and c.pending == 3  # held, not failed: nothing is lost
    assert "older than 0.15.0" in w.log.read_text()
    metrics = httpx.get(stack.sim_urls[0][:-3] + "/metrics", timeout=5).text
    assert 'vllm:request_success_total{model_name="moonshotai/Kimi-K2.5",finished_reason="stop"} 0' in metrics
