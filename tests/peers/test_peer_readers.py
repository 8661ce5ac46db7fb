"""The peers' own readers, converters and vocab functions on what eagle3q writes (speculators 0.9, SpecForge 0.2).
A peer that rejects our output, or computes other numbers from it, fails here."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3q.interop.peer_formats import export_data
from eagle3q.target import load_target_tensors, target_config
from tests.store_paths import hidden_files


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm class speculators' Llama verifier uses (transformers' LlamaRMSNorm), with the target's weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(weight.numel(), eps=eps)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(h.float())


def _target_logits(tiny: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


def test_speculators_reads_our_export_and_its_trainer_gets_the_targets_logits(hidden_run, tmp_path, tiny):  # noqa: ANN001
    from speculators.data_generation.offline import check_hidden_states
    from speculators.models.eagle3 import shift_batch
    from speculators.train.data import ArrowDataset

    out = tmp_path / "speculators"
    export_data(hidden_run, "r", "speculators", out, str(tiny), progress=False)
    ds = ArrowDataset(max_len=4096, datapath=out, on_missing="raise")  # its trainer's reader, offline files only
    assert len(ds) == 5
    tensors, eps = load_target_tensors(tiny), target_config(tiny)["rms_norm_eps"]
    for i in range(len(ds)):
        raw = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        check_hidden_states(raw, ds.data[i]["input_ids"].tolist())  # its own validator
        item = ds[i]
        t = item["input_ids"].numel()
        assert item["hidden_states"].shape == (t, 3 * 64) and item["verifier_last_hidden_states"].shape == (t, 64)
        assert int(item["loss_mask"].sum()) == t - 6
        shifted = shift_batch(item)
        assert shifted["input_ids"].numel() == t - 1
        # Its trainer's targets: verifier_lm_head(verifier_norm(last)). From our pre-norm state that is the target's
        # own distribution; a post-norm state normalised a second time would not be.
        logits = _rms_norm(item["verifier_last_hidden_states"], tensors["norm"], eps) @ tensors["lm_head"].T
        want = _target_logits(tiny, item["input_ids"])
        twice = _rms_norm(_rms_norm(item["verifier_last_hidden_states"], tensors["norm"], eps), tensors["norm"], eps)
        good = (logits - want).abs().max().item()
        bad = (twice @ tensors["lm_head"].T - want).abs().max().item()
        assert good < 0.05 * want.abs().max().item() and bad > 5 * good, (good, bad)
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_speculators_reads_our_fp8_export_with_its_fp8_backend(hidden_run, hidden_run_fp8, tmp_path, tiny):  # noqa: ANN001
    """A store kept in fp8 exports in hs_connectors' FP8 layout (e4m3 `hidden_states` + `hidden_states_scales`, one
    scale per token and layer): the backend speculators' trainer builds for `--hidden-states-backend fp8` reads
    it, its validator passes, and its trainer's inputs equal ours (restored) and the bf16 export's within e4m3's
    rounding, at half the bytes. SpecForge reads the same fp8 store's export, restored to its bf16."""
    import argparse

    from hs_connectors import FP8Backend
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    from tests.store_paths import read_hidden

    out, ref = tmp_path / "speculators-fp8", tmp_path / "speculators-bf16"
    rep = export_data(hidden_run_fp8, "r", "speculators", out, str(tiny), progress=False)
    assert rep.hs_dtype == "fp8" and "--hidden-states-backend fp8" in rep.reader_hint()
    assert "--hidden-states-backend" not in export_data(hidden_run, "r", "speculators", ref, str(tiny),
                                                         progress=False).reader_hint()
    transfer = FP8Backend.from_train_args(argparse.Namespace(hidden_states_path=None), str(out))
    ds = ArrowDataset(max_len=4096, datapath=out, transfer=transfer, on_missing="raise")
    plain = ArrowDataset(max_len=4096, datapath=ref, on_missing="raise")
    files = sorted(hidden_files(hidden_run_fp8, "r"), key=lambda f: f.stem)
    tensors, eps = load_target_tensors(tiny), target_config(tiny)["rms_norm_eps"]
    for i in range(len(ds)):
        name = f"hs_{i}.safetensors"
        raw = load_file(str(out / "hidden_states" / name))
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states_scales"].shape[1:] == (4, 1)
        assert (out / "hidden_states" / name).stat().st_size < 0.6 * (ref / "hidden_states" / name).stat().st_size
        check_hidden_states(transfer.get_cached(i), ds.data[i]["input_ids"].tolist())  # restored by its backend
        item, want = ds[i], plain[i]
        ours, _ = read_hidden(files[i])
        torch.testing.assert_close(item["hidden_states"].float(), ours["aux_hidden_states"], atol=0, rtol=2**-7)
        for key in ("hidden_states", "verifier_last_hidden_states"):
            a, b = item[key].float(), want[key].float()
            assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() < 0.05, key
        logits = _rms_norm(item["verifier_last_hidden_states"], tensors["norm"], eps) @ tensors["lm_head"].T
        exact = _rms_norm(want["verifier_last_hidden_states"], tensors["norm"], eps) @ tensors["lm_head"].T
        assert (logits.argmax(-1) == exact.argmax(-1)).float().mean() > 0.8
    sf = tmp_path / "specforge-fp8"
    assert export_data(hidden_run_fp8, "r", "specforge", sf, str(tiny), progress=False).hs_dtype == "bf16"
    assert torch.load(next(sf.glob("*/data_0.ckpt")))["aux_hidden_state"].dtype == torch.bfloat16


