"""The ledger on a real redis-server: terminal marks (first wins, counted once, handed to the next stage), the
training trigger (target and drain, exactly once under concurrency) and the counts."""

from __future__ import annotations

import threading

from eagle3q.contract import SAMPLE_STAGES
from eagle3q.control.ledger import Ledger

IDS = [f"{i:032x}" for i in range(200)]


def test_first_terminal_mark_wins_and_counts_once(ledger: Ledger):
    run = "marks"
    ledger.add_enqueued(run, IDS[:3])
    ledger.open_tasks(run, {sid: "{}" for sid in IDS[:3]})
    assert ledger.mark_done(run, "inference", IDS[0], completion_tokens=7)
    assert not ledger.mark_done(run, "inference", IDS[0], completion_tokens=7)  # redelivered: nothing counted
    assert not ledger.mark_rejected(run, "inference", IDS[0], "truncated")  # nor rejected after acceptance
    assert ledger.mark_rejected(run, "inference", IDS[1], "truncated")
    assert not ledger.mark_done(run, "inference", IDS[1])
    c = ledger.counts(run, "inference")
    assert (c.incoming, c.done, c.rejected, c.pending) == (3, 1, 1, 1)
    assert c.reasons == {"truncated": 1} and c.stats["completion_tokens"] == 7
    assert ledger.rejection_reason(run, "inference", IDS[1]) == "truncated"
    assert ledger.is_terminal(run, "inference", IDS[0]) and not ledger.is_terminal(run, "inference", IDS[2])
    # open ids leave their stage with the mark; an accepted one enters the next stage's open set in the same step
    assert ledger.open_ids(run, "inference") == {IDS[2]}
    assert ledger.open_ids(run, "hidden_states") == {IDS[0]}
    assert ledger.pending_ids(run, "inference") == {IDS[2]}
    assert ledger.pending_ids(run, "hidden_states") == {IDS[0]}
    assert ledger.mark_done(run, "hidden_states", IDS[0])
    assert ledger.open_count(run, "hidden_states") == 0 and ledger.counts(run, "hidden_states").pending == 0


def test_an_id_finished_before_the_producer_recorded_it_still_counts(ledger: Ledger):
    # The producer records ids after sending them: a fast worker may mark one first.
    assert ledger.mark_done("early", "inference", IDS[0])
    assert ledger.enqueued_ids("early") == {IDS[0]}
    assert ledger.counts("early", "inference").pending == 0


def test_training_fires_exactly_once_under_concurrent_completions(ledger: Ledger, redis_server):  # noqa: ANN001
    run = "race"
    ledger.set_meta(run, train_target=150, enqueue_complete=1)
    ledger.add_enqueued(run, IDS)
    for sid in IDS:
        ledger.mark_done(run, "inference", sid)
    fired: list[str] = []

    def finisher(chunk: list[str]) -> None:
        own = Ledger.from_url(redis_server.url)  # its own connection, like a worker on another machine
        for sid in chunk + chunk:  # every completion delivered twice (redelivery)
            own.mark_done(run, "hidden_states", sid)
            if own.maybe_fire_train(run):
                fired.append(sid)

    threads = [threading.Thread(target=finisher, args=(IDS[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fired) == 1
    assert ledger.counts(run, "hidden_states").done == 200  # duplicates not counted
    assert not ledger.maybe_fire_train(run) and ledger.train_fired(run)


def test_target_fires_when_the_last_stage_reaches_it(ledger: Ledger):
    run = "target"
    ledger.set_meta(run, train_target=2, enqueue_complete=0)
    ledger.add_enqueued(run, IDS[:5])
    for sid in IDS[:5]:
        ledger.mark_done(run, "inference", sid)  # accepted by inference is not enough: hidden states count
    assert not ledger.maybe_fire_train(run)
    ledger.mark_done(run, SAMPLE_STAGES[-1], IDS[0])
    assert not ledger.maybe_fire_train(run)
    ledger.mark_done(run, SAMPLE_STAGES[-1], IDS[1])
    assert ledger.maybe_fire_train(run)


def test_drain_fires_only_when_every_stage_is_settled(ledger: Ledger):
    run = "drain"
    ledger.set_meta(run, train_target=0, enqueue_complete=0)
    ledger.add_enqueued(run, IDS[:3])
    ledger.mark_done(run, "inference", IDS[0])
    ledger.mark_done(run, "inference", IDS[1])
    ledger.mark_rejected(run, "inference", IDS[2], "truncated")
    ledger.mark_done(run, "hidden_states", IDS[0])
    assert not ledger.maybe_fire_train(run)  # IDS[1] still waits for its hidden states
    ledger.mark_rejected(run, "hidden_states", IDS[1], "hs_nonfinite")
    assert not ledger.maybe_fire_train(run)  # the producer has not finished
    ledger.set_meta(run, enqueue_complete=1)
    assert ledger.maybe_fire_train(run)
    assert not ledger.maybe_fire_train(run)


def test_a_run_with_a_target_fires_on_drain_only_when_asked(ledger: Ledger):
    for run, on_drain in (("short", 0), ("short_drain", 1)):
        ledger.set_meta(run, train_target=60, train_on_drain=on_drain, enqueue_complete=1)
        ledger.add_enqueued(run, IDS[:1])
        ledger.mark_done(run, "inference", IDS[0])
        ledger.mark_done(run, "hidden_states", IDS[0])  # drained with 1 of the 60 samples
    assert not ledger.maybe_fire_train("short")  # the README's rule: draining fires only at target 0 ...
    assert ledger.maybe_fire_train("short_drain")  # ... or with --train-on-drain


def test_nothing_fires_without_a_sample_with_hidden_states(ledger: Ledger):
    run = "empty"
    ledger.set_meta(run, train_target=0, enqueue_complete=1)
    ledger.add_enqueued(run, IDS[:2])
    ledger.mark_rejected(run, "inference", IDS[0], "truncated")
    ledger.mark_rejected(run, "inference", IDS[1], "truncated")
    assert not ledger.maybe_fire_train(run)  # drained, but nothing to train on


def test_rates_of_a_drained_stage_are_its_rates_while_it_ran(ledger: Ledger):
    run = "rate"
    ledger.add_enqueued(run, IDS[:2])
    ledger.mark_done(run, "inference", IDS[0])
    ledger.mark_done(run, "inference", IDS[1])
    c = ledger.counts(run, "inference", now=10_000_000_000.0)  # long after: the rate does not decay to zero
    assert c.pending == 0 and c.rate > 0 and c.eta_s == 0.0
