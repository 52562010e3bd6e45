"""The report's downstream section: report.md's table of the latest figures with their convention
records, and downstream.png (each task's figures against exposure tokens) where the loop scored the
run more than once.

Owns: rendering the `downstream` report table (runner.reports.downstream.table builds it). Never
computes or judges a figure.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd

PLOT = "downstream.png"
#: The figures a plot shows per task: accuracies and their centered forms share one axis (bpb does not).
_PLOTTED = ("acc", "acc_norm", "acc_per_char", "acc_per_token", "mean_centered")


def plotted(table: pd.DataFrame | None) -> pd.DataFrame:
    """The loop's figures a plot shows (an empty frame: no plot): only where the loop scored at
    several steps, since one point is no curve."""
    if table is None or table.empty:
        return pd.DataFrame()
    loop = table[(table["source"] == "loop") & table["metric"].isin(_PLOTTED)]
    return loop if loop["step"].nunique() > 1 else pd.DataFrame()


def write_plot(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    """downstream.png: one line per task and metric against exposure tokens; [] without a curve."""
    points = plotted(tables.get("downstream"))
    if points.empty:
        return []
    import matplotlib  # noqa: PLC0415  (matplotlib: only when plots are written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for (task, metric), g in points.groupby(["task", "metric"]):
        g = g.sort_values("exposure_tokens")
        ax.plot(g["exposure_tokens"], g["value"], marker="o", label=f"{task} {metric}")
    for task, b in points.groupby("task")["random_baseline"].first().items():
        if task != "aggregate":
            ax.axhline(b, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="exposure tokens", ylabel="figure", title="Downstream tasks (dotted: random baseline)")
    ax.legend(fontsize=7)
    path = out / PLOT
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def latest(table: pd.DataFrame) -> pd.DataFrame:
    """The figures of each source's latest scored step (runner eval: every scoring of that step)."""
    last = table.groupby("source")["step"].transform("max")
    return table[table["step"] == last].reset_index(drop=True)


def _record_without_metric(convention: str) -> str:
    record = json.loads(convention)
    record.pop("metric", None)
    return json.dumps(record, sort_keys=True)


def numbered_records(conventions) -> tuple[list[int], list[str]]:
    """Each figure's record number (from 1) and the distinct records, each without its metric (the
    figure's row names it): report.md's and the model card's list under their tables."""
    records: list[str] = []
    numbers = []
    for convention in conventions:
        record = _record_without_metric(convention)
        if record not in records:
            records.append(record)
        numbers.append(records.index(record) + 1)
    return numbers, records


def markdown(tables: dict[str, pd.DataFrame], md_table: Callable[[pd.DataFrame], str]) -> list[str]:
    """report.md's "Downstream tasks" section; [] when the run scored no task."""
    table = tables.get("downstream")
    if table is None or table.empty:
        return []
    shown = latest(table)
    numbers, records = numbered_records(shown["convention"])
    baseline = [f"{b:.6g}" if b == b else "none" for b in shown["random_baseline"]]  # bpb has none
    shown = shown.assign(n=shown["documents"], record=numbers, random_baseline=baseline)
    cols = ["source", "step", "exposure_tokens", "task", "metric", "value", "n", "random_baseline", "record"]
    lines = [
        "## Downstream tasks",
        "",
        f"{len(table)} figures from {table.groupby(['source', 'step', 't_eval_seconds']).ngroups} scorings in the `downstream` table; "
        "those of each source's latest step (n: documents scored):",
        "",
        md_table(shown[cols]),
        "",
        "Convention records (SPEC 'Downstream evaluation'; each figure's record also names its metric): two "
        "figures compare only when their records are equal.",
        "",
        *[f"{i}. `{r}`" for i, r in enumerate(records, start=1)],
        "",
    ]
    if not plotted(table).empty:
        lines += [f"![downstream]({PLOT})", ""]
    t_eval = table.drop_duplicates(["source", "step", "t_eval_seconds"])["t_eval_seconds"].sum()
    lines += [f"Scoring wall time (`t_eval_seconds`, never step time): {t_eval:.3g} s over the scorings.", ""]
    return lines