def test_specforge_reads_our_export_with_its_own_reader(hidden_run, tmp_path, tiny):  # noqa: ANN001
    from specforge.data.preprocessing import process_offline_eagle3_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    out = tmp_path / "specforge"
    export_data(hidden_run, "r", "specforge", out, str(tiny), progress=False)
    refs = OfflineManifestReader(str(out), validate_files=True).read()  # checks every file's keys up front
    assert len(refs) == 5
    tensors = load_target_tensors(tiny)
    for ref in refs:
        raw = load_feature_file(ref.feature_store_uri.removeprefix("file://"))
        sample = process_offline_eagle3_sample(raw, max_len=4096)
        t = raw["input_ids"].numel()
        assert sample["hidden_state"].shape == (1, t, 3 * 64) and sample["target"].shape == (1, t, 64)
        assert sample["input_ids"].shape == sample["loss_mask"].shape == (1, t)
        # SpecForge's target head applies no norm: our post-norm state gives the target's logits as they are.
        logits = sample["target"][0].float() @ tensors["lm_head"].T
        want = _target_logits(tiny, raw["input_ids"])
        assert (logits - want).abs().max().item() < 0.05 * want.abs().max().item()
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_vocab_mapping_is_the_peers_bit_for_bit(hidden_run, tiny):  # noqa: ANN001
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from eagle3q.draft.vocab import build_mapping, count_tokens

    vocab = int(target_config(tiny)["vocab_size"])
    counts = count_tokens(hidden_run, "r", hidden_run.hidden_ids("r"), vocab)
    freq = {int(i): int(counts[i]) for i in torch.nonzero(counts).flatten()}  # ascending ids
    for n in (16, 64, 300):  # fewer tokens than seen, and more (filled with unseen ones)
        d2t, t2d = build_mapping(counts, n)
        s_d2t, s_t2d = build_vocab_mappings_from_distribution(dict(freq), n, vocab)
        f_d2t, f_t2d = process_token_dict_to_mappings(Counter(freq), n, vocab)
        assert torch.equal(d2t, s_d2t) and torch.equal(t2d, s_t2d), n
        assert torch.equal(d2t, f_d2t) and torch.equal(t2d, f_t2d), n


