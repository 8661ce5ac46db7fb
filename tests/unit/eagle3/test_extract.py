"""Hidden-state extraction on the tiny local Llama: layer conventions, batching, validation, the file format."""

from __future__ import annotations

import pytest
import torch

from eagle3q.extraction.transformers_backend import (
    TransformersExtractor,
    check_aux_ids,
    check_tensors,
    default_aux_ids,
    from_layer_indices,
    plan_batches,
    to_safetensors,
)
from eagle3q.store import Store


@pytest.fixture(scope="module")
def extractor(tiny):  # noqa: ANN001, ANN201
    return TransformersExtractor(str(tiny), None, "cpu", "float32")


def test_layer_id_conventions():
    assert default_aux_ids(61) == [2, 30, 58]  # Kimi-K2.5
    assert from_layer_indices([1, 29, 57]) == [2, 30, 58]  # SpecForge's "output of layer i" -> vLLM ids
    with pytest.raises(ValueError):
        check_aux_ids([2, 4, 9], 8)
    with pytest.raises(ValueError):
        check_aux_ids([2, 4], 8)
    assert check_aux_ids([6, 2, 4], 8) == [2, 4, 6]  # vLLM captures in layer order: fc's columns follow it
    with pytest.raises(ValueError, match="repeat"):
        check_aux_ids([2, 2, 4], 8)


def test_rope_settings_come_from_the_target_in_both_config_layouts():
    from eagle3q.draft.model import DraftConfig

    base = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1000}
    v4 = DraftConfig.from_target({**base, "rope_theta": 50000.0,
                                  "rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, 512)
    assert v4.rope_theta == 50000.0 and v4.rope_scaling == {"rope_type": "yarn", "factor": 32.0}
    v5 = DraftConfig.from_target({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0,
                                                              "factor": 32.0}}, 512)
    assert v5.rope_theta == 50000.0 and v5.rope_scaling == {"rope_type": "yarn", "factor": 32.0}
    plain = DraftConfig.from_target({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, 512)
    assert plain.rope_theta == 5e5 and plain.rope_scaling is None
    kimi = DraftConfig.from_target({"text_config": {**base, "rope_theta": 50000.0}}, 512)  # multimodal wrapper
    assert kimi.rope_theta == 50000.0


def test_aux_ids_are_vllm_ids(extractor):  # noqa: ANN001
    """id k = output of decoder layer k-1, checked with forward hooks on the real layers."""
    ids = list(range(5, 25))
    outputs = {}
    layers = extractor.decoder.layers
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o[0] if isinstance(o, tuple)
                                                                                    else o))
             for n, layer in enumerate(layers)]
    try:
        ex = extractor.extract([ids])[0]
    finally:
        for h in hooks:
            h.remove()
    h = extractor.hidden_size
    assert extractor.aux_ids == [2, 4, 5]
    for slot, layer_id in enumerate(extractor.aux_ids):
        torch.testing.assert_close(ex.aux[:, slot * h:(slot + 1) * h], outputs[layer_id - 1][0].float())


def test_final_state_is_before_the_norm_and_the_norm_recovers_what_the_head_reads(extractor, tiny):  # noqa: ANN001
    """What vLLM's extraction returns: the last layer's output before the final norm. Applying the norm gives
    transformers' last hidden state (what the LM head reads) and the target's own logits."""
    from eagle3q.target import final_norm, load_target_tensors, target_config

    ids = list(range(7, 40))
    outputs = {}
    last = extractor.decoder.layers[-1]
    hook = last.register_forward_hook(lambda m, i, o: outputs.__setitem__("last", o[0] if isinstance(o, tuple) else o))
    try:
        ex = extractor.extract([ids])[0]
    finally:
        hook.remove()
    assert extractor.final_state == "pre_norm"
    torch.testing.assert_close(ex.final, outputs["last"][0].float())
    t = load_target_tensors(tiny)
    normed = final_norm(ex.final, t["norm"], target_config(tiny)["rms_norm_eps"])
    with torch.inference_mode():
        out = extractor.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(normed, out.hidden_states[-1][0].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed @ t["lm_head"].T, out.logits[0].float(), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ex.final, normed, atol=1e-2)  # the norm matters (the tiny target's weight is not 1)


