"""Pictures where people look rather than read: the training curves and the acceptance by draft position, as PNG.

matplotlib is optional (the `gpu` extra has it): without it nothing is drawn and the caller says so. The Agg backend
draws to files only, so this runs on a headless worker."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

log = logging.getLogger("eagle3q.evaluation.plots")


def _pyplot():  # noqa: ANN202 - matplotlib.pyplot, or None
    try:
        import matplotlib
    except ImportError:
        log.info("matplotlib is not installed: no plot drawn (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:  # noqa: ANN001 - a matplotlib Figure
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def training_curves(epochs: Sequence[Mapping], step_losses: Sequence[float], first_step: int = 1) -> bytes | None:
    """Loss per step (this trainer's steps) and, per epoch, the training and held-out loss and the top-1 accuracy
    of each TTT step (from the epoch records, which survive a resume), as PNG bytes. None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (ax_loss, ax_ep, ax_acc) = plt.subplots(1, 3, figsize=(15, 4))
    if step_losses:
        ax_loss.plot(range(first_step, first_step + len(step_losses)), step_losses, lw=0.8)
    ax_loss.set(title="training loss per step", xlabel="step", ylabel="loss")
    xs = [int(e["epoch"]) for e in epochs]
    for split, style in (("train", "-"), ("val", "--")):
        rows = [(x, e[split]) for x, e in zip(xs, epochs, strict=True) if e.get(split)]
        if not rows:
            continue
        ax_ep.plot([x for x, _ in rows], [r["loss"] for _, r in rows], style, marker="o", ms=3,
                   label="held out" if split == "val" else "train")
        for k in range(len(rows[0][1]["acc"])):
            ax_acc.plot([x for x, _ in rows], [r["acc"][k] for _, r in rows], style, marker="o", ms=3,
                        color=f"C{k}", label=None if split == "val" else f"step {k + 1}")
    ax_ep.set(title="loss per epoch", xlabel="epoch", ylabel="loss")
    ax_acc.set(title="top-1 accuracy per TTT step (dashed: held out)", xlabel="epoch", ylabel="accuracy",
               ylim=(0, 1))
    for ax in (ax_ep, ax_acc):
        if ax.lines:
            ax.legend(fontsize=7)
    png = _png(fig)
    plt.close(fig)
    return png


def acceptance_by_position(series: Mapping[str, Sequence[float]], title: str) -> bytes | None:
    """One line per series: the share of drafting rounds whose draft at position i (1-based) was accepted, i.e. the
    first i drafts all matched (vLLM's per-position counter over its drafts), as PNG bytes. None without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (name, rates) in enumerate(series.items()):
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=f"C{i}", label=name)
    ax.set(title=title, xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    png = _png(fig)
    plt.close(fig)
    return png