def test_speculators_converter_and_model_give_our_logits(tiny, tmp_path):  # noqa: ANN001
    """Our export, converted by `speculators convert --algorithm eagle3`'s converter and run by its
    Eagle3DraftModel: the same logits as our draft over three TTT steps (fp32, teacher-forced). The draft has two
    of the default layout's norms: the converter drops the third's weight (below)."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3q.draft.export import load_exported
    from tests.drafts import random_export

    convert = Eagle3Converter().convert
    # speculators 0.9's converter builds its legacy model class, which has no `input_norm`: the weight of
    # `norm_before_fc` (our default layout) is dropped with a warning, so such a draft cannot be converted (the
    # docs say so; vLLM loads our export as it is).
    random_export(tiny, tmp_path / "default", [2, 4, 5])
    convert(tmp_path / "default", tmp_path / "default-conv", base_model=str(tiny), validate=False,
            eagle_aux_hidden_state_layer_ids=[2, 4, 5], norm_before_residual=True)
    assert "input_norm.weight" in load_file(str(tmp_path / "default" / "model.safetensors"))
    assert "input_norm.weight" not in load_file(str(tmp_path / "default-conv" / "model.safetensors"))

    tc, tensors, c, draft, d2t, t2d = random_export(tiny, tmp_path / "ours", [2, 4, 5],
                                                    norms={"norm_before_residual": True, "norm_output": True})
    # The converter takes the aux ids as an option (`--algorithm-kwargs`), the README's command passes our
    # config's top-level ids; the converted config must carry them unchanged (same convention as vLLM's).
    # Nor does it read `norm_before_residual` (it does read norm_output): the documented command passes both.
    ours_cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    convert(tmp_path / "ours", tmp_path / "conv", base_model=str(tiny), validate=True,
            eagle_aux_hidden_state_layer_ids=ours_cfg["eagle_aux_hidden_state_layer_ids"],
            norm_before_residual=ours_cfg["norm_before_residual"])
    cfg = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert (cfg["norm_before_residual"], cfg["norm_before_fc"], cfg["norm_output"]) == (True, False, True)
    theirs = Eagle3DraftModel.from_pretrained(str(tmp_path / "conv"))
    assert theirs.target_layer_ids == [2, 4, 5]
    # The embeddings from the target, with its own loader. `load_verifier_weights()` fills them only where they
    # are NaN, and transformers leaves a missing tensor as whatever memory it got: ask for the overwrite.
    theirs._load_verifier_weights(overwrite_embed_tokens=True)
    theirs = theirs.float().eval()
    assert torch.equal(theirs.d2t.long(), d2t) and torch.equal(theirs.t2d.bool(), t2d)
    ours = load_exported(tmp_path / "ours", tensors["embed"])[0].eval()

    for k, (mine, its) in enumerate(_ttt_logits(theirs, ours, tc["vocab_size"], c.hidden_size, seed=1)):
        assert (mine - its).abs().max().item() <= 1e-4, k


def _ttt_logits(theirs, ours, vocab: int, hidden: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """Our draft's and speculators' Eagle3DraftModel's logits over three teacher-forced TTT steps (fp32) on the same
    random tokens and aux states, each step's rows that are not padding: [(ours, theirs)] per step."""
    from eagle3q.draft.training import _shift

    t = 129  # its flex-attention masks come in blocks of 128 rows
    torch.manual_seed(seed)
    x = torch.randint(0, vocab, (t,))
    aux = torch.randn(t, 3 * hidden)
    rows, pos = t - 1, torch.arange(t - 1) + 1
    captured: list[torch.Tensor] = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
    out = []
    with torch.no_grad():
        theirs(hidden_states=aux[:rows][None], input_ids=x[1:][None], position_ids=pos[None], ttt_steps=3,
               document_ids=torch.zeros(1, rows, dtype=torch.long))
        hook.remove()
        h, cache = ours.combine(aux[:rows]).unsqueeze(0), []
        for k in range(3):
            logits, h = ours.step(_shift(x[1:], k).unsqueeze(0), h, pos + k, cache)
            valid = rows - k  # past the end both pad with token 0
            out.append((logits[0, :valid], captured[k][0, :valid]))
    return out