def test_batched_equals_alone(extractor):  # noqa: ANN001
    seqs = [list(range(10, 10 + n)) for n in (7, 31, 18, 31, 3)]
    alone = [extractor.extract([s])[0] for s in seqs]
    together = extractor.extract(seqs)
    assert len(together) == len(alone) == 5
    for a, b, s in zip(alone, together, seqs, strict=True):
        assert a.aux.shape == b.aux.shape == (len(s), 3 * extractor.hidden_size)  # no padding kept
        torch.testing.assert_close(a.aux.bfloat16(), b.aux.bfloat16(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(a.final.bfloat16(), b.final.bfloat16(), atol=2e-2, rtol=2e-2)


def test_plan_batches_respects_budget():
    lengths = [10, 500, 30, 30, 2000, 12, 29]
    batches = plan_batches(lengths, budget=1000)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert longest * len(b) <= 1000 or len(b) == 1
    assert [4] in batches  # longer than the budget: alone


def test_file_format_and_validation(extractor, tmp_path):  # noqa: ANN001
    ids = list(range(40, 60))
    ex = extractor.extract([ids])[0]
    assert check_tensors(ids, ex, extractor.hidden_size) is None
    store = Store(tmp_path)
    n = store.write_hidden("r", "s", to_safetensors(ids, [0] * 5 + [1] * 15, ex,
                                                   {"aux_layer_ids": [2, 4, 5], "final_state": extractor.final_state}))
    assert store.hidden_valid("r", "s", 20) == n and store.hidden_valid("r", "s", 21) is None
    t = store.read_hidden("r", "s")[0]
    assert t["aux_hidden_states"].dtype == t["hidden_state"].dtype == torch.bfloat16
    assert t["input_ids"].tolist() == ids and t["loss_mask"].sum() == 15
    assert t["aux_hidden_states"].shape == (20, 3 * extractor.hidden_size)
    assert store.hidden_header("r", "s").meta("aux_layer_ids") == [2, 4, 5]
    tok, mask = store.hidden_tokens("r", "s")  # ranged reads, no states decoded
    assert tok.tolist() == ids and mask.tolist() == [0] * 5 + [1] * 15
    # A truncated object (what a non-atomic writer could leave) is not valid, whatever its header says.
    store.blobs.put(store.hidden_key("r", "cut"), store.hidden_bytes("r", "s")[:-7])
    assert store.hidden_valid("r", "cut", 20) is None

    bad = type(ex)(ex.aux.clone(), ex.final.clone())
    bad.aux[3, 0] = float("nan")
    assert check_tensors(ids, bad, extractor.hidden_size) == "hs_nonfinite"
    assert check_tensors(ids[:-1], ex, extractor.hidden_size) == "hs_length_mismatch"
    huge = type(ex)(ex.aux * 1e39, ex.final)  # finite in float32? no: inf after scaling -> refused either way
    with pytest.raises(OverflowError):
        to_safetensors(ids, [1] * 20, huge, {})


def test_fp8_files_hold_half_the_bytes_and_restore_within_e4m3_rounding(extractor, tmp_path):  # noqa: ANN001
    """EAGLE3Q_HS_DTYPE=fp8: e4m3 with a float32 scale per token and layer; read back as float32 within e4m3's
    rounding (3 mantissa bits: <= 1/16 of a value, and a scale's step near zero), the same ids and mask, and the
    size that `bytes_per_token` promises."""
    from eagle3q.extraction.estimate import bytes_per_token
    from eagle3q.store.hidden_format import stored_dtype

    ids = list(range(7, 207))
    ex = extractor.extract([ids])[0]
    ex = type(ex)(ex.aux.clone(), ex.final.clone())
    ex.final[5] *= 300  # a token with an outlier: its own scale, the other tokens keep theirs
    meta = {"aux_layer_ids": extractor.aux_ids, "final_state": extractor.final_state}
    store = Store(tmp_path)
    sizes = {d: store.write_hidden("r", d, to_safetensors(ids, [0] * 20 + [1] * 180, ex, meta, d))
             for d in ("bf16", "fp8")}
    h = extractor.hidden_size
    for d, n in sizes.items():
        header = n - 200 * bytes_per_token(h, hs_dtype=d)
        assert 0 < header < 2000, (d, n)  # the rest is the safetensors header (names, shapes, metadata)
    assert 0.5 < sizes["fp8"] / sizes["bf16"] < 0.6  # H=64: (4 x 68 + 9) / (8 x 64 + 9) = 0.54; Kimi: 0.50
    assert stored_dtype(store.hidden_header("r", "fp8")) == "fp8"
    assert stored_dtype(store.hidden_header("r", "bf16")) == "bf16"
    t, final_state = store.read_hidden("r", "fp8")
    assert final_state == extractor.final_state and t["input_ids"].tolist() == ids and int(t["loss_mask"].sum()) == 180
    for key, want, layers in (("aux_hidden_states", ex.aux, 3), ("hidden_state", ex.final, 1)):
        got = t[key]
        assert got.dtype == torch.float32 and got.shape == want.shape
        amax = want.reshape(200, layers, h).abs().amax(-1, keepdim=True).expand(200, layers, h).reshape(want.shape)
        err = (got - want).abs()
        assert bool((err <= want.abs() / 16 + amax * 2**-9).all()), key
        rel = (err.norm(dim=-1) / want.norm(dim=-1)).max().item()
        assert rel < 0.05, (key, rel)
    # The outlier token did not cost the others their precision (a scale per token, not per file).
    assert (t["hidden_state"][6] - ex.final[6]).abs().max() <= ex.final[6].abs().max() / 16
    raw, _ = store.read_hidden("r", "fp8", restore=False)
    assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert raw["aux_hidden_states_scales"].shape == (200, 3, 1)
    assert raw["hidden_state_scales"].dtype == torch.float32 and raw["hidden_state_scales"].shape == (200, 1, 1)
    with pytest.raises(ValueError, match="bf16 or fp8"):
        to_safetensors(ids, [1] * 200, ex, meta, "int4")


def test_storage_estimate_from_local_dir_and_hub_cache(tiny, tmp_path, monkeypatch):  # noqa: ANN001
    import shutil

    from eagle3q.config import Settings
    from eagle3q.extraction.estimate import bytes_per_token, estimate_for_run

    assert bytes_per_token(7168) == 2 * 7168 * 4 + 9  # Kimi-K2.5: ~57 KB per token
    assert bytes_per_token(7168, hs_dtype="fp8") == 7172 * 4 + 9  # and half that in fp8
    fp8 = estimate_for_run(Settings(target_model=str(tiny), hs_dtype="fp8"), 100, tokens_per_sample=1000)
    assert fp8 and "fp8" in fp8 and f"{100 * 1000 * bytes_per_token(64, hs_dtype='fp8') / 1e9:.2f} GB" in fp8
    local = estimate_for_run(Settings(target_model=str(tiny), max_tokens=1024), 100, tokens_per_sample=1000)
    assert local and "H=64" in local and f"{100 * 1000 * bytes_per_token(64) / 1e9:.2f} GB" in local
    assert "GB free" in local and "WARNING" not in local  # 12.9 MB fits anywhere
    # A hub id whose config is in the local Hugging Face cache (Kimi-K2.5 nests it under text_config).
    snap = tmp_path / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"text_config": {"hidden_size": 7168}}')
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    est = estimate_for_run(Settings(target_model="moonshotai/Kimi-K2.5"), 10_000, tokens_per_sample=2000)
    total = 10_000 * 2000 * bytes_per_token(7168)
    assert 1.1e12 < total < 1.2e12  # Kimi-K2.5: 10K samples x 2K tokens x ~57 KB a token
    assert est and "H=7168" in est and f"{total / 1e9:.2f} GB" in est
    if shutil.disk_usage(tmp_path).free < total:  # 1.1 TB: more than this machine's disk
        assert "WARNING: not enough" in est
    assert estimate_for_run(Settings(target_model="nobody/unknown-model"), 10, tokens_per_sample=10) is None


def test_a_hub_id_in_the_local_cache_is_a_target_directory(tiny, tmp_path, monkeypatch):  # noqa: ANN001
    """EAGLE3Q_TARGET_MODEL=moonshotai/Kimi-K2.5 with the model downloaded into HF_HOME (the compose file's
    default): the head, norm and config are read from the cache's snapshot; nothing is downloaded, and an id that
    is not cached names the fix."""
    import shutil

    from eagle3q.target import load_target_tensors, resolve_model_dir, target_config

    repo = tmp_path / "hub" / "models--acme--tiny"
    snap = repo / "snapshots" / "abc"
    shutil.copytree(tiny, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir("acme/tiny") == snap and resolve_model_dir(tiny) == tiny
    assert target_config("acme/tiny")["hidden_size"] == target_config(tiny)["hidden_size"]
    assert torch.equal(load_target_tensors("acme/tiny")["lm_head"], load_target_tensors(tiny)["lm_head"])
    with pytest.raises(FileNotFoundError, match="huggingface-cli download acme/absent"):
        resolve_model_dir("acme/absent")
