"""Downstream quality targets judged on a run's in-loop scorings: when a run first reaches a declared
accuracy on a task (or the aggregate over tasks), and at what cost (SPEC "Downstream evaluation",
"Quality targets").

Owns: the downstream targets a config declares (`eval.targets.NAME: {task, metric, at_least}`), the
value judged at each loop scoring of the lineage (the `downstream` table's figure of that task and
metric), the bracket (the first scoring at or above `at_least` and the one before it; the best one
when never met) with its step, exposure and useful tokens, wall seconds since the first launch,
device-hours and cost, and the `downstream_targets` table. `runner eval` scorings are not judged:
they were scored after the fact, outside the run's wall clock. The validation targets, whose bracket
rows these share (targets.bracket_rows), are runner.training.targets'. Never scores, reads MLflow or
writes files: callers hand it the `downstream` table and the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from runner.training.targets import bracket_rows

TASK_TARGET_COLUMNS = [
    "target",
    "task",
    "metric",
    "at_least",
    "met",
    "point",
    "step",
    "exposure_tokens",
    "useful_tokens",
    "value",
    "wall_seconds",
    "device_hours",
    "cost_usd",
]
_KINDS = {
    "target": str,
    "task": str,
    "metric": str,
    "at_least": "float64",
    "met": bool,
    "point": str,
    "step": "int64",
    "exposure_tokens": "int64",
    "useful_tokens": "int64",
    "value": "float64",
    "wall_seconds": "float64",
    "device_hours": "float64",
    "cost_usd": "float64",
}


@dataclass(frozen=True)
class TaskTarget:
    name: str
    task: str  # a task of eval.tasks, or `aggregate`
    metric: str
    at_least: float

    def describe(self) -> str:
        return f"{self.task} {self.metric} >= {self.at_least:g}"


def declared_task_targets(config) -> list[TaskTarget]:
    """The downstream targets of a resolved config (typed or DictConfig), sorted by name."""
    out = [
        TaskTarget(str(name), str(spec.task), str(spec.metric), float(spec.at_least))
        for name, spec in config.eval.targets.items()
        if getattr(spec, "task", None) is not None
    ]
    return sorted(out, key=lambda t: t.name)


def loop_scorings(downstream: pd.DataFrame, committed_steps: int) -> pd.DataFrame:
    """The lineage's in-loop figures: source `loop`, steps up to the last committed one (a step
    scored again after a resume already holds its later figures: downstream_table keeps those)."""
    return downstream[(downstream["source"] == "loop") & (downstream["step"] <= int(committed_steps))]


def bracket(target: TaskTarget, scorings: pd.DataFrame, price_per_device_hour: float) -> list[dict]:
    """The target's rows: `before` (if any) and `met`, or `best` when never met; none when the loop
    never scored the task's metric. `scorings` holds the lineage's loop figures only."""
    rows = scorings[(scorings["task"] == target.task) & (scorings["metric"] == target.metric)]
    if rows.empty:
        return []
    by_step = rows.set_index("step").sort_index()
    values = by_step["value"].astype(float)
    progress = by_step[["exposure_tokens", "useful_tokens", "wall_seconds", "device_wall_seconds"]]
    met_steps = values.index[values.to_numpy() >= target.at_least]
    fields = {"target": target.name, "task": target.task, "metric": target.metric, "at_least": target.at_least}
    best = int(values.idxmax())  # idxmax: the earliest of equal values
    return bracket_rows(fields, values, met_steps, best, progress, price_per_device_hour)


def task_targets_table(
    targets: list[TaskTarget], downstream: pd.DataFrame, committed_steps: int, price_per_device_hour: float
) -> pd.DataFrame:
    """The `downstream_targets` report table (schemas/report_tables.py DOWNSTREAM_TARGETS)."""
    seen = loop_scorings(downstream, committed_steps)
    rows = [r for t in targets for r in bracket(t, seen, price_per_device_hour)]
    return pd.DataFrame(rows, columns=TASK_TARGET_COLUMNS).astype(_KINDS)
