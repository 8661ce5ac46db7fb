"""Duplicate prompts and the held-out split by prompt content (issue 22.1): the keys, the producer's decision on a
real redis-server, and the split a trainer freezes."""

from __future__ import annotations

import json

import torch

from eagle3q.celery.app import make_app
from eagle3q.config import Settings
from eagle3q.contract import INFERENCE
from eagle3q.prompt_keys import prompt_key, split_key


def _conv(*turns: str, system: str | None = None) -> dict:
    conv = [{"from": "system", "value": system}] if system else []
    for t in turns:
        conv += [{"from": "human", "value": t}, {"from": "gpt", "value": "ref"}]
    return {"conversations": conv}


def test_keys_see_through_whitespace_and_keep_a_conversation_together():
    a = [{"role": "user", "content": "Explain  recursion.\n"}]
    assert prompt_key(a) == prompt_key([{"role": "user", "content": "Explain recursion."}])
    assert prompt_key(a) != prompt_key([{"role": "user", "content": "explain recursion."}])  # other token ids
    assert split_key(a) == split_key([{"role": "user", "content": "explain recursion."}])  # but one side of the split
    later = [*a, {"role": "assistant", "content": "It calls itself."}, {"role": "user", "content": "An example?"}]
    assert split_key(later) == split_key(a) and prompt_key(later) != prompt_key(a)  # every turn on one side
    assert split_key([{"role": "system", "content": "Be brief."}, *a]) != split_key(a)
    assert split_key([{"role": "user", "content": "Explain hashing."}]) != split_key(a)


def test_greedy_runs_send_a_repeated_prompt_once_and_sampled_runs_send_all(redis_server, ledger, tmp_path,  # noqa: ANN001
                                                                           write_jsonl):  # noqa: ANN001
    from rich.console import Console

    from eagle3q.producer import enqueue
    from eagle3q.status import render, snapshot

    data = write_jsonl(tmp_path / "d.jsonl", [
        _conv("What is a heap?"), _conv("Name three rivers."), _conv("What is  a heap?"),  # row 2 repeats row 0
        _conv("Name three rivers.", "And three lakes?"),  # turn 0 repeats row 1, turn 1 is new
        _conv("What is a heap?", system="Answer in French."),  # another prompt: the system message differs
    ])
    for temperature, run in ((0.0, "greedy"), (0.6, "sampled")):
        s = Settings(redis_url=redis_server.url, temperature=temperature, max_queued=0, store_dir=tmp_path / "store")
        rep = enqueue(make_app(s), ledger, s, data, run)
        assert rep.prompts == 6 and rep.duplicate_prompts == 2
        open_ids = ledger.open_ids(run, INFERENCE.name)
        if temperature == 0:
            assert rep.enqueued == 4 and rep.skipped_duplicates == {"2:0": "0:0", "3:0": "1:0"}
            assert ledger.skipped_duplicates(run) == rep.skipped_duplicates
            payloads = [json.loads(ledger.open_payload(run, INFERENCE.name, sid)) for sid in open_ids]
            rows = sorted((p["row"], p["turn"]) for p in payloads)
            assert rows == [(0, 0), (1, 0), (3, 1), (4, 0)]
            # every prompt in one place: the repeats end at once, rejected by name, and the counts add up
            c = ledger.counts(run, INFERENCE.name)
            assert c.incoming == 6 and c.rejected == 2 and c.reasons == {"duplicate_prompt": 2} and c.pending == 4
            from eagle3q.store import Store

            for sid in ledger.rejected(run, INFERENCE.name):  # the store agrees with the ledger, and says why
                rej = Store(s.store_dir).read_rejection(run, INFERENCE.name, sid)
                assert rej.reason == "duplicate_prompt"
                assert "row 0 turn 0" in rej.detail or "row 1 turn 0" in rej.detail
        else:
            assert rep.enqueued == 6 and not rep.skipped_duplicates and len(open_ids) == 6
            assert ledger.counts(run, INFERENCE.name).rejected == 0
        snap = snapshot(ledger, run)
        assert snap["duplicate_prompts"] == 2 and snap["skipped_duplicates"] == (2 if temperature == 0 else 0)
        console = Console(width=200, record=True)
        console.print(render(snap))
        shown = console.export_text()
        assert "exact duplicate prompts in the data set: 2" in shown
        assert ("2 not generated: temperature 0" in shown) == (temperature == 0)
        again = enqueue(make_app(s), ledger, s, data, run)  # a re-run decides the same, sends nothing new
        assert again.enqueued == 0 and again.skipped_duplicates == rep.skipped_duplicates
        assert ledger.counts(run, INFERENCE.name).incoming == 6  # nothing counted twice


def test_the_split_keeps_every_repeat_of_a_prompt_on_one_side(tiny, tmp_path):  # noqa: ANN001
    from eagle3q.draft.manifest import load_or_create, split_report
    from eagle3q.extraction.transformers_backend import Extracted, to_safetensors
    from eagle3q.store import Store

    store = Store(tmp_path)
    h = 64
    prompts = [f"question {i % 25}" for i in range(60)]  # 25 prompts, most of them repeated in other rows
    for row, text in enumerate(prompts):
        ids = list(range(3, 13))
        ex = Extracted(torch.zeros(10, 3 * h), torch.zeros(10, h))
        store.write_hidden("r", f"{row:032x}", to_safetensors(
            ids, [0] * 4 + [1] * 6, ex,
            {"dataset": "d", "row": row, "split_key": split_key([{"role": "user", "content": text}])}))
    m = load_or_create(store, "r", 0.3)
    side = {}
    for e in (*m.train, *m.val):
        side.setdefault(e.split_key, set()).add(e in m.val)
    assert len(side) == 25 and all(len(v) == 1 for v in side.values())  # by row, 0.3 x 60 rows would mix them
    rep = split_report(m)
    assert rep["prompts_on_both_sides"] == 0 and rep["train_prompts"] + rep["val_prompts"] == 25
    assert rep["repeated_samples"] == 35 and rep["train_samples"] + rep["val_samples"] == 60
    assert 0 < rep["val_prompts"] < 25
