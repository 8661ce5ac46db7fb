"""Accepted samples with hidden states, made in one process without the queue: the tiny target generates through
the simulator's generator (as `make demo` does), eagle3q's validation accepts, the transformers backend extracts.
For tests and benchmarks that need a trained-on run quickly (no Redis, no workers)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3q.contract import Sampling
from eagle3q.extraction.transformers_backend import TransformersExtractor, to_safetensors
from eagle3q.generate.profiles import get_profile, resolve
from eagle3q.generate.validation import validate
from eagle3q.prompt_keys import split_key
from eagle3q.sim.server import SimConfig, Simulator
from eagle3q.sources import Prompt
from eagle3q.store import Sample, Store


def write_samples(tiny: Path | str, store: Store, run: str, prompts: Sequence[Prompt], mean_tokens: int = 48,
                  dataset: str = "d", first_index: int = 0) -> list[str]:
    """One greedy sample per prompt, stored with its hidden-state file; the ids are the prompt's index as 32 hex
    digits (from `first_index`). Raises AssertionError on a sample that validation rejects."""
    sim = Simulator(SimConfig(tokenizer=str(tiny), target_model=str(tiny), mean_output_tokens=mean_tokens))
    rp = resolve(get_profile("kimi_k2"), sim.tok.token_to_id, sim.tok.vocab_size)
    ex = TransformersExtractor(str(tiny), None, "cpu", "float32")
    ids_out = []
    for i, p in enumerate(prompts, start=first_index):
        resp = sim._response({"return_token_ids": True}, sim.generate(p.messages, True, 4096))
        v = validate(resp, rp, sim.tok, True)
        assert v.ok, v
        ids = v.prompt_ids + v.gen_ids
        mask = [0] * len(v.prompt_ids) + [1] * len(v.gen_ids)
        sid = f"{i:032x}"
        store.write_sample(Sample(sample_id=sid, run=run, dataset=dataset, row=p.row, turn=p.turn, model="m",
                                  profile="kimi_k2", thinking=True,
                                  sampling=Sampling(temperature=0, top_p=1, max_tokens=4096), messages=p.messages,
                                  input_ids=ids, loss_mask=mask, num_prompt_tokens=len(v.prompt_ids),
                                  reasoning=v.reasoning, content=v.content, finish_reason="stop", truncated=False,
                                  endpoint="sim", latency_s=0.0))
        store.write_hidden(run, sid, to_safetensors(
            ids, mask, ex.extract([ids])[0], {"aux_layer_ids": ex.aux_ids, "final_state": ex.final_state,
                                              "dataset": dataset, "row": p.row, "split_key": split_key(p.messages)}))
        ids_out.append(sid)
    return ids_out