def test_speculators_hidden_state_client_accepts_our_simulator(tiny, tmp_path):  # noqa: ANN001
    """speculators' own data-generation client (`generate_hidden_states`) and hs-connectors' FileTransfer, against
    the simulator in extract_hidden_states mode: the reply passes its checks, and the connector file passes its
    `check_hidden_states`, with the final state before the norm (what the verifier norm then applies to)."""
    import openai
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import generate_hidden_states

    from eagle3q.dev.local import start_sim
    from eagle3q.extraction.transformers_backend import TransformersExtractor

    proc, url = start_sim(str(tiny), tmp_path / "logs",
                          extra=["--target-model", str(tiny), "--hs-dir", str(tmp_path / "connector")])
    try:
        client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0)
        model = client.models.list().data[0].id
        ids = list(range(11, 47))
        handle, params = generate_hidden_states(client, model, {"input_ids": ids}, timeout=30)
        data = FileTransfer(tmp_path / "connector").get_generated(params)  # waits for the .lock, loads the file
        check_hidden_states(data, ids)
        ref = TransformersExtractor(str(tiny), None, "cpu", "float32").extract([ids])[0]
        assert data["hidden_states"].shape == (len(ids), 4, 64)
        torch.testing.assert_close(data["hidden_states"][:, -1].float(), ref.final, atol=3e-2, rtol=3e-2)
        assert handle == params["hidden_states_path"] and not Path(handle + ".lock").exists()
    finally:
        proc.kill()


def test_the_vllm_backend_reads_hs_connectors_fp8_connector_files(tiny, tmp_path):  # noqa: ANN001
    """A vLLM serving with hs_connectors' FP8HiddenStatesConnector writes e4m3 `hidden_states` with its per-token
    `hidden_states_scales` (its own quantizer, as its `_write_tensors` calls it): the hidden-state backend reads
    them back within e4m3's rounding of the bf16 states, and refuses a file of the wrong shape by name."""
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
    from safetensors.torch import save_file

    from eagle3q.extraction.transformers_backend import TransformersExtractor
    from eagle3q.extraction.vllm_backend import connector_states

    ex = TransformersExtractor(str(tiny), None, "cpu", "float32")
    ids = list(range(5, 69))
    ref = ex.extract([ids])[0]
    h = ex.hidden_size
    layers = torch.cat([ref.aux.reshape(len(ids), 3, h), ref.final.reshape(len(ids), 1, h)], 1).to(torch.bfloat16)
    q, scale = quantize_tensor_to_fp8(layers)
    save_file({"hidden_states": q, SCALES_KEY: scale, "token_ids": torch.tensor(ids)}, str(tmp_path / "c.safetensors"))
    data = load_file(str(tmp_path / "c.safetensors"))
    got = connector_states(data, ids, ex.aux_ids, ex.num_layers, h)
    assert got.reason is None and got.aux.shape == (len(ids), 3 * h) and got.final.shape == (len(ids), h)
    for a, b in ((got.aux, ref.aux), (got.final, ref.final)):
        # one scale for all four layers (theirs): the error is against the token's largest layer
        assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max() < 0.1
    assert connector_states(data, ids[:-1], ex.aux_ids, ex.num_layers, h).reason == "hs_prompt_mismatch"
    assert connector_states(data, ids, ex.aux_ids, ex.num_layers, h + 1).reason == "hs_length_mismatch"


