"""Quality targets judged on a run's evaluations: when a run first reaches a declared validation loss or
bits per byte, and at what cost (SPEC "Quality targets").

Owns: the targets a config declares (`eval.targets`), the value a target is judged on at each
evaluation (a domain's loss or bits per byte, or their mean over domains weighted by each domain's
validation tokens), the bracket of each target (the first evaluation where it is met and the one
before it; the best evaluation when it is never met) with its step, exposure and useful tokens, wall
seconds since the first launch, device-hours and cost, the `targets` table, and its MLflow metrics
and tags. The trainer's TargetsCallback judges with these as it evaluates; runner.reports.targets
(report.md, the audit's recount) uses the very same functions. Never trains, evaluates, reads MLflow
or writes files: callers hand it tables, rows and configs. pandas is imported by the two functions
that make a frame, not by this module: the trainer imports it before its first step, and a run
without targets never needs pandas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from runner.config.eval_recipe import MEAN_DOMAIN, TARGET_METRICS
from runner.errors import RunnerError

if TYPE_CHECKING:
    import pandas as pd

SECONDS_PER_HOUR = 3600.0
POINTS = ("before", "met", "best")
TARGET_COLUMNS = [
    "target",
    "domain",
    "metric",
    "threshold",
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
#: what each evaluation records besides its losses (loop: `_evaluate`); older eval.jsonl rows lack them
PROGRESS_FIELDS = ("useful_tokens", "wall_seconds", "device_wall_seconds")


@dataclass(frozen=True)
class Target:
    name: str
    domain: str  # a mixture domain, or MEAN_DOMAIN
    metric: str  # loss_nats | bpb
    threshold: float

    def describe(self) -> str:
        return f"{self.domain} {self.metric} <= {self.threshold:g}"


def declared_targets(config) -> list[Target]:
    """The validation targets of a resolved config (typed or DictConfig: attribute access), sorted by
    name; downstream targets (`task`) are runner.training.task_targets'."""
    out = []
    for name, spec in config.eval.targets.items():
        if getattr(spec, "task", None) is not None:
            continue  # a downstream target (runner.training.task_targets)
        metric = next(m for m in TARGET_METRICS if getattr(spec, m) is not None)
        out.append(Target(str(name), str(spec.domain), metric, float(getattr(spec, metric))))
    return sorted(out, key=lambda t: t.name)


# ---- evaluation records -------------------------------------------------------------------------


def complete_eval_rows(eval_rows: list[dict], train_rows: list[dict], file: str = "metrics/eval.jsonl") -> list[dict]:
    """eval.jsonl rows with every progress field: rows written before evaluations recorded them get
    `useful_tokens` from train.jsonl (each step's tokens_useful, summed up to the evaluation's step:
    exact) and no times (NaN: a time-to-target cannot be recounted for them)."""
    useful_by_step = None
    out = []
    for r in eval_rows:
        for key in ("samples", "tokens"):
            if key not in r:
                raise RunnerError(
                    f"the row at step {r.get('step')} has no '{key}' (validation {key} scored): written by an "
                    "older runner; its report cannot be rebuilt by this one",
                    file=file,
                )
        if all(k in r for k in PROGRESS_FIELDS):
            out.append(r)
            continue
        if useful_by_step is None:
            useful_by_step = cumulative_useful(train_rows)
        step = int(r["step"])
        if step not in useful_by_step:
            raise RunnerError(
                f"the row at step {step} predates useful_tokens and train.jsonl lacks steps 1..{step}", file=file
            )
        out.append(
            {"useful_tokens": useful_by_step[step], "wall_seconds": math.nan, "device_wall_seconds": math.nan, **r}
        )
    return out


def cumulative_useful(train_rows: list[dict]) -> dict[int, int]:
    """Useful tokens after each step, where train.jsonl holds every step from 1 up to it."""
    out, total = {}, 0
    for expected, r in enumerate(sorted(train_rows, key=lambda r: int(r["step"])), start=1):
        if int(r["step"]) != expected or "tokens_useful" not in r:
            break
        total += int(r["tokens_useful"])
        out[expected] = total
    return out


VALIDATION_COLUMNS = ["step", "exposure_tokens", "domain", "loss_nats", "bpb", "samples", "tokens", *PROGRESS_FIELDS]


def validation_frame(eval_rows: list[dict]) -> pd.DataFrame:
    """The report's validation table from completed eval.jsonl rows (one per step and domain)."""
    kinds = {"step": int, "exposure_tokens": int, "domain": str, "loss_nats": float, "bpb": float}
    kinds.update({"samples": int, "tokens": int})
    kinds.update({"useful_tokens": int, "wall_seconds": float, "device_wall_seconds": float})
    import pandas as pd  # noqa: PLC0415  (0.3 s and 300 modules: off `runner launch`'s start, first evaluation only)

    return pd.DataFrame(
        [{c: kinds[c](r[c]) for c in VALIDATION_COLUMNS} for r in eval_rows], columns=VALIDATION_COLUMNS
    )


def lineage(validation: pd.DataFrame, committed_steps: int) -> pd.DataFrame:
    """Evaluations of the model the run ended with: steps up to its last committed step. Rows of a
    step redone after a restart are already the later ones (the report keeps the last row per step)."""
    return validation[validation["step"] <= int(committed_steps)]


