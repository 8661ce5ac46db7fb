"""`eagle3q export-data`: a run's samples with hidden states, in a peer trainer's own layout.

- speculators (0.9): `OUT/hidden_states/hs_{i}.safetensors` with `token_ids` [T] int64 and `hidden_states`
  [T, n_aux + 1, H] bf16 (the aux layers in layer order, then the final state before the target's norm: its trainer
  applies the verifier norm itself), and an Arrow data set in `OUT` (`save_to_disk`, torch format) with
  `input_ids`, `loss_mask` and `seq_len`, row i matching file i. Its `ArrowDataset(datapath=OUT)` reads it.
  A store kept in fp8 (EAGLE3Q_HS_DTYPE=fp8) exports in fp8, as hs_connectors' FP8 connector writes it:
  `hidden_states` e4m3 with `hidden_states_scales` float32 [T, n_aux + 1, 1] (one scale per token and layer, which
  its reader broadcasts like its own [T, 1, 1]); its trainer reads it with `--hidden-states-backend fp8`
  (`FP8Transfer`), and the plain file backend would hand it unscaled e4m3: the export says so.
- SpecForge (0.2): `OUT/train/data_{i}.ckpt` and `OUT/eval/data_{i}.ckpt` (`torch.save`) with `input_ids` [T],
  `loss_mask` [T] (int64), `hidden_state` [1, T, H] after the target's final norm (its target head applies none)
  and `aux_hidden_state` [1, T, 3H] bf16, as its `prepare_hidden_states.py` writes them;
  `process_offline_eagle3_sample` reads them.

The held-out split goes with it, in each peer's convention: speculators splits by row order (`--train-data-ratio`),
so the training samples come first and the export prints the ratio that puts the boundary at the first held-out
row; SpecForge reads separate directories, `OUT/train` and `OUT/eval`. The split is the trainer's frozen one where
the run was trained, else the same rule by prompt content (`eagle3q.draft.manifest`): no held-out prompt is in a
peer's training part. The vocabulary too, from the training side: speculators' `token_freq.pt`, `d2t-N.npy` and
`t2d-N.npy` in OUT (where its trainer looks for `--draft-vocab-size N`), SpecForge's `vocab_mapping.pt`.

`loss_mask` is 1 on the generated tokens in both, the array each peer's own preprocessing writes for the same
conversation (each trainer aligns it with its shifted inputs in its own way).

Streaming (one sample in memory), resumable: the sample order is frozen in `OUT/eagle3q-export.json` on the first
call (later calls append samples that arrived since), files are written atomically, and a file already there is
not written again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3q.store import Store, write_atomic
from eagle3q.store.fp8 import SCALES_SUFFIX
from eagle3q.store.hidden_format import stored_dtype
from eagle3q.target import final_norm, load_target_tensors, target_config

FORMATS = ("speculators", "specforge")
MANIFEST = "eagle3q-export.json"
PEER_SCALES = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY


class ExportError(Exception):
    pass


@dataclass
class ExportReport:
    out_dir: Path
    fmt: str
    total: int
    written: int
    skipped: int
    hs_dtype: str = "bf16"  # of the files written (speculators: the store's; SpecForge: always bf16)
    train_count: int | None = None  # the first block of the order (None: an export from before the split)
    val_count: int = 0
    vocab_size: int | None = None  # the draft vocabulary of the vocab files written (None: none written)

    @property
    def train_data_ratio(self) -> float | None:
        """speculators' `--train-data-ratio`: its `int(rows x ratio)` is the held-out boundary, so the ratio is
        taken half a row past it (exact whatever the float rounding)."""
        if self.train_count is None or not 0 < self.train_count < self.total:
            return None
        return round((self.train_count + 0.5) / self.total, 9)

    def reader_hint(self) -> str:
        hints = []
        if self.fmt == "speculators":
            if self.hs_dtype == "fp8":
                hints.append("fp8 hidden states: train with speculators' `--hidden-states-backend fp8` (its "
                             "FP8Transfer)")
            if self.train_data_ratio is not None:
                hints.append(f"held-out split: rows {self.train_count}.. of {self.total}; train with "
                             f"`--train-data-ratio {self.train_data_ratio}` (speculators splits by row order)")
            if self.vocab_size:
                hints.append(f"vocab: d2t-{self.vocab_size}.npy / t2d-{self.vocab_size}.npy and token_freq.pt, "
                             f"read with `--draft-vocab-size {self.vocab_size}`")
        elif self.train_count is not None:
            hints.append(f"SpecForge: data.hidden_states_path={self.out_dir / 'train'}"
                         + (f", data.eval_hidden_states_path={self.out_dir / 'eval'}" if self.val_count else "")
                         + (f", model.vocab_mapping_path={self.out_dir / 'vocab_mapping.pt'}" if self.vocab_size
                            else ""))
        return "\n".join(hints)


@dataclass
class _Order:
    ids: list[str]
    train_count: int | None  # None: an export written before the split (its files stay where they are)
    val: set[str]


def _held_out(store: Store, run: str, ids: list[str], val_fraction: float) -> set[str]:
    """The trainer's frozen split where the run was trained (its manifest), and the same rule, by prompt content
    (eagle3q.draft.manifest), for samples it did not see."""
    from eagle3q.draft.manifest import entries_for, is_validation, load

    frozen_val: set[str] = set()
    frozen: set[str] = set()
    try:
        m = load(store, run)
    except FileNotFoundError:
        pass
    else:
        val_fraction = m.val_fraction
        frozen_val = {e.sample_id for e in m.val}
        frozen = frozen_val | {e.sample_id for e in m.train}
    fresh = entries_for(store, run, [sid for sid in ids if sid not in frozen])
    return frozen_val | {e.sample_id for e in fresh if is_validation(e.split_key, val_fraction)}


def _manifest(out_dir: Path, run: str, fmt: str, ids: list[str], val: set[str]) -> _Order:
    """The frozen order: the first call's training samples, then its held-out ones; later calls append the samples
    that are new (either side: a training sample past the boundary is only evaluated on, never a held-out one
    trained on)."""
    path = out_dir / MANIFEST
    if path.is_file():
        m = json.loads(path.read_text())
        if m.get("run") != run or m.get("format") != fmt:
            raise ExportError(f"{out_dir} holds an export of run {m.get('run')!r} as {m.get('format')!r}: "
                              "choose another directory")
        order: list[str] = m["ids"]
        known = set(order)
        order += [i for i in ids if i not in known]
        train_count = m.get("train_count")
        val = set(m.get("val", [])) | {i for i in val if i not in known}
    else:
        if out_dir.exists() and any(out_dir.iterdir()):
            raise ExportError(f"{out_dir} is not empty and holds no eagle3q export")
        train = [i for i in ids if i not in val]
        order = train + [i for i in ids if i in val]
        train_count = len(train)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"run": run, "format": fmt, "ids": order, "train_count": train_count,
                                   "val": sorted(val & set(order))}).encode())
    return _Order(order, train_count, val)


class _Norm:
    """The target's final RMSNorm, for formats that want the state after it."""

    def __init__(self, target_dir: str):
        self.weight = load_target_tensors(target_dir).get("norm")
        self.eps = float(target_config(target_dir).get("rms_norm_eps", 1e-6))
        if self.weight is None:
            raise ExportError(f"no final norm weight in {target_dir}: cannot give post-norm states")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return final_norm(h.float(), self.weight, self.eps)


