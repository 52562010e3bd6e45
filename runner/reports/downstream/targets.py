"""Downstream quality targets in reports: the report.md section and the audit's recount of the
`downstream_targets` table from the `downstream` table and run.json.

The judging (declared targets, the brackets, the table) is runner.training.task_targets'; the rows
and their checks are shaped as the validation targets' (runner.reports.targets), whose summary line,
table comparison and timeline checks are used here. Never scores, reads MLflow or writes files
(SPEC "Downstream evaluation").
"""

from __future__ import annotations

import pandas as pd

from runner.config.schema import ExperimentSchema
from runner.reports import targets
from runner.runs.runjson import as_record
from runner.training.task_targets import (
    TASK_TARGET_COLUMNS,
    TaskTarget,
    declared_task_targets,
    loop_scorings,
    task_targets_table,
)

NAME = "downstream targets recounted from the loop's scorings"
TIMELINE = "downstream scoring times and tokens within the run's"


def render_markdown(declared: list[TaskTarget], table: pd.DataFrame) -> list[str]:
    """The report.md section: one line per downstream target, then the bracket rows (nothing when
    the recipe declares none)."""
    if not declared:
        return []
    lines = ["## Downstream targets", ""]
    lines += [f"- {targets.summary_line(t, targets.outcome(table, t.name))}" for t in declared]
    lines += ["", *targets.bracket_rows(table)]
    lines += [
        "",
        "A downstream target is met at the first in-loop scoring whose figure is >= `at_least`; `before` is the",
        "scoring before it, `best` the highest figure of a target never met. Seconds, device-hours and cost run",
        "from the first launch to the end of that scoring, as for validation targets; `runner eval` scorings",
        "are not judged (scored after the fact, outside the run's clock).",
        "",
    ]
    return lines


def figure_progress_problems(downstream: pd.DataFrame, global_batch_tokens: int, run: dict) -> list[str]:
    """Where each figure says the run stood, figure by figure (the loop's timeline reads one row per
    step; a `runner eval` figure is stamped from the run's records at its checkpoint's step): its
    exposure is its step's whole batches, useful never exceeds it, no loop figure's scoring ended after
    the run did (run.json's wall and device-wall seconds) or took longer than the run had run when it
    ended (its own wall-seconds stamp)."""
    record = as_record(run)
    totals = {"wall_seconds": record.wall_seconds, "device_wall_seconds": record.device_wall_seconds}
    problems: dict[str, None] = {}  # one line per step, source and fault
    for r in downstream.itertuples(index=False):
        where = f"{r.source} step {r.step}"
        if int(r.exposure_tokens) != int(r.step) * global_batch_tokens:
            problems[f"{where}: exposure {int(r.exposure_tokens):,} != {r.step} x {global_batch_tokens:,}"] = None
        if int(r.useful_tokens) > int(r.exposure_tokens):
            problems[f"{where}: useful {int(r.useful_tokens):,} > exposure"] = None
        for col, total in totals.items():
            value = float(getattr(r, col))  # NaN: not stamped (runner eval, older rows)
            if total is not None and value > float(total) * (1 + 1e-6) + 1e-6:
                problems[f"{where}: a figure's {col} {value:.6g} is after the run's {float(total):.6g} (run.json)"] = (
                    None
                )
        if float(r.t_eval_seconds) > float(r.wall_seconds) * (1 + 1e-6) + 1e-6:  # NaN stamp: not compared
            problems[
                f"{where}: t_eval_seconds {float(r.t_eval_seconds):.6g} is longer than the run had run "
                f"when the scoring ended (wall_seconds {float(r.wall_seconds):.6g})"
            ] = None
    return list(problems)


def audit_checks(
    tables: dict[str, pd.DataFrame], cfg: ExperimentSchema | dict, run: dict
) -> list[tuple[str, list[str], str]]:
    """(check name, problems, detail when it passes): the loop scorings' progress against run.json
    and the `downstream_targets` table recounted from the `downstream` table; [] for a run that
    declares no downstream target and scored nothing in the loop."""
    config = targets.typed_config(cfg)
    declared = declared_task_targets(config)
    summary = tables["run_summary"].iloc[0]
    committed = int(summary["steps"])
    scorings = loop_scorings(tables["downstream"], committed)
    scored_later = tables["downstream"][tables["downstream"]["source"] == "runner eval"]
    out = []
    if len(scorings) or len(scored_later):
        batch_tokens = int(summary["global_batch_sequences"]) * int(summary["seq_len"])
        n = scored_later["step"].nunique()
        later = f", {n} runner eval step{'s' * (n != 1)}" if n else ""
        out.append(
            (
                TIMELINE,
                (targets.timeline_problems(scorings, run, batch_tokens) if len(scorings) else [])
                + figure_progress_problems(tables["downstream"], batch_tokens, run),
                f"{scorings['step'].nunique()} loop scorings{later}",
            )
        )
    if declared or len(tables["downstream_targets"]):
        price = float(config.hardware.price_per_device_hour_usd)
        recount = task_targets_table(declared, tables["downstream"], committed, price)
        met = int(recount["met"].groupby(recount["target"]).first().sum()) if len(recount) else 0
        out.append(
            (
                NAME,
                targets.differences(tables["downstream_targets"], recount, TASK_TARGET_COLUMNS),
                f"{len(declared)} targets, {met} met",
            )
        )
    return out
