"""`eagle3q export-data`: a run's hidden states in speculators' and SpecForge's layouts, checked for the layout
here (file names, keys, shapes, dtypes, the norm); the peers' own readers run in tests/peers/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3q.extraction.transformers_backend import TransformersExtractor, to_safetensors
from eagle3q.interop.peer_formats import ExportError, export_data
from eagle3q.target import final_norm, load_target_tensors, target_config
from tests.store_paths import hidden_file, load_hidden


@pytest.fixture
def run_store(hidden_run):  # noqa: ANN001, ANN201
    return hidden_run


def test_speculators_layout(run_store, tmp_path, tiny):  # noqa: ANN001
    import datasets

    out = tmp_path / "spec"
    rep = export_data(run_store, "r", "speculators", out, str(tiny), progress=False)
    assert (rep.total, rep.written, rep.skipped) == (5, 5, 0)
    order = json.loads((out / "eagle3q-export.json").read_text())["ids"]
    ds = datasets.load_from_disk(str(out))
    assert len(ds) == 5 and set(ds.column_names) == {"input_ids", "loss_mask", "seq_len"}
    for i, sid in enumerate(order):
        ours = load_hidden(hidden_file(run_store, "r", sid))
        theirs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(theirs) == {"token_ids", "hidden_states"}
        assert theirs["token_ids"].dtype == torch.int64 and theirs["hidden_states"].dtype == torch.bfloat16
        t, h = ours["input_ids"].numel(), ours["hidden_state"].shape[-1]
        assert theirs["hidden_states"].shape == (t, 4, h)
        assert torch.equal(theirs["hidden_states"][:, :3].reshape(t, 3 * h), ours["aux_hidden_states"])
        assert torch.equal(theirs["hidden_states"][:, 3], ours["hidden_state"])  # pre-norm, as vLLM gives it
        assert torch.equal(ds[i]["input_ids"], theirs["token_ids"]) and int(ds[i]["seq_len"]) == t
        assert torch.equal(ds[i]["loss_mask"], ours["loss_mask"].long())


def _specforge_file(out: Path, i: int) -> Path:
    """Sample i of a SpecForge export, in train/ or eval/ by its side of the split."""
    return next(out.glob(f"*/data_{i}.ckpt"))


def test_specforge_layout_is_post_norm(run_store, tmp_path, tiny):  # noqa: ANN001
    out = tmp_path / "sf"
    export_data(run_store, "r", "specforge", out, str(tiny), progress=False)
    order = json.loads((out / "eagle3q-export.json").read_text())["ids"]
    tensors = load_target_tensors(tiny)
    eps = target_config(tiny)["rms_norm_eps"]
    assert len(order) == len(run_store.hidden_ids("r")) > 0
    for i, sid in enumerate(order):
        ours = load_hidden(hidden_file(run_store, "r", sid))
        raw = torch.load(_specforge_file(out, i), weights_only=True)
        assert set(raw) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        t, h = ours["input_ids"].numel(), ours["hidden_state"].shape[-1]
        assert raw["hidden_state"].shape == (1, t, h) and raw["aux_hidden_state"].shape == (1, t, 3 * h)
        want = final_norm(ours["hidden_state"].float(), tensors["norm"], eps).bfloat16()
        torch.testing.assert_close(raw["hidden_state"][0], want, atol=0, rtol=0)
        assert torch.equal(raw["input_ids"], ours["input_ids"]) and raw["loss_mask"].dtype == torch.int64


def test_resume_keeps_the_order_and_appends_new_samples(run_store, tmp_path, tiny):  # noqa: ANN001
    out = tmp_path / "resume"
    export_data(run_store, "r", "specforge", out, str(tiny), progress=False)
    first = json.loads((out / "eagle3q-export.json").read_text())["ids"]
    _specforge_file(out, 2).unlink()  # as if killed before writing it
    stamp = _specforge_file(out, 0).stat().st_mtime_ns
    ex = TransformersExtractor(str(tiny), None, "cpu", "float32")
    ids = list(range(50, 70))
    new = "0" * 31 + "a"  # sorts before the others: it must still go to the end
    run_store.write_hidden("r", new, to_safetensors(ids, [0] * 4 + [1] * 16, ex.extract([ids])[0],
                                                    {"aux_layer_ids": ex.aux_ids, "final_state": ex.final_state}))
    rep = export_data(run_store, "r", "specforge", out, str(tiny), progress=False)
    order = json.loads((out / "eagle3q-export.json").read_text())["ids"]
    assert order[:5] == first and order[5:] == [new]  # frozen order, the new sample at the end
    assert (rep.written, rep.skipped) == (2, 4) and _specforge_file(out, 0).stat().st_mtime_ns == stamp
    hidden_file(run_store, "r", new).unlink()


def test_bad_requests_are_clear_errors(run_store, tmp_path, tiny):  # noqa: ANN001
    with pytest.raises(ExportError, match="format must be one of"):
        export_data(run_store, "r", "eagle", tmp_path / "x", str(tiny), progress=False)
    with pytest.raises(ExportError, match="no hidden-state objects"):
        export_data(run_store, "nope", "speculators", tmp_path / "y", str(tiny), progress=False)
    export_data(run_store, "r", "specforge", tmp_path / "z", str(tiny), progress=False)
    with pytest.raises(ExportError, match="choose another directory"):
        export_data(run_store, "r", "speculators", tmp_path / "z", str(tiny), progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "other.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export_data(run_store, "r", "specforge", tmp_path / "full", str(tiny), progress=False)