def _speculators_file(t: dict[str, torch.Tensor], final_state: str) -> bytes:
    """t as `read_hidden(restore=False)` gives it: an fp8 file's e4m3 states and their `*_scales`, kept as they are."""
    from safetensors.torch import save

    if final_state != "pre_norm":
        raise ExportError("speculators wants the final state before the target's norm; this run's files hold it "
                          "after the norm (extracted by an older eagle3q): extract its hidden states again")
    n, width = t["aux_hidden_states"].shape
    h = t["hidden_state"].shape[-1]
    layers = torch.cat([t["aux_hidden_states"].reshape(n, width // h, h), t["hidden_state"].reshape(n, 1, h)], 1)
    out = {"token_ids": t["input_ids"].long().contiguous()}
    if "hidden_state" + SCALES_SUFFIX in t:
        out["hidden_states"] = layers.contiguous()
        out[PEER_SCALES] = torch.cat([t["aux_hidden_states" + SCALES_SUFFIX],
                                      t["hidden_state" + SCALES_SUFFIX]], 1).float().contiguous()
    else:
        out["hidden_states"] = layers.to(torch.bfloat16).contiguous()
    return save(out)


def _specforge_file(t: dict[str, torch.Tensor], final_state: str, norm: _Norm | None) -> bytes:
    import io

    final = t["hidden_state"]
    if final_state == "pre_norm":
        assert norm is not None
        final = norm(final)
    buf = io.BytesIO()
    torch.save({"input_ids": t["input_ids"].long(), "loss_mask": t["loss_mask"].long(),
                "hidden_state": final.to(torch.bfloat16).unsqueeze(0).contiguous(),
                "aux_hidden_state": t["aux_hidden_states"].to(torch.bfloat16).unsqueeze(0).contiguous()}, buf)
    return buf.getvalue()


def _dest(out_dir: Path, fmt: str, i: int, held_out: bool | None) -> Path:
    """speculators: one directory, the split by position. SpecForge: `train/` and `eval/` (its
    data.hidden_states_path and data.eval_hidden_states_path); `held_out=None`: an export from before the split."""
    if fmt == "speculators":
        return out_dir / "hidden_states" / f"hs_{i}.safetensors"
    sub = out_dir if held_out is None else out_dir / ("eval" if held_out else "train")
    return sub / f"data_{i}.ckpt"


def _write_vocab(store: Store, run: str, out_dir: Path, fmt: str, train_ids: list[str], target_dir: str,
                 draft_vocab_size: int) -> int | None:
    """The draft vocabulary in the peer's own files: the trainer's (frozen with its manifest) where the run was
    trained, else counted from the training side now, with the same rule (ours equals both peers' bit for bit,
    tests/peers). speculators: `token_freq.pt` (id -> count where the loss applies) and `d2t-N.npy` / `t2d-N.npy`
    in the data directory, where its trainer looks first; SpecForge: `vocab_mapping.pt` ({"d2t", "t2d"}, its
    model.vocab_mapping_path). None where neither the trainer's vocab nor the target's vocab size is known."""
    from eagle3q.draft.vocab import build_mapping, count_tokens, load_vocab

    trained = load_vocab(store, run)
    if trained is not None:
        counts, d2t, t2d = trained["counts"], trained["d2t"], trained["t2d"].bool()
    elif target_dir:
        counts = count_tokens(store, run, train_ids, int(target_config(target_dir)["vocab_size"]))
        d2t, t2d = build_mapping(counts, draft_vocab_size)
    else:
        return None
    import io

    n = int(d2t.numel())
    if fmt == "speculators":
        import numpy as np

        buf = io.BytesIO()
        torch.save({int(i): int(counts[i]) for i in torch.nonzero(counts).flatten()}, buf)
        write_atomic(out_dir / "token_freq.pt", buf.getvalue())
        for name, arr in ((f"d2t-{n}.npy", d2t.long()), (f"t2d-{n}.npy", t2d.bool())):
            buf = io.BytesIO()
            np.save(buf, arr.numpy())
            write_atomic(out_dir / name, buf.getvalue())
    else:
        buf = io.BytesIO()
        torch.save({"d2t": d2t.long(), "t2d": t2d.bool()}, buf)
        write_atomic(out_dir / "vocab_mapping.pt", buf.getvalue())
    return n


def _write_arrow(out_dir: Path, store: Store, run: str, ids: list[str]) -> None:
    """speculators' data set: row i = file i. Written last (ids and masks only, ranged reads of the store) from a
    generator, so a long run does not hold its token lists in memory."""
    import datasets

    def rows() -> Iterator[dict]:
        for tok, mask in store.map_samples(lambda sid: store.hidden_tokens(run, sid), ids):
            yield {"input_ids": tok.astype("int64").tolist(), "loss_mask": mask.astype("int64").tolist(),
                   "seq_len": int(tok.shape[0])}

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    cache = out_dir / ".cache"
    ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(cache))
    ds.set_format(type="torch")  # as speculators' preprocessing saves it: its reader compares tensors
    staging = out_dir / ".arrow-staging"
    shutil.rmtree(staging, ignore_errors=True)
    ds.save_to_disk(str(staging))
    for p in staging.iterdir():  # next to hidden_states/, where speculators' ArrowDataset looks for both
        p.replace(out_dir / p.name)
    staging.rmdir()
    shutil.rmtree(cache, ignore_errors=True)


def export_data(store: Store, run: str, fmt: str, out_dir: Path, target_dir: str = "",
                progress: bool = True, val_fraction: float = 0.02, draft_vocab_size: int = 32000) -> ExportReport:
    """`val_fraction`: the held-out share for a run not trained yet (a trained run's split is its trainer's)."""
    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {FORMATS}, got {fmt!r}")
    by_id = set(store.hidden_ids(run))
    if not by_id:
        raise ExportError(f"run {run!r} has no hidden-state objects in the store {store.url}")
    frozen = _manifest(out_dir, run, fmt, sorted(by_id), _held_out(store, run, sorted(by_id), val_fraction))
    order = frozen.ids
    missing = [i for i in order if i not in by_id]
    if missing:
        raise ExportError(f"{len(missing)} samples of the earlier export are gone from the store (e.g. {missing[0]})")
    hs_dtype = stored_dtype(store.hidden_header(run, order[0])) if fmt == "speculators" else "bf16"
    norm = None
    if fmt == "specforge":
        first_state = store.read_hidden(run, order[0])[1]
        if first_state == "pre_norm":
            if not target_dir:
                raise ExportError("SpecForge wants post-norm final states: set EAGLE3Q_TARGET_MODEL (its norm)")
            norm = _Norm(target_dir)
    written = skipped = 0
    from tqdm import tqdm

    bar = tqdm(total=len(order), desc=f"export {run} as {fmt}", unit="sample", disable=not progress)
    for i, sid in enumerate(order):
        dest = _dest(out_dir, fmt, i, None if frozen.train_count is None else sid in frozen.val)
        if dest.is_file():  # written atomically: present means complete
            skipped += 1
        else:
            # speculators keeps fp8 as it is stored; SpecForge's reader knows bf16 only (restored, then rounded).
            t, final_state = store.read_hidden(run, sid, restore=fmt != "speculators")
            if fmt == "speculators" and ("fp8" if "hidden_state" + SCALES_SUFFIX in t else "bf16") != hs_dtype:
                # One reader backend reads the whole directory: it cannot mix bf16 and fp8 files.
                raise ExportError(f"run {run!r} holds both bf16 and fp8 files (EAGLE3Q_HS_DTYPE changed mid-run, "
                                  f"{sid} is not {hs_dtype}): speculators reads a directory with one backend; "
                                  "export to SpecForge (bf16) instead")
            data = _speculators_file(t, final_state) if fmt == "speculators" else _specforge_file(t, final_state, norm)
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(dest, data)
            written += 1
        bar.update(1)
    bar.close()
    if fmt == "speculators":
        _write_arrow(out_dir, store, run, order)
    train_ids = [i for i in order if i not in frozen.val]
    vocab = _write_vocab(store, run, out_dir, fmt, train_ids, target_dir, draft_vocab_size)
    return ExportReport(out_dir, fmt, len(order), written, skipped, hs_dtype, frozen.train_count,
                        len(frozen.val & set(order)), vocab)
