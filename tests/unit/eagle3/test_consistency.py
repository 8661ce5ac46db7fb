"""The consistency check on the tiny target: the right final state predicts the greedy tokens it came with; the
L-1 output stored as final, and states shifted by one token, do not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3q.extraction.consistency import ConsistencyCheck, check_positions
from eagle3q.extraction.transformers_backend import TransformersExtractor


@pytest.fixture(scope="module")
def samples(tiny: Path) -> list[tuple[list[int], list[int]]]:
    """Twelve prompts and the tiny target's own greedy answers under the demo's shaping rule (what the simulator and
    vLLM's engine generate in the demo), with their loss masks."""
    from transformers import AutoModelForCausalLM

    from eagle3q.dev.shaped_greedy import ShapedGreedy, hf_generate

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    rule = ShapedGreedy.for_profile("kimi_k2", str(tiny / "tokenizer.json"))
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(12):
        prompt = torch.randint(10, 400, (12,), generator=g).tolist()
        answer = hf_generate(model, rule, prompt, 200)
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


@pytest.fixture(scope="module")
def check(tiny: Path) -> ConsistencyCheck:
    return ConsistencyCheck(tiny, positions=32)


def test_the_right_state_agrees_a_wrong_layer_or_a_shift_does_not(tiny: Path, samples, check) -> None:  # noqa: ANN001
    ex = TransformersExtractor(str(tiny), [2, 4, 7], "cpu", "float32")  # L = 8: id 7 is the last layer's input
    h = ex.hidden_size
    ties = 0
    for i, (ids, mask) in enumerate(samples):
        out = ex.extract([ids])[0]
        sid = f"s{i}"
        right = check.agreement(sid, ids, mask, out.final.to(torch.bfloat16), "pre_norm")
        # The forced markers (the shaping rule's </think> and end of turn) are not the model's argmax.
        assert right.positions >= 20 and right.top1 >= 0.9 and right.offset == 0, right
        assert check.passes(right, greedy=True)

        wrong_layer = out.aux[:, 2 * h:]  # id L-1 stored as the final state (id L)
        a = check.agreement(sid, ids, mask, wrong_layer, "pre_norm")
        assert not check.passes(a, greedy=True), a

        # States one token late (row t holds t-1's state) agree best read one token on, and the other way round;
        # in an answer that only repeats itself every offset agrees alike and a shift cannot be told.
        for roll, offset in ((1, 1), (-1, -1)):
            a = check.agreement(sid, ids, mask, torch.roll(out.final, roll, 0), "pre_norm")
            if len(set(a.by_offset)) == 1:
                ties += 1
                continue
            assert a.offset == offset and not check.passes(a, greedy=True), a
            assert not check.passes(a, greedy=False)
    assert ties <= 2

    # A post-norm file goes straight to the head.
    ids, mask = samples[0]
    post = ex.final_norm(ex.extract([ids])[0].final)
    assert check.agreement("s0", ids, mask, post, "post_norm").top1 >= 0.9


def test_text_that_never_emits_a_structural_token_still_agrees(tiny: Path, check) -> None:  # noqa: ANN001
    """Greedy text under a rule that forbids the special tokens mid-text (the simulator's, a bad_words list): where
    the model's own argmax is </think> or end of turn the text goes on with its best ordinary token, and the check,
    which leaves structural tokens out on both sides, agrees as on any greedy text."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    special = sorted(check.skip)
    assert {1, 2, 7} <= set(special)  # <think>, </think>, <|im_end|> of the tiny tokenizer
    ex = TransformersExtractor(str(tiny), None, "cpu", "float32")
    forced = 0
    for seed in range(6):
        ids = torch.randint(20, 400, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
        n_prompt = len(ids)
        cache, step = DynamicCache(), ids  # generated with the KV cache (the check reads one full forward)
        with torch.inference_mode():
            for _ in range(120):
                logits = model(torch.tensor([step]), None, None, cache, use_cache=True).logits[0, -1]
                forced += int(logits.argmax()) in special
                logits[special] = float("-inf")
                ids.append(int(logits.argmax()))
                step = ids[-1:]
        mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
        a = check.agreement(f"g{seed}", ids, mask, ex.extract([ids])[0].final.to(torch.bfloat16), "pre_norm")
        assert a.top1 >= 0.9 and check.passes(a, greedy=True), a
    assert forced > 0  # the rule did overrule the model: the case is exercised


def test_a_sampled_sample_has_the_lower_threshold(tiny: Path) -> None:
    from eagle3q.extraction.consistency import Agreement

    c = ConsistencyCheck(tiny, min_agreement=0.4, min_greedy=0.8)
    assert c.passes(Agreement(0.6, 32), greedy=False) and not c.passes(Agreement(0.6, 32), greedy=True)
    assert not c.passes(Agreement(0.3, 32), greedy=False)
    assert not c.passes(Agreement(0.9, 32, offset=1), greedy=False)
    assert c.passes(Agreement(1.0, 0), greedy=True)  # nothing generated: nothing to check


def test_positions_are_generated_bounded_and_the_same_on_a_rerun() -> None:
    mask = [0] * 10 + [1] * 100
    ids = list(range(100, 210))
    a, b = check_positions("abc", ids, mask, 32), check_positions("abc", ids, mask, 32)
    assert a == b and len(a) == 32 and len(set(a)) == 32
    assert all(mask[t + 1] for t in a) and min(a) >= 9 and max(a) <= 108
    assert check_positions("abd", ids, mask, 32) != a  # drawn per sample
    assert check_positions("abc", ids[:8], [0] * 5 + [1] * 3, 32) == [4, 5, 6]
    assert check_positions("abc", ids[:5], [0] * 5, 32) == []  # nothing generated: nothing to check, and it passes
    # A structural next token (here 106: say </think>) is never a checked position.
    assert check_positions("abc", ids[:8], [0] * 5 + [1] * 3, 32, skip={106}) == [4, 6]


def test_only_the_norm_and_head_are_read_and_a_quantized_head_is_refused(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny / "model.safetensors"))
    shutil.copy(tiny / "config.json", tmp_path / "config.json")
    # Sharded like a large target: the head and norm in one shard, the layers in another that is never opened.
    head = {k: v for k, v in tensors.items() if k in ("lm_head.weight", "model.norm.weight")}
    save_file(head, str(tmp_path / "head.safetensors"))
    (tmp_path / "layers.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {k: "head.safetensors" if k in head else "layers.safetensors" for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    c = ConsistencyCheck(tmp_path)
    assert c.head.shape == tensors["lm_head.weight"].shape

    head["lm_head.weight"] = torch.zeros(head["lm_head.weight"].shape, dtype=torch.int32)
    save_file(head, str(tmp_path / "head.safetensors"))
    with pytest.raises(ValueError, match="quantized"):
        ConsistencyCheck(tmp_path)
