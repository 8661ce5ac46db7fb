"""The training stage: the run lock, idempotence and progress around `eagle3q.draft.training.train_draft`.

Exactly once: the task is sent only by the ledger's trigger (`SET fired NX`); a redelivered copy (worker lost
mid-training) resumes from the store's last checkpoint, on whichever machine it lands, and one arriving after the
export finds `train/result.json` and does nothing. A duplicate delivery while another trainer holds the run's lock
raises `TrainingBusy`.
"""

from __future__ import annotations

import json
from dataclasses import fields

from eagle3q.config import Settings
from eagle3q.control.ledger import Ledger
from eagle3q.control.locks import RunLock, TrainingBusy
from eagle3q.draft.manifest import load_or_create, split_report
from eagle3q.draft.training import TrainResult, train_draft
from eagle3q.store import Store
from eagle3q.store.run_store import EXPORT, RESULT

__all__ = ["TrainingBusy", "train_run", "mark_failed"]


def train_run(run: str, s: Settings, store: Store, ledger: Ledger | None = None, target_dir: str | None = None,
              log_every: int = 10) -> TrainResult:
    """Train the run's draft, or return the finished result. Without a ledger (by hand, on files) no lock is held
    and no progress is reported."""
    with RunLock(ledger, run, ttl_s=s.train_lock_s):  # renewed in the background while training
        if store.has_artifact(run, RESULT) and store.has_artifact(run, f"{EXPORT}/model.safetensors"):
            known = {f.name for f in fields(TrainResult)}
            r = TrainResult(**{k: v for k, v in store.get_json(run, RESULT).items() if k in known})
            r.skipped = True
            return r

        def progress(**kw: object) -> None:
            if ledger is not None:
                ledger.set_train_progress(run, **{k: (json.dumps(v) if isinstance(v, list) else v)
                                                  for k, v in kw.items()})

        # Frozen by the first trainer: a resumed one continues the same files, split, order and vocab.
        manifest = load_or_create(store, run, s.val_fraction)
        if s.train_processes > 1:  # torchrun ranks; this process keeps the lock renewed meanwhile
            from eagle3q.draft.distributed import launch, settings_env

            env = {**settings_env(s), "EAGLE3Q_STORE_URL": store.url,
                   "EAGLE3Q_TARGET_MODEL": target_dir or s.target_model, "EAGLE3Q_TRAIN_PROCESSES": "1",
                   "EAGLE3Q_DDP_REPORT": "1" if ledger is not None else "0"}
            result = TrainResult(**launch(store, run, s.train_processes, env))
        else:
            result = train_draft(manifest, store, s, target_dir or s.target_model, progress, log_every)
        result.split = split_report(manifest)
        store.put_json(run, RESULT, {k: v for k, v in result.__dict__.items() if k != "skipped"})
        progress(state="done", step=result.steps, total_steps=result.steps, loss=result.final_loss)
        return result


def mark_failed(ledger: Ledger, run: str, err: BaseException) -> None:
    """Shown in `eagle3q status`; the lost-message sweep leaves a failed run alone (`eagle3q train` reruns it)."""
    ledger.set_train_progress(run, state="failed", error=f"{type(err).__name__}: {err}"[:500])
