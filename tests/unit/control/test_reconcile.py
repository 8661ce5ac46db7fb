"""The lost-message sweep's decisions, on a real redis-server with an injected clock: what it sends again, when,
and what it leaves alone. Messages are written the way kombu's Redis transport writes them."""

from __future__ import annotations

import base64
import json
import time

import pytest

from eagle3q.contract import HIDDEN_STATES, INFERENCE, TRAIN
from eagle3q.control.ledger import Ledger
from eagle3q.control.locks import RunLock
from eagle3q.control.reconcile import Reconciler

IDS = [f"{i:032x}" for i in range(10)]
RUN = "rec"


def kombu_message(task: str, payload: dict) -> dict:
    body = base64.b64encode(json.dumps([[payload], {}, {}]).encode()).decode()
    return {"body": body, "headers": {"task": task}, "properties": {"body_encoding": "base64"}}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def setup(ledger: Ledger):  # noqa: ANN201
    sent: list[tuple] = []
    clock = Clock()
    rec = Reconciler(ledger, lambda *ref: sent.append(ref), grace_s=60, scan_limit=100, lock_s=0.001, clock=clock)
    ledger.set_meta(RUN, enqueue_complete=1)
    payloads = {sid: json.dumps({"run": RUN, "sample_id": sid}) for sid in IDS[:4]}
    ledger.open_tasks(RUN, payloads)
    ledger.add_enqueued(RUN, IDS[:4])
    return ledger, rec, clock, sent, payloads


def sweep(rec: Reconciler):  # noqa: ANN201
    time.sleep(0.005)  # past the 1 ms sweep lock of the previous call
    report = rec.sweep()
    assert report is not None
    return report


def test_held_messages_are_left_alone_and_lost_ones_sent_again_after_the_grace(setup):  # noqa: ANN001
    ledger, rec, clock, sent, payloads = setup
    r = ledger.client
    r.rpush("inference", json.dumps(kombu_message(INFERENCE.task, {"run": RUN, "sample_id": IDS[0]})))
    r.rpush("inference", "not json at all")  # garbage on a queue does not stop the sweep
    r.hset("unacked", "tag-1", json.dumps([kombu_message(INFERENCE.task, {"run": RUN, "sample_id": IDS[1]}),
                                           "", "inference"]))
    # IDS[2] and IDS[3]: open in the ledger, nowhere in the broker
    first = sweep(rec)
    assert (first.checked, first.stranded, first.resent) == (4, 2, {})  # first seen: wait for the grace
    clock.t += 30
    assert sweep(rec).resent == {} and not sent  # still within the grace
    ledger.mark_done(RUN, "inference", IDS[3])  # finished meanwhile (the message was only slow): not sent
    clock.t += 31
    report = sweep(rec)
    assert report.resent == {("inference", RUN): 1}
    assert sent == [("inference", RUN, IDS[2], payloads[IDS[2]])]  # with the payload the producer recorded
    assert ledger.stat(RUN, "inference", "resent_lost") == 1


def test_a_stranded_id_seen_again_later_starts_a_new_grace(setup):  # noqa: ANN001
    ledger, rec, clock, sent, _ = setup
    for sid in IDS[:4]:
        ledger.mark_done(RUN, "inference", sid)  # all four now open in hidden_states, and no message anywhere
    sweep(rec)
    clock.t += 61
    sweep(rec)
    assert sorted(sent) == sorted(("hidden_states", RUN, sid, None) for sid in IDS[:4])
    sent.clear()
    ledger.client.rpush("hidden_states", *[json.dumps(kombu_message(HIDDEN_STATES.task, {"run": RUN,
                                                                                         "sample_id": sid}))
                                           for sid in IDS[:4]])
    clock.t += 61
    assert sweep(rec).stranded == 0 and not sent  # the resent messages are held: nothing more


def test_an_open_inference_id_without_its_payload_is_not_sent(setup):  # noqa: ANN001
    ledger, rec, clock, sent, _ = setup
    ledger.open_tasks(RUN, {IDS[5]: ""})
    ledger.add_enqueued(RUN, [IDS[5]])  # still pending: the run has not drained
    for sid in IDS[:4]:
        ledger.mark_done(RUN, "inference", sid)
        ledger.mark_done(RUN, "hidden_states", sid)
    sweep(rec)
    clock.t += 61
    sweep(rec)
    assert sent == []  # logged: `eagle3q enqueue --resend-pending` can, from the data set


def test_a_fired_training_without_a_message_or_a_trainer_is_sent_again(setup):  # noqa: ANN001
    ledger, rec, clock, sent, _ = setup
    for sid in IDS[:4]:
        ledger.mark_done(RUN, "inference", sid)
        ledger.mark_done(RUN, "hidden_states", sid)
    assert ledger.maybe_fire_train(RUN)
    with RunLock(ledger, RUN, ttl_s=30):  # a trainer holds the run: its message is acknowledged-late, not lost
        sweep(rec)
        clock.t += 61
        sweep(rec)
        assert sent == []
    sweep(rec)
    clock.t += 61
    sweep(rec)
    assert sent == [("train", RUN, "", None)]
    sent.clear()
    ledger.set_train_progress(RUN, state="done")
    clock.t += 61
    sweep(rec)
    clock.t += 61
    sweep(rec)
    assert sent == []  # a finished (or failed) training is never sent again
    assert TRAIN.name == "train"


def test_a_long_backlog_is_not_scanned(setup):  # noqa: ANN001
    ledger, rec, clock, sent, _ = setup
    rec.scan_limit = 2
    ledger.client.rpush("inference", *["x"] * 3)
    report = sweep(rec)
    assert report.checked == 0 and any("scan limit" in why for why in report.skipped)


def test_one_sweep_at_a_time(setup):  # noqa: ANN001
    ledger, rec, *_ = setup
    other = Reconciler(ledger, lambda *ref: None, lock_s=5)
    assert other.sweep() is not None
    assert rec.sweep() is None  # the other worker's sweep holds the lock


def test_a_drained_run_nobody_triggered_is_triggered_by_the_sweep(setup):  # noqa: ANN001
    ledger, rec, clock, sent, _ = setup
    ledger.mark_done(RUN, "inference", IDS[0])
    ledger.mark_done(RUN, "hidden_states", IDS[0])
    for sid in IDS[1:4]:
        ledger.mark_rejected(RUN, "inference", sid, "truncated")  # the last events: rejections nobody checked after
    sweep(rec)
    assert sent == [("train", RUN, "", None)] and ledger.train_fired(RUN)
    sweep(rec)
    assert sent == [("train", RUN, "", None)]  # once
