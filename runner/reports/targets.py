"""Quality targets in reports: a saved config's targets read back, the `targets` section of report.md,
the summary lines, and the audit's recount of the table from the evaluations and run.json.

The judging (declared targets, the value judged at each evaluation, brackets, the `targets` table, its
MLflow record) is runner.training.targets', which the trainer's callback uses too; its names are
re-exported here (`__all__`) so a report reads `targets.targets_table` from one place. Never trains,
evaluates, reads MLflow or writes files (SPEC "Quality targets").
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runner.config.eval_recipe import MEAN_DOMAIN
from runner.config.load import experiment_from_dict
from runner.config.rules import check_targets
from runner.config.schema import ExperimentSchema
from runner.errors import Problems
from runner.fsio import read_yaml
from runner.runs.runjson import as_record
from runner.training.targets import (
    POINTS,
    PROGRESS_FIELDS,
    SECONDS_PER_HOUR,
    TARGET_COLUMNS,
    VALIDATION_COLUMNS,
    Target,
    bracket,
    complete_eval_rows,
    declared_targets,
    lineage,
    metric_by_step,
    mlflow_record,
    outcome,
    progress_by_step,
    targets_table,
    validation_frame,
)
from runner.training.task_targets import TaskTarget, declared_task_targets

REL_TOL = 1e-9

__all__ = [
    "MEAN_DOMAIN",
    "POINTS",
    "PROGRESS_FIELDS",
    "REL_TOL",
    "SECONDS_PER_HOUR",
    "TARGET_COLUMNS",
    "Target",
    "VALIDATION_COLUMNS",
    "audit_checks",
    "bracket",
    "bracket_rows",
    "complete_eval_rows",
    "differences",
    "declared_targets",
    "lineage",
    "metric_by_step",
    "mlflow_record",
    "outcome",
    "progress_by_step",
    "render_markdown",
    "summary_line",
    "summary_lines",
    "targets_table",
    "timeline_problems",
    "typed_config",
    "validation_frame",
]


def typed_config(cfg: ExperimentSchema | dict, file: str | Path = "experiment.yaml") -> ExperimentSchema:
    """A saved resolved config (a run's or a report's experiment.yaml, typed or as plain data) with
    the schema's defaults filled in, its targets checked against its mixture (a saved file may have
    been edited since it was checked): a config written before targets existed declares none."""
    if isinstance(cfg, ExperimentSchema):
        _check_saved_targets(cfg, str(file))
        return cfg
    return _typed_config(json.dumps(cfg, sort_keys=True), str(file))


@functools.lru_cache(maxsize=16)
def _typed_config(cfg_json: str, file: str) -> ExperimentSchema:
    # Cached: a report, an audit and a comparison read the same config several times, and composing
    # it through the schema takes a while; the result is read-only.
    config = experiment_from_dict(json.loads(cfg_json), path=Path(file)).config
    _check_saved_targets(config, file)
    return config


def _check_saved_targets(config: ExperimentSchema, file: str) -> None:
    problems = Problems()
    check_targets(config, Path(file), problems)
    problems.raise_if_any()


# ---- report.md and MLflow -----------------------------------------------------------------------


def _money(x: float) -> str:
    return "-" if not np.isfinite(x) else (f"${x:,.2f}" if x >= 0.01 else f"${x:.2g}")


def _secs(x: float) -> str:
    return "not recorded" if not np.isfinite(x) else f"{x:,.1f} s"


def summary_line(target: Target | TaskTarget, rows: dict[str, dict]) -> str:
    """One line: where a target was met (or the best value), for report.md and the terminal."""
    if not rows:
        return f"`{target.name}` ({target.describe()}): no evaluation recorded"
    if "met" in rows:
        m = rows["met"]
        before = rows.get("before")
        where = (
            f"between step {before['step']:,} ({before['value']:.4g}) and step {m['step']:,} ({m['value']:.4g})"
            if before
            else f"at the first evaluation, step {m['step']:,} ({m['value']:.4g})"
        )
        return (
            f"`{target.name}` ({target.describe()}): met {where}; {m['exposure_tokens']:,} exposure tokens, "
            f"{m['useful_tokens']:,} useful, {_secs(m['wall_seconds'])}, {m['device_hours']:.4g} device-hours, "
            f"{_money(m['cost_usd'])}"
        )
    b = rows["best"]
    return f"`{target.name}` ({target.describe()}): NOT met; best {b['value']:.4g} at step {b['step']:,}"


def summary_lines(report_dir) -> list[str]:
    """One line per declared target of a written report folder (the terminal summary after a run)."""
    report_dir = Path(report_dir)
    config = typed_config(read_yaml(report_dir / "experiment.yaml"))
    declared, on_tasks = declared_targets(config), declared_task_targets(config)
    lines = []
    if declared:
        table = pd.read_parquet(report_dir / "targets.parquet")
        lines += [summary_line(t, outcome(table, t.name)) for t in declared]
    if on_tasks and (report_dir / "downstream_targets.parquet").exists():  # a report written before it has none
        table = pd.read_parquet(report_dir / "downstream_targets.parquet")
        lines += [summary_line(t, outcome(table, t.name)) for t in on_tasks]
    return lines


def bracket_rows(table: pd.DataFrame) -> list[str]:
    """The markdown table of a targets table's bracket rows (validation and downstream targets alike)."""
    lines = [
        "| target | point | step | exposure tokens | useful tokens | value | wall s | device-hours | cost USD |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples(index=False):
        lines.append(
            f"| {r.target} | {r.point} | {r.step:,} | {r.exposure_tokens:,} | {r.useful_tokens:,} | {r.value:.4g} "
            f"| {r.wall_seconds:.1f} | {r.device_hours:.4g} | {r.cost_usd:.4g} |"
        )
    return lines


def render_markdown(targets: list[Target], table: pd.DataFrame) -> list[str]:
    """The report.md section: one line per target, then the bracket rows."""
    if not targets:  # an empty section says nothing a reader needs (issue 38: report.md drops them)
        return []
    lines = ["## Quality targets", ""]
    lines += [f"- {summary_line(t, outcome(table, t.name))}" for t in targets]
    lines += ["", *bracket_rows(table)]
    lines += [
        "",
        "A target is met at the first evaluation whose value is <= the target; `before` is the evaluation before",
        "it (the bracket), `best` the closest a target never met came. Wall seconds run from the first launch to",
        "the end of that evaluation over every attempt (lost work and restarts included); device-hours are the",
        "device-seconds over the same span / 3600; cost = device-hours x price per device-hour. `mean` is the mean",
        "over domains weighted by each domain's validation tokens. Targets are not part of the fingerprint.",
        "",
    ]
    return lines


# ---- the audit's recount ------------------------------------------------------------------------


def differences(report: pd.DataFrame, recount: pd.DataFrame, columns: list[str] = TARGET_COLUMNS) -> list[str]:
    """Where a targets table differs from its recount, row by (target, point), column by column."""
    problems = []
    key = ["target", "point"]
    a = report.set_index(key).sort_index()
    b = recount.set_index(key).sort_index()
    for k in sorted(set(a.index) ^ set(b.index)):
        problems.append(f"{k[0]} {k[1]}: {'only in the report' if k in a.index else 'missing from the report'}")
    for k in sorted(set(a.index) & set(b.index)):
        for col in (c for c in columns if c not in key):
            x, y = a.loc[k, col], b.loc[k, col]
            if not _same(x, y):
                problems.append(f"{k[0]} {k[1]}.{col}: report {_plain(x)!r}, recount {_plain(y)!r}")
    return problems


def _plain(x: Any) -> Any:
    return x.item() if isinstance(x, np.generic) else x


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, (float, np.floating)) or isinstance(y, (float, np.floating)):
        x, y = float(x), float(y)
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        return math.isclose(x, y, rel_tol=REL_TOL, abs_tol=1e-12)
    return bool(x == y) if not isinstance(x, (bool, np.bool_)) else bool(x) == bool(y)


