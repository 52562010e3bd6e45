"""Quality targets: when a run first reaches a declared validation loss or bits per byte, and at what cost.

Owns (SPEC "Quality targets"): the targets a config declares (`eval.targets`), the value a target is
judged on at each evaluation (a domain's loss or bits per byte, or their mean over domains weighted by
each domain's validation tokens), the bracket of each target (the first evaluation where it is met and
the one before it; the best evaluation when it is never met) with its step, exposure and useful tokens,
wall seconds since the first launch, device-hours and cost, the `targets` report table, its section of
report.md, its MLflow metrics and tags, and the audit's recount of it from the evaluations and run.json.
Never trains, evaluates, reads MLflow or writes files: callers hand it tables, rows and configs.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runner.config.load import experiment_from_dict
from runner.config.rules import check_targets
from runner.config.schema import MEAN_DOMAIN, TARGET_METRICS, ExperimentSchema
from runner.errors import Problems, RunnerError
from runner.fsio import read_yaml

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
REL_TOL = 1e-9


@dataclass(frozen=True)
class Target:
    name: str
    domain: str  # a mixture domain, or MEAN_DOMAIN
    metric: str  # loss_nats | bpb
    threshold: float

    def describe(self) -> str:
        return f"{self.domain} {self.metric} <= {self.threshold:g}"


def declared_targets(config) -> list[Target]:
    """The targets of a resolved config (typed or DictConfig: attribute access), sorted by name."""
    out = []
    for name, spec in config.eval.targets.items():
        metric = next(m for m in TARGET_METRICS if getattr(spec, m) is not None)
        out.append(Target(str(name), str(spec.domain), metric, float(getattr(spec, metric))))
    return sorted(out, key=lambda t: t.name)


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
            useful_by_step = _cumulative_useful(train_rows, file)
        step = int(r["step"])
        if step not in useful_by_step:
            raise RunnerError(
                f"the row at step {step} predates useful_tokens and train.jsonl lacks steps 1..{step}", file=file
            )
        out.append(
            {"useful_tokens": useful_by_step[step], "wall_seconds": math.nan, "device_wall_seconds": math.nan, **r}
        )
    return out


def _cumulative_useful(train_rows: list[dict], file: str) -> dict[int, int]:
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


def _progress(validation: pd.DataFrame) -> pd.DataFrame:
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
    if values.empty:
        return []
    progress = _progress(validation)
    met_steps = values.index[values.to_numpy() <= target.threshold]
    if len(met_steps):
        at = int(met_steps[0])
        earlier = values.index[values.index < at]
        points = ([("before", int(earlier[-1]))] if len(earlier) else []) + [("met", at)]
    else:
        points = [("best", int(values.idxmin()))]  # idxmin: the earliest of equal values
    rows = []
    for point, step in points:
        p = progress.loc[step]
        device_hours = float(p["device_wall_seconds"]) / SECONDS_PER_HOUR
        rows.append(
            {
                "target": target.name,
                "domain": target.domain,
                "metric": target.metric,
                "threshold": target.threshold,
                "met": bool(len(met_steps)),
                "point": point,
                "step": step,
                "exposure_tokens": int(p["exposure_tokens"]),
                "useful_tokens": int(p["useful_tokens"]),
                "value": float(values.loc[step]),
                "wall_seconds": float(p["wall_seconds"]),
                "device_hours": device_hours,
                "cost_usd": device_hours * float(price_per_device_hour),
            }
        )
    return rows


def targets_table(
    targets: list[Target], validation: pd.DataFrame, committed_steps: int, price_per_device_hour: float
) -> pd.DataFrame:
    """The `targets` report table (schemas/report_tables.py TARGETS) of a run's evaluations."""
    seen = lineage(validation, committed_steps)
    rows = [r for t in targets for r in bracket(t, seen, price_per_device_hour)]
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


# ---- report.md and MLflow -----------------------------------------------------------------------


def _money(x: float) -> str:
    return "-" if not np.isfinite(x) else (f"${x:,.2f}" if x >= 0.01 else f"${x:.2g}")


def _secs(x: float) -> str:
    return "not recorded" if not np.isfinite(x) else f"{x:,.1f} s"


def summary_line(target: Target, rows: dict[str, dict]) -> str:
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
    declared = declared_targets(typed_config(read_yaml(report_dir / "experiment.yaml")))
    if not declared:
        return []
    table = pd.read_parquet(report_dir / "targets.parquet")
    return [summary_line(t, outcome(table, t.name)) for t in declared]


def render_markdown(targets: list[Target], table: pd.DataFrame) -> list[str]:
    """The report.md section: one line per target, then the bracket rows."""
    lines = ["## Quality targets", ""]
    if not targets:
        return lines + ["No targets declared (eval recipe `targets:`).", ""]
    lines += [f"- {summary_line(t, outcome(table, t.name))}" for t in targets]
    lines += [
        "",
        "| target | point | step | exposure tokens | useful tokens | value | wall s | device-hours | cost USD |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples(index=False):
        lines.append(
            f"| {r.target} | {r.point} | {r.step:,} | {r.exposure_tokens:,} | {r.useful_tokens:,} | {r.value:.4g} "
            f"| {r.wall_seconds:.1f} | {r.device_hours:.4g} | {r.cost_usd:.4g} |"
        )
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


# ---- the audit's recount ------------------------------------------------------------------------


def _differences(report: pd.DataFrame, recount: pd.DataFrame) -> list[str]:
    problems = []
    key = ["target", "point"]
    a = report.set_index(key).sort_index()
    b = recount.set_index(key).sort_index()
    for k in sorted(set(a.index) ^ set(b.index)):
        problems.append(f"{k[0]} {k[1]}: {'only in the report' if k in a.index else 'missing from the report'}")
    for k in sorted(set(a.index) & set(b.index)):
        for col in (c for c in TARGET_COLUMNS if c not in key):
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


def _timeline_problems(validation: pd.DataFrame, run: dict, global_batch_tokens: int) -> list[str]:
    """The evaluations' progress against the run's own totals: exposure is whole steps, useful never
    exceeds it, time only grows with the step, and no evaluation ended after the run did."""
    problems = []
    p = _progress(validation)
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
        total = run.get(total_key)
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
            _timeline_problems(seen, run, batch_tokens),
            f"{seen['step'].nunique()} evaluations",
        ),
        (
            "quality targets recounted from the evaluations",
            _differences(tables["targets"], recount),
            f"{len(declared)} targets, {int(recount['met'].groupby(recount['target']).first().sum()) if len(recount) else 0} met",
        ),
    ]
