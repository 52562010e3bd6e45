"""The model card's downstream section: the exported checkpoint's own multiple-choice figures and the
downstream targets as they stood at its step (SPEC "Export", "Downstream evaluation").

Owns which downstream figures travel with an export: those of the audited report's `downstream`
table scored at the checkpoint's step (every source: the loop's scoring and any `runner eval` of
it; never another step's, so `--step N` shows step N's figures), each with its random baseline and,
for an accuracy, its centered form, and their convention records numbered once below the table
(runner.reports.downstream.report.numbered_records, as report.md numbers them); and the downstream
targets judged on the lineage's in-loop scorings up to that step (runner.training.task_targets),
rendered as report.md renders them. Never scores or judges anything itself and never reads the run
folder: the caller hands it the audited report's tables.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from runner.config.eval_recipe import DOWNSTREAM_ACCURACIES
from runner.config.schema import ExperimentSchema
from runner.export import export_scoring
from runner.reports.downstream.report import numbered_records
from runner.reports.downstream.targets import render_markdown
from runner.reports.targets import summary_line, typed_config
from runner.training.task_targets import TASK_TARGET_COLUMNS, declared_task_targets, task_targets_table

#: the card table's columns (accounting.json's figures carry the same keys, and the full record)
COLUMNS = ("source", "task", "metric", "value", "documents", "random_baseline", "centered", "record")


def _number(x: Any) -> Any:
    """A table cell as JSON holds it: numpy scalars as Python's, a missing (NaN) figure as null."""
    x = x.item() if hasattr(x, "item") else x
    return None if isinstance(x, float) and not math.isfinite(x) else x


def downstream_figures(config: ExperimentSchema, tables: dict[str, pd.DataFrame], step: int) -> dict | None:
    """accounting.json's `downstream`: {step, figures, targets}, or None when the run declares no
    task and the report holds no downstream figure (the card then has no such section)."""
    config = typed_config(config)
    table = tables.get("downstream", pd.DataFrame())
    declared = declared_task_targets(config)
    if not config.eval.tasks and table.empty and not declared:
        return None
    here = table[table["step"] == int(step)].reset_index(drop=True) if not table.empty else table
    numbers, _ = numbered_records(here["convention"]) if len(here) else ([], [])
    figures = []
    for r, n in zip(here.to_dict("records"), numbers):
        value, baseline = float(r["value"]), float(r["random_baseline"])
        # the baseline belongs to a task's accuracies (the aggregate's row carries none), and
        # centering (SPEC: (acc - b) / (1 - b)) to a raw accuracy: a centered_* figure already is
        of_task = r["task"] != "aggregate" and r["metric"] != "bpb"
        raw = of_task and r["metric"] in DOWNSTREAM_ACCURACIES
        figures.append(
            {
                "source": r["source"],
                "task": r["task"],
                "metric": r["metric"],
                "value": value,
                "documents": int(r["documents"]),
                "random_baseline": baseline if of_task else None,
                "centered": (value - baseline) / (1.0 - baseline) if raw else None,
                "record": n,
                "convention": json.loads(r["convention"]),
            }
        )
    price = float(config.hardware.price_per_device_hour_usd)
    judged = task_targets_table(declared, table, int(step), price) if declared and not table.empty else None
    targets = [] if judged is None else [{k: _number(v) for k, v in row.items()} for row in judged.to_dict("records")]
    return {
        "step": int(step),
        "scored_steps": sorted({int(s) for s in table["step"]}) if not table.empty else [],
        "figures": figures,
        "targets": targets,
    }


def _cell(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        # as report.md writes the downstream table; an accuracy's rounding noise (0.2 - 0.2000000000000001
        # over 0.8) is 0, never 6.93889e-17
        return f"{round(x, 12) + 0.0:.6g}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def markdown(config: ExperimentSchema, downstream: dict | None) -> list[str]:
    """The card's "Downstream tasks (step N)" section and, where the recipe declares any, its
    "Downstream targets"; [] when there is nothing downstream (never an empty table)."""
    if downstream is None:
        return []
    step, figures = downstream["step"], downstream["figures"]
    lines = [f"## Downstream tasks (step {step:,})", ""]
    if not figures:
        scored = ", ".join(f"{s:,}" for s in downstream["scored_steps"])
        lines += [
            f"No downstream scoring at step {step:,}"
            + (f" (the audited report has scorings at steps {scored})." if scored else "."),
            "",
        ]
    else:
        _, records = numbered_records(json.dumps(f["convention"], sort_keys=True) for f in figures)
        lines += [
            "Multiple-choice figures of this checkpoint's weights, as the audited report records them (source "
            "`loop`: scored in training; `runner eval`: scored afterwards). Centered = (accuracy - random "
            "baseline) / (1 - random baseline); bpb is bits per UTF-8 byte of the gold answer.",
            "",
            "| source | task | metric | value | documents | random baseline | centered | record |",
            "|---|---|---|---|---|---|---|---|",
            *["| " + " | ".join(_cell(f[c]) for c in COLUMNS) + " |" for f in figures],
            "",
            "Convention records (docs/SPEC.md 'Downstream evaluation'; each figure's record also names its "
            "metric): two figures compare only when their records are equal.",
            "",
            *[f"{i}. `{r}`" for i, r in enumerate(records, start=1)],
            "",
        ]
    lines += export_scoring.markdown(downstream)  # the folder's own figures, in its dtype, beside the run's
    declared = declared_task_targets(typed_config(config))
    if declared:
        judged = pd.DataFrame(downstream["targets"], columns=TASK_TARGET_COLUMNS)
        for c in ("at_least", "value", "wall_seconds", "device_hours", "cost_usd"):
            judged[c] = judged[c].astype(float)  # accounting.json's null: a figure not recorded
        if len(judged):
            targets = render_markdown(declared, judged)
        else:  # no in-loop scoring up to this step: the lines say so, with no empty table
            targets = ["## Downstream targets", "", *[f"- {summary_line(t, {})}" for t in declared], ""]
        lines += [
            *targets[:2],
            f"Judged on the run's in-loop scorings up to this checkpoint (step {step:,}).",
            "",
            *targets[2:],
        ]
    return lines