def metric_by_step(validation: pd.DataFrame, domain: str, metric: str) -> pd.Series:
    """The value a target is judged on at each evaluation, indexed by step: the domain's metric, or
    for MEAN_DOMAIN the mean over the evaluated domains weighted by their validation tokens."""
    if domain != MEAN_DOMAIN:
        rows = validation[validation["domain"] == domain]
        return rows.set_index("step")[metric].astype(float).sort_index()
    weighted = (validation[metric] * validation["tokens"]).groupby(validation["step"]).sum()
    weights = validation["tokens"].groupby(validation["step"]).sum()
    return (weighted / weights).astype(float).sort_index()


def progress_by_step(validation: pd.DataFrame) -> pd.DataFrame:
    """One row per evaluation step: exposure, useful tokens, wall and device-wall seconds."""
    cols = ["exposure_tokens", "useful_tokens", "wall_seconds", "device_wall_seconds"]
    return validation.groupby("step")[cols].first().sort_index()


# ---- brackets and the table ---------------------------------------------------------------------


def bracket(target: Target, validation: pd.DataFrame, price_per_device_hour: float) -> list[dict]:
    """The target's table rows: `before` (if any) and `met`, or `best` when it is never met; none
    when the run was never evaluated. `validation` holds the lineage's evaluations only."""
    if validation.empty:
        return []
    values = metric_by_step(validation, target.domain, target.metric)
    if values.isna().all():  # never evaluated, or never to a number (a diverged model's NaN): no best either
        return []
    met_steps = values.index[values.to_numpy() <= target.threshold]
    fields = {"target": target.name, "domain": target.domain, "metric": target.metric, "threshold": target.threshold}
    best = int(values.idxmin())  # idxmin: the earliest of equal values
    return bracket_rows(fields, values, met_steps, best, progress_by_step(validation), price_per_device_hour)


def bracket_rows(
    fields: dict, values: pd.Series, met_steps: pd.Index, best: int, progress: pd.DataFrame, price: float
) -> list[dict]:
    """A target's rows from the value judged at each evaluation (indexed by step) and the steps that
    meet it: `before` (the evaluation before the first met one, if any) and `met`, or `best` (the
    step `best`) when none does; each with the evaluation's progress and its device-hours and cost."""
    if len(met_steps):
        at = int(met_steps[0])
        earlier = values.index[values.index < at]
        points = ([("before", int(earlier[-1]))] if len(earlier) else []) + [("met", at)]
    else:
        points = [("best", best)]
    rows = []
    for point, step in points:
        p = progress.loc[step]
        device_hours = float(p["device_wall_seconds"]) / SECONDS_PER_HOUR
        rows.append(
            {
                **fields,
                "met": bool(len(met_steps)),
                "point": point,
                "step": step,
                "exposure_tokens": int(p["exposure_tokens"]),
                "useful_tokens": int(p["useful_tokens"]),
                "value": float(values.loc[step]),
                "wall_seconds": float(p["wall_seconds"]),
                "device_hours": device_hours,
                "cost_usd": device_hours * float(price),
            }
        )
    return rows


def targets_table(
    targets: list[Target], validation: pd.DataFrame, committed_steps: int, price_per_device_hour: float
) -> pd.DataFrame:
    """The `targets` report table (schemas/report_tables.py TARGETS) of a run's evaluations."""
    seen = lineage(validation, committed_steps)
    rows = [r for t in targets for r in bracket(t, seen, price_per_device_hour)]
    import pandas as pd  # noqa: PLC0415  (as in validation_frame)

    df = pd.DataFrame(rows, columns=TARGET_COLUMNS)
    return df.astype(
        {
            "target": str,
            "domain": str,
            "metric": str,
            "threshold": "float64",
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
    )


def outcome(table: pd.DataFrame, name: str) -> dict[str, dict]:
    """A target's rows keyed by point ({'before': row, 'met': row} or {'best': row}; {} if none)."""
    rows = table[table["target"] == name]
    return {str(r["point"]): r.to_dict() for _, r in rows.iterrows()}


def mlflow_record(target: Target, rows: dict[str, dict]) -> tuple[dict[str, float], dict[str, str], int]:
    """(metrics, tags, step) to log for a target's outcome: `target.<name>.*` at the met (or best)
    evaluation's step."""
    prefix = f"target.{target.name}"
    tags = {f"{prefix}.definition": target.describe(), f"{prefix}.met": str("met" in rows).lower()}
    if not rows:
        return {}, tags, 0
    metrics: dict[str, float] = {}
    if "met" in rows:
        m = rows["met"]
        metrics.update(
            {
                f"{prefix}.step": m["step"],
                f"{prefix}.exposure_tokens": m["exposure_tokens"],
                f"{prefix}.useful_tokens": m["useful_tokens"],
                f"{prefix}.value": m["value"],
                f"{prefix}.time_to_target_seconds": m["wall_seconds"],
                f"{prefix}.device_hours_to_target": m["device_hours"],
                f"{prefix}.cost_to_target_usd": m["cost_usd"],
            }
        )
        for k in ("step", "exposure_tokens", "useful_tokens", "value", "wall_seconds"):
            if "before" in rows:
                metrics[f"{prefix}.before.{k}"] = rows["before"][k]
        step = int(m["step"])
    else:
        b = rows["best"]
        metrics.update({f"{prefix}.best_value": b["value"], f"{prefix}.best_step": b["step"]})
        step = int(b["step"])
    return {k: float(v) for k, v in metrics.items() if np.isfinite(float(v))}, tags, step
