"""The training stage: the run lock, idempotence and progress around `eagle3q.eagle3.training.train_draft`.

Exactly once: the task is sent only by the ledger's trigger (`SET fired NX`); a redelivered copy (worker lost
mid-training) resumes from the last checkpoint, and one arriving after the export finds `result.json` and does
nothing. A duplicate delivery while another trainer holds the run's lock raises `TrainingBusy`.
"""

from __future__ import annotations

import json

from eagle3q.config import Settings
from eagle3q.control.ledger import Ledger
from eagle3q.control.locks import RunLock, TrainingBusy
from eagle3q.eagle3.training import TrainResult, train_draft
from eagle3q.store import Store

__all__ = ["TrainingBusy", "train_run", "mark_failed"]


def train_run(run: str, s: Settings, store: Store, ledger: Ledger | None = None, target_dir: str | None = None,
              log_every: int = 10) -> TrainResult:
    """Train the run's draft, or return the finished result. Without a ledger (by hand, on files) no lock is held
    and no progress is reported."""
    out = store.train_dir(run)
    done_file = out / "result.json"
    with RunLock(ledger, run, ttl_s=s.train_lock_s):  # renewed in the background while training
        if done_file.is_file() and (out / "export" / "model.safetensors").is_file():
            r = TrainResult(**json.loads(done_file.read_text()))
            r.skipped = True
            return r

        def progress(**kw: object) -> None:
            if ledger is not None:
                ledger.set_train_progress(run, **{k: (json.dumps(v) if isinstance(v, list) else v)
                                                  for k, v in kw.items()})

        result = train_draft(store.hidden_files(run), s, out, target_dir or s.target_model, progress,
                             log_every, run=run)
        store.write_json(done_file, {k: v for k, v in result.__dict__.items() if k != "skipped"})
        progress(state="done", step=result.steps, total_steps=result.steps, loss=result.final_loss)
        return result


def mark_failed(ledger: Ledger, run: str, err: BaseException) -> None:
    """Shown in `eagle3q status`; the lost-message sweep leaves a failed run alone (`eagle3q train` reruns it)."""
    ledger.set_train_progress(run, state="failed", error=f"{type(err).__name__}: {err}"[:500])
