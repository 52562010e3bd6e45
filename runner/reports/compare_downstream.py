"""`runner compare`'s downstream figures: each run's latest figures per task and metric side by side,
refused when two runs recorded the same task and metric under differing convention records.

Owns: which of a run's downstream figures a comparison shows (those of its latest loop scoring, or
of its latest `runner eval` scoring when the loop scored none) and the refusal (SPEC "Downstream
evaluation": two figures compare only when their records are equal). Never recomputes a figure.
"""

from __future__ import annotations

import json

import pandas as pd

from runner.errors import RunnerError


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
    aggregates over differently pinned tasks are not the same number."""
    if row.task != "aggregate":
        return str(row.convention)
    record = json.loads(str(row.convention))
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
