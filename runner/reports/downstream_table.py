"""The `downstream` report table of a run folder (schemas.report_tables.DOWNSTREAM).

Owns: reading a run's downstream figures, those scored in the loop (metrics/downstream.jsonl;
a resumed run's later row for a step wins, as for validation) and those `runner eval` added
(downstream/eval-step-NNNNNNN.json), into one validated frame, sorted by source, step, task and
metric. Never scores anything.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl
from schemas.report_tables import DOWNSTREAM

COLUMNS = tuple(DOWNSTREAM.columns)


def _row(r: dict, source: str, file: Path) -> dict:
    try:
        return {"source": source, **{c: r[c] for c in COLUMNS if c != "source"}}
    except KeyError as e:
        raise RunnerError(f"a downstream row lacks {e.args[0]}", file=str(file)) from None


def downstream_table(run_dir: str | Path) -> pd.DataFrame:
    """Every downstream figure of the run, validated (pandera SchemaErrors on a bad one)."""
    run_dir = Path(run_dir)
    loop_file = run_dir / "metrics" / "downstream.jsonl"
    loop = read_jsonl(loop_file, skip_torn=True) if loop_file.exists() else []
    latest = {(int(r["step"]), r["task"], r["metric"]): r for r in loop}
    rows = [_row(r, "loop", loop_file) for r in latest.values()]
    for path in sorted((run_dir / "downstream").glob("eval-step-*.json")):
        rows += [_row(r, "runner eval", path) for r in read_json(path).get("rows", [])]
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    df = df.astype({"step": "int64", "exposure_tokens": "int64", "documents": "int64"})
    df = df.astype({"value": "float64", "random_baseline": "float64", "t_eval_seconds": "float64"})
    df = df.astype(dict.fromkeys(("source", "task", "metric", "convention"), str))  # typed when empty too
    df = df.sort_values(["source", "step", "task", "metric"], kind="stable").reset_index(drop=True)
    return DOWNSTREAM.validate(df)
