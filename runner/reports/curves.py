"""The training curves a pretrainer looks at first: training loss and learning rate against step.

Owns `training.png` of a report folder, drawn from the run folder's metrics/train.jsonl (every logged
step of every attempt; a step logged twice after a resume is drawn at its last value), and the
report.md lines that show it. A report rebuilt from its tables alone (an MLflow run's artifacts) has
no train.jsonl and so no curve: it is optional, never one of the report's required files. The report
folder is logged to MLflow whole at the run's end, so the same PNG is an MLflow artifact.
Never changes a table.
"""

from __future__ import annotations

import sys
from pathlib import Path

PLOT = "training.png"


def _by_step(rows: list[dict]) -> list[dict]:
    last = {int(r["step"]): r for r in rows if "loss" in r and "lr" in r}
    return [last[s] for s in sorted(last)]


def write_training_curves(rows: list[dict], out: Path, warn: bool = False) -> Path | None:
    """training.png (loss above, learning rate below, sharing the step axis); None without rows, and
    None where matplotlib cannot draw them (a loss or rate of 1e308 overflows its axis: the report goes
    on without the curve, saying so on stderr where `warn`, as `runner report` does)."""
    rows = _by_step(rows)
    if not rows:
        return None
    import warnings  # noqa: PLC0415

    import matplotlib  # noqa: PLC0415  (heavy, and its backend must be chosen before pyplot loads)
    import numpy as np  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    steps = [int(r["step"]) for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True, height_ratios=(2, 1))
    path = Path(out) / PLOT
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # matplotlib's overflow warnings before its error
            top.plot(steps, [float(r["loss"]) for r in rows], color="tab:blue")
            top.set(ylabel="training loss (nats)", title="Training loss and learning rate")
            top.grid(alpha=0.3)
            bottom.plot(steps, [float(r["lr"]) for r in rows], color="tab:green")
            bottom.set(xlabel="step", ylabel="learning rate")
            bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
            bottom.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(path, dpi=80)
    except (OverflowError, ValueError) as e:
        path.unlink(missing_ok=True)
        if warn:
            print(
                f"warning: {PLOT} not drawn: matplotlib cannot draw metrics/train.jsonl's loss and learning rate "
                f"({type(e).__name__}: {e})",
                file=sys.stderr,
            )
        return None
    finally:
        plt.close(fig)
    return path


def markdown() -> list[str]:
    """report.md's section for the curve (only where training.png was written)."""
    return [
        "## Training loss and learning rate",
        "",
        "Mean training loss of each logged step (nats, over the step's useful targets) and the learning "
        "rate it used, from metrics/train.jsonl.",
        "",
        f"![training]({PLOT})",
        "",
    ]
