"""`runner compare`'s downstream figures: each run's latest figures per task and metric side by side,
refused when two runs recorded the same task and metric under differing convention records.

Owns: which of a run's downstream figures a comparison shows (those of its latest loop scoring, or
of its latest `runner eval` scoring when the loop scored none) and the refusal (SPEC "Downstream
evaluation": two figures compare only when their records are equal), and every downstream target
judged on every run (runner.training.task_targets) with who got there first. Never recomputes a figure.
"""

from __future__ import annotations

import json

import pandas as pd

from runner.errors import RunnerError
from runner.training.targets import outcome
from runner.training.task_targets import TaskTarget, declared_task_targets, task_targets_table


def latest_figures(table: pd.DataFrame | None) -> pd.DataFrame:
    """The figures a comparison shows of one run: its latest loop scoring, else its latest
    `runner eval` scoring (the last one written of that step)."""
    if table is None or table.empty:
        return pd.DataFrame(columns=["task", "metric", "step", "value", "documents", "convention"])
    source = "loop" if (table["source"] == "loop").any() else "runner eval"
    rows = table[table["source"] == source]
    rows = rows[rows["step"] == rows["step"].max()]
    rows = rows.drop_duplicates(["task", "metric"], keep="last").reset_index(drop=True)
    return rows.assign(convention=[_with_parts(r, rows) for r in rows.itertuples(index=False)])


def _with_parts(row, rows: pd.DataFrame) -> str:
    """An aggregate's record with the records of the figures it averages (`task_records`): two
    aggregates over differently pinned tasks, or over different subsets, are not the same number.
    A record written since it names them itself (each task's record for the metric it averages,
    figure or not) is kept; an older one is given those of the figures beside it."""
    if row.task != "aggregate":
        return str(row.convention)
    record = json.loads(str(row.convention))
    if "task_records" in record:
        return str(row.convention)
    parts = {}
    for task, metric in (record.get("tasks") or {}).items():
        hit = rows[(rows["task"] == task) & (rows["metric"] == metric)]
        parts[task] = json.loads(str(hit["convention"].iloc[0])) if len(hit) else None
    return json.dumps({**record, "task_records": parts}, sort_keys=True)


def _differing_key(a: str, b: str) -> str:
    """The first convention key whose value differs between two records (canonical JSON)."""
    ra, rb = json.loads(a), json.loads(b)
    return next(k for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k))


def refuse_differing_conventions(labels: list[str], figures: list[pd.DataFrame]) -> None:
    """RunnerError (one line, exit 2) naming the first task, metric and convention key on which a
    run's record differs from the first run that has that figure."""
    first: dict[tuple[str, str], tuple[str, str]] = {}
    for label, df in zip(labels, figures):
        for r in df.itertuples(index=False):
            key = (str(r.task), str(r.metric))
            if key not in first:
                first[key] = (label, str(r.convention))
                continue
            base, record = first[key]
            if record != str(r.convention):
                k = _differing_key(record, str(r.convention))
                va, vb = json.loads(record).get(k), json.loads(str(r.convention)).get(k)
                raise RunnerError(
                    f"downstream {key[0]}.{key[1]}: convention key `{k}` differs ({base}: {va!r}, {label}: {vb!r}); "
                    "figures recorded under differing conventions are not compared (SPEC 'Downstream evaluation')"
                )


def side_by_side(labels: list[str], tables: list[pd.DataFrame | None]) -> pd.DataFrame:
    """task, metric, then each run's figure (NaN where it has none) and its step and documents;
    refused (RunnerError) where the conventions differ. Empty when no run scored a task."""
    figures = [latest_figures(t) for t in tables]
    refuse_differing_conventions(labels, figures)
    keys = sorted({(str(r.task), str(r.metric)) for df in figures for r in df.itertuples(index=False)})
    rows = []
    for task, metric in keys:
        row: dict[str, object] = {"task": task, "metric": metric}
        for label, df in zip(labels, figures):
            hit = df[(df["task"] == task) & (df["metric"] == metric)]
            row[label] = float(hit["value"].iloc[0]) if len(hit) else float("nan")
            row[f"{label} step"] = int(hit["step"].iloc[0]) if len(hit) else None
            row[f"{label} documents"] = int(hit["documents"].iloc[0]) if len(hit) else None
        rows.append(row)
    cols = ["task", "metric", *[f"{x}{s}" for x in labels for s in ("", " step", " documents")]]
    return pd.DataFrame(rows, columns=cols)


# ---- downstream targets: who gets there first --------------------------------------------------------


def union_task_targets(labels: list[str], configs: list) -> list[TaskTarget]:
    """Every downstream target any run declares; one name must mean one target in every run (a
    validation target of another run under the same name is refused too)."""
    found: dict[str, tuple[TaskTarget, str]] = {}
    for label, config in zip(labels, configs):
        for t in declared_task_targets(config):
            if t.name in found and found[t.name][0] != t:
                other, where = found[t.name]
                raise RunnerError(
                    f"target '{t.name}' is {other.describe()} in {where} but {t.describe()} in {label}: "
                    "rename one so a comparison judges every run by the same target"
                )
            found.setdefault(t.name, (t, label))
    for label, config in zip(labels, configs):
        for name, spec in config.eval.targets.items():
            if spec.task is None and name in found:
                raise RunnerError(
                    f"target '{name}' is a validation target in {label} but {found[name][0].describe()} in "
                    f"{found[name][1]}: rename one so a comparison judges every run by the same target"
                )
    return [found[name][0] for name in sorted(found)]


def task_target_results(runs: list[tuple[str, pd.DataFrame | None, int, float]], declared: list[TaskTarget]):
    """Every downstream target judged on every run's loop scorings ((label, downstream table,
    committed steps, price) per run): where it was met (or the best figure), at what tokens, seconds
    and dollars, and the run(s) first by each measure."""
    rows = []
    for t in declared:
        for label, table, committed, price in runs:
            empty = table is None or table.empty
            out = {} if empty else outcome(task_targets_table([t], table, committed, price), t.name)
            r = out.get("met") or out.get("best") or {}
            rows.append(
                {
                    "target": t.name,
                    "definition": t.describe(),
                    "run": label,
                    "met": "met" in out,
                    "step": r.get("step"),
                    "value": r.get("value"),
                    "before_step": out.get("before", {}).get("step"),
                    **{k: r.get(k) for k in ("exposure_tokens", "useful_tokens", "wall_seconds", "device_hours")},
                    "cost_usd": r.get("cost_usd"),
                }
            )
    columns = ["target", "definition", "run", "met", "step", "value", "before_step", "exposure_tokens"]
    df = pd.DataFrame(rows, columns=[*columns, "useful_tokens", "wall_seconds", "device_hours", "cost_usd"])
    return mark_firsts(df)


def mark_firsts(df: pd.DataFrame) -> pd.DataFrame:
    """`first_in_<measure>`: the run(s) of each target that met it with the least exposure tokens,
    wall seconds and dollars (one row per target and run)."""
    for measure in ("exposure_tokens", "wall_seconds", "cost_usd"):
        first = pd.Series(False, index=df.index)
        for _, g in df.groupby("target"):
            met = g[g["met"] & g[measure].notna()]
            if len(met):
                values = met[measure].astype(float)
                first[met.index[values <= values.min() * (1 + 1e-12)]] = True
        df[f"first_in_{measure}"] = first
    return df