def test_the_peers_read_the_held_out_split_and_the_vocabulary(hidden_run, tmp_path, tiny):  # noqa: ANN001
    """export-data carries the split in each peer's convention and the vocabulary in its file names: speculators'
    ArrowDataset with the printed `--train-data-ratio` holds exactly our training samples in its train part and
    our held-out ones in its val part; its vocab loader reads our d2t/t2d and, from our token_freq.pt alone, builds
    the same; SpecForge's reader finds the training samples under train/ and the held-out ones under eval/, and
    its vocab file holds the same mapping."""
    import argparse

    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.data import ArrowDataset

    from eagle3q.draft.manifest import entry_for, is_validation
    from eagle3q.draft.vocab import build_mapping, count_tokens
    from tests.store_paths import load_hidden

    files = hidden_files(hidden_run, "r")
    tokens = {p.stem: tuple(load_hidden(p)["input_ids"].tolist()) for p in files}
    held = {p.stem for p in files if is_validation(entry_for(hidden_run, "r", p.stem).split_key, 0.5)}
    assert 0 < len(held) < len(files)
    want_held = {tokens[s] for s in held}
    counts = count_tokens(hidden_run, "r", [p.stem for p in files if p.stem not in held],
                          int(target_config(tiny)["vocab_size"]))
    d2t, t2d = build_mapping(counts, 64)

    out = tmp_path / "speculators"
    rep = export_data(hidden_run, "r", "speculators", out, str(tiny), progress=False, val_fraction=0.5,
                      draft_vocab_size=64)
    assert f"--train-data-ratio {rep.train_data_ratio}" in rep.reader_hint() and rep.vocab_size == 64
    parts = {split: ArrowDataset(max_len=4096, datapath=out, on_missing="raise", train_ratio=rep.train_data_ratio,
                                 split=split) for split in ("train", "val")}
    seen = {split: {tuple(ds.data[i]["input_ids"].tolist()) for i in range(len(ds))} for split, ds in parts.items()}
    assert seen["val"] == want_held and seen["train"] == set(tokens.values()) - want_held
    args = argparse.Namespace(d2t_path=None, t2d_path=None, data_path=str(out), draft_vocab_size=64,
                              token_freq_path=None, verifier_name_or_path=str(tiny), trust_remote_code=False)
    s_d2t, s_t2d, n = parse_vocab_mappings(args)  # its trainer's own lookup: d2t-64.npy / t2d-64.npy in the data dir
    assert n == 64 and torch.equal(s_d2t.long(), d2t) and torch.equal(s_t2d.bool(), t2d)
    for name in ("d2t-64.npy", "t2d-64.npy"):
        (out / name).unlink()
    r_d2t, r_t2d, _ = parse_vocab_mappings(args)  # rebuilt from token_freq.pt (the training side's counts)
    assert torch.equal(r_d2t.long(), d2t) and torch.equal(r_t2d.bool(), t2d)

    sf = tmp_path / "specforge"
    rep = export_data(hidden_run, "r", "specforge", sf, str(tiny), progress=False, val_fraction=0.5,
                      draft_vocab_size=64)
    assert "data.eval_hidden_states_path=" in rep.reader_hint()
    by_dir = {}
    for sub in ("train", "eval"):
        refs = OfflineManifestReader(str(sf / sub), validate_files=True).read()
        by_dir[sub] = {tuple(load_feature_file(r.feature_store_uri.removeprefix("file://"))["input_ids"].tolist())
                       for r in refs}
    assert by_dir["eval"] == want_held and by_dir["train"] == set(tokens.values()) - want_held
    mapping = torch.load(sf / "vocab_mapping.pt", weights_only=True)
    assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)


def test_speculators_trainer_runs_on_our_export_and_eval_reads_its_draft(hidden_run, tmp_path, tiny):  # noqa: ANN001
    """speculators' own trainer (on the CPU, eagle3q.dev.speculators_cpu) trains on our export; `load_exported`, the
    loader of eval-draft and the learning-curve bench, reads its checkpoint and runs it as its Eagle3DraftModel does:
    the same logits over three TTT steps, its input norm before `fc` and its normed outputs fed on included."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3q.dev.speculators_cpu import train
    from eagle3q.draft.export import load_exported

    data = tmp_path / "export"
    export_data(hidden_run, "r", "speculators", data, str(tiny), progress=False, val_fraction=0.0,
                draft_vocab_size=512)
    ckpt = train(data, tiny, tmp_path / "ckpt", epochs=1, lr=5e-3, draft_vocab_size=512, log=tmp_path / "log")
    theirs = Eagle3DraftModel.from_pretrained(str(ckpt)).float().eval()
    ours, cfg, d2t, t2d = load_exported(ckpt, load_target_tensors(tiny)["embed"])
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert ours.c.norm_before_fc and ours.c.norm_output  # its defaults: the variants the loader must carry
    assert torch.equal(theirs.d2t.long(), d2t) and torch.equal(theirs.t2d.bool(), t2d)

    for k, (mine, its) in enumerate(_ttt_logits(theirs, ours, 1024, 64, seed=2)):
        assert (mine - its).abs().max().item() <= 1e-3 * its.abs().max().item(), k