def timeline_problems(validation: pd.DataFrame, run: dict, global_batch_tokens: int) -> list[str]:
    """The evaluations' progress against the run's own totals: exposure is whole steps, useful never
    exceeds it, time only grows with the step, and no evaluation ended after the run did."""
    problems = []
    p = progress_by_step(validation)
    for step, r in p.iterrows():
        if int(r["exposure_tokens"]) != int(step) * global_batch_tokens:
            problems.append(f"step {step}: exposure {int(r['exposure_tokens']):,} != {step} x {global_batch_tokens:,}")
        if int(r["useful_tokens"]) > int(r["exposure_tokens"]):
            problems.append(f"step {step}: useful {int(r['useful_tokens']):,} > exposure")
    timed = p.dropna(subset=["wall_seconds", "device_wall_seconds"])
    for col, total_key in (("wall_seconds", "wall_seconds"), ("device_wall_seconds", "device_wall_seconds")):
        values = timed[col].to_numpy(dtype=float)
        drops = np.nonzero(np.diff(values) < 0)[0]
        if len(drops):
            i = drops[0]
            problems.append(
                f"{col} falls from {values[i]:.6g} at step {timed.index[i]} to {values[i + 1]:.6g} at step {timed.index[i + 1]}"
            )
        total = getattr(as_record(run), total_key)  # None: not recorded
        if total is not None and len(values) and values.max() > float(total) * (1 + 1e-6) + 1e-6:
            problems.append(
                f"an evaluation ends at {col} {values.max():.6g}, after the run's {float(total):.6g} (run.json)"
            )
    short = timed[timed["device_wall_seconds"] < timed["wall_seconds"] * (1 - 1e-9)]
    problems += [f"step {s}: device_wall_seconds < wall_seconds (no device held)" for s in short.index]
    return problems


def audit_checks(
    tables: dict[str, pd.DataFrame], cfg: ExperimentSchema | dict, run: dict
) -> list[tuple[str, list[str], str]]:
    """(check name, problems, detail when it passes) for the audit: the targets table recounted from
    the evaluations (validation table, which a run folder's audit also rebuilds from eval.jsonl), the
    declared targets and the price; and the evaluations' times against run.json."""
    summary = tables["run_summary"].iloc[0]
    committed = int(summary["steps"])
    seen = lineage(tables["validation"], committed)
    batch_tokens = int(summary["global_batch_sequences"]) * int(summary["seq_len"])
    config = typed_config(cfg)
    declared = declared_targets(config)
    price = float(config.hardware.price_per_device_hour_usd)
    recount = targets_table(declared, tables["validation"], committed, price)
    return [
        (
            "evaluation times and tokens within the run's",
            timeline_problems(seen, run, batch_tokens),
            f"{seen['step'].nunique()} evaluations",
        ),
        (
            "quality targets recounted from the evaluations",
            differences(tables["targets"], recount),
            f"{len(declared)} targets, {int(recount['met'].groupby(recount['target']).first().sum()) if len(recount) else 0} met",
        ),
    ]
