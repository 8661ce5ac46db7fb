"""The producer's bounded backlog, on a real redis-server: at most `max_queued` prompts of a run are open, a full
backlog stops (wait=False) or waits, and a later call continues from the ledger without repeating an id."""

from __future__ import annotations

import threading
import time

import pytest

from eagle3q.celery.app import make_app
from eagle3q.config import Settings
from eagle3q.contract import INFERENCE
from eagle3q.dev.tiny import SAMPLE_DATASET
from eagle3q.producer import SettingsError, enqueue


@pytest.fixture
def settings(redis_server) -> Settings:  # noqa: ANN001
    return Settings(redis_url=redis_server.url, max_queued=5)


def _finish(ledger, run: str, n: int) -> None:  # noqa: ANN001
    """What consumers do: n open prompts are generated (accepted: they now wait for hidden states, which no worker
    extracts here, and that must not hold the producer back)."""
    for sid in sorted(ledger.open_ids(run, INFERENCE.name))[:n]:
        ledger.mark_done(run, INFERENCE.name, sid)


def test_full_backlog_stops_and_a_rerun_tops_up(settings, ledger, redis_server):  # noqa: ANN001
    app = make_app(settings)
    rep = enqueue(app, ledger, settings, SAMPLE_DATASET, "bl", max_samples=12, wait=False)
    assert rep.stopped_full and rep.enqueued == 5 and ledger.open_count("bl", INFERENCE.name) == 5
    assert ledger.meta("bl")["enqueue_complete"] == "0"  # not the end of the data set: the run cannot drain
    again = enqueue(app, ledger, settings, SAMPLE_DATASET, "bl", max_samples=12, wait=False)
    assert again.enqueued == 0 and again.stopped_full  # still full: nothing more
    _finish(ledger, "bl", 3)
    again = enqueue(app, ledger, settings, SAMPLE_DATASET, "bl", max_samples=12, wait=False)
    assert again.enqueued == 3 and again.skipped_known == 5 and ledger.open_count("bl", INFERENCE.name) == 5
    _finish(ledger, "bl", 5)
    last = enqueue(app, ledger, settings, SAMPLE_DATASET, "bl", max_samples=12, wait=False)
    assert last.enqueued == 4 and not last.stopped_full and ledger.meta("bl")["enqueue_complete"] == "1"
    assert len(ledger.enqueued_ids("bl")) == 12
    import redis

    assert redis.Redis.from_url(redis_server.url).llen(INFERENCE.queue) == 12  # each id sent once


def test_waiting_producer_tops_up_as_prompts_finish(settings, ledger):  # noqa: ANN001
    app = make_app(settings)
    peak, stop = [0], threading.Event()

    def consumer() -> None:  # finishes one open prompt every few ms, watching the backlog's size
        while not stop.is_set():
            peak[0] = max(peak[0], ledger.open_count("w", INFERENCE.name))
            _finish(ledger, "w", 1)
            time.sleep(0.01)

    t = threading.Thread(target=consumer)
    t.start()
    try:
        rep = enqueue(app, ledger, settings, SAMPLE_DATASET, "w", max_samples=30, poll_s=0.01)
    finally:
        stop.set()
        t.join()
    assert rep.enqueued == 30 and not rep.stopped_full and rep.waited_s > 0
    assert peak[0] <= 5 and ledger.meta("w")["enqueue_complete"] == "1"
    assert ledger.open_count("w", "hidden_states") >= 25  # samples waiting for extraction do not hold it back


def test_no_cap_sends_everything(settings, ledger):  # noqa: ANN001
    rep = enqueue(make_app(settings), ledger, settings, SAMPLE_DATASET, "nocap", max_samples=20, max_queued=0)
    assert rep.enqueued == 20 and ledger.open_count("nocap", INFERENCE.name) == 20


def test_max_tokens_over_the_limit_is_refused_before_sending(redis_server, ledger):  # noqa: ANN001
    s = Settings(redis_url=redis_server.url, max_tokens=200_000, max_tokens_limit=131072)
    with pytest.raises(SettingsError, match="EAGLE3Q_MAX_TOKENS_LIMIT"):
        enqueue(make_app(s), ledger, s, SAMPLE_DATASET, "big", max_samples=2)
    assert not ledger.run_exists("big")


def test_the_steps_alone_prompts_and_duplicates(tmp_path, write_jsonl):  # noqa: ANN001
    """rows -> prompts (bad rows reported, max_samples) and the duplicate step (greedy: a repeat is set aside with
    the row it repeats; sampled: counted and sent), without Redis or Celery."""
    from eagle3q.producer import Duplicates, EnqueueOptions, EnqueueReport, _prompts
    from eagle3q.sources import Prompt

    rows = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "a"}]}
            for q in ("one", "two", "one", "three")]
    data = write_jsonl(tmp_path / "d.jsonl", [rows[0], "{not json", rows[1], rows[2], rows[3]])
    report = EnqueueReport(run="r")
    prompts = list(_prompts(data, EnqueueOptions(max_samples=3), report))
    assert [p.row for p in prompts] == [0, 2, 3] and report.prompts == 3
    assert [b.row for b in report.bad_rows] == [1]
    for greedy, skipped in ((True, [None, None, "0:0"]), (False, [None, None, None])):
        rep = EnqueueReport(run="r")
        dup = Duplicates(greedy, rep)
        assert [dup.skip(p) for p in prompts] == skipped and rep.duplicate_prompts == 1
        assert rep.skipped_duplicates == ({"3:0": "0:0"} if greedy else {})
    assert all(isinstance(p, Prompt) for p in prompts)
