"""The audit's comparison of a report's downstream figures with what MLflow recorded at each scoring.

Owns: reading MLflow's downstream history (logged when the scoring happened, before any later
segment rebuilt the report from the run folder's files) against the report's `downstream` table:
the loop's `downstream/<task>/<metric>` and its stamps (`downstream/wall_seconds`,
`downstream/device_wall_seconds`, `downstream/useful_tokens`, `downstream/exposure_tokens`,
`downstream/t_eval_seconds`) against the loop rows of that step, and `runner eval`'s
`runner_eval/<task>/<metric>` against the runner eval rows of that step. A step scored twice (a
resume redid it, or two runner eval scorings) holds several values: the report's must be one of
them. A loop row at a step MLflow holds no scoring for, while it holds later ones, is a figure no
scoring logged. Runs that logged no stamps (before they were logged) are compared on their
figures only. Never: reads the run folder, or judges anything but equality with MLflow.
"""

from __future__ import annotations

import math

import pandas as pd

LOOP = "downstream/"
RUNNER_EVAL = "runner_eval/"
#: `downstream/<name>` -> the loop rows' column: the same value on every row of the scoring
STAMPS = {
    "wall_seconds": "wall_seconds",
    "device_wall_seconds": "device_wall_seconds",
    "useful_tokens": "useful_tokens",
    "exposure_tokens": "exposure_tokens",
    "t_eval_seconds": "t_eval_seconds",
}
REL_TOL = 1e-9  # MLflow stores float64: a logged figure reads back exactly


def handles(key: str) -> bool:
    """Keys this module compares (the rest of the audit leaves them alone)."""
    return key.startswith((LOOP, RUNNER_EVAL))


def _figure(key: str) -> tuple[str, str, str] | None:
    """(source, task, metric) of a figure's key; None for a stamp."""
    parts = key.split("/")
    if len(parts) != 3:
        return None
    source = {"downstream": "loop", "runner_eval": "runner eval"}.get(parts[0])
    return None if source is None else (source, parts[1], parts[2])


def _same(a: float, b: float) -> bool:
    x, y = float(a), float(b)
    return math.isclose(x, y, rel_tol=REL_TOL, abs_tol=1e-12) or (math.isnan(x) and math.isnan(y))


def compare(
    history: dict[str, list[tuple[int, float]]], table: pd.DataFrame | None, final: int
) -> tuple[list[str], int, int]:
    """(problems, points compared, points the report states nothing for) over every downstream key
    in `history` (MLflow's key -> [(step, value)]), up to the report's last step `final`."""
    problems: list[str] = []
    compared = uncompared = 0
    table = table if table is not None else pd.DataFrame(columns=["source", "step", "task", "metric", "value"])
    loop = table[table["source"] == "loop"]
    logged_loop_steps: set[int] = set()
    for key, points in sorted(history.items()):
        if not handles(key):
            continue
        by_step: dict[int, list[float]] = {}
        for step, value in points:
            if step <= final:
                by_step.setdefault(int(step), []).append(float(value))
        figure = _figure(key)
        stamp = STAMPS.get(key[len(LOOP) :]) if figure is None and key.startswith(LOOP) else None
        if figure is None and stamp is None:
            uncompared += len(by_step)
            continue
        if figure is not None and figure[0] == "loop":
            logged_loop_steps.update(by_step)
        for step, values in sorted(by_step.items()):
            if figure is not None:
                source, task, metric = figure
                rows = table[
                    (table["source"] == source)
                    & (table["step"] == step)
                    & (table["task"] == task)
                    & (table["metric"] == metric)
                ]
                column = "value"
            else:
                rows, column = loop[loop["step"] == step], str(stamp)
            if rows.empty or column not in rows:
                if figure is not None and figure[0] == "loop" and not loop.empty:
                    problems.append(f"{key} at step {step}: MLflow {values[-1]:.10g}, the report has no such figure")
                else:
                    uncompared += 1
                continue
            compared += 1
            wrong = [float(v) for v in rows[column] if not any(_same(v, m) for m in values)]
            if wrong:
                logged = ", ".join(f"{v:.10g}" for v in dict.fromkeys(values))
                problems.append(f"{key} at step {step}: MLflow {logged}, report {wrong[0]:.10g}")
    if logged_loop_steps:
        last = max(logged_loop_steps)
        for step in sorted(set(loop["step"].astype(int)) - logged_loop_steps):
            if step < last:  # MLflow logged later scorings, so this one's points are not still pending
                problems.append(
                    f"downstream: the report's loop scoring at step {step} was never logged to MLflow "
                    f"(it logged scorings at steps {', '.join(map(str, sorted(logged_loop_steps)))})"
                )
    return problems, compared, uncompared
