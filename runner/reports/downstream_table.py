"""The `downstream` report table of a run folder (schemas.report_tables.DOWNSTREAM).

Owns: reading a run's downstream figures, those scored in the loop (metrics/downstream.jsonl;
a resumed run's later row for a step wins, as for validation) and those `runner eval` added
(downstream/eval-step-NNNNNNN.json), into one validated frame, sorted by source, step, task and
metric, with where the run stood at each loop scoring (useful tokens, wall and device-wall seconds:
what a downstream target's time- and cost-to-target are counted from). Never scores anything.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pandas as pd

from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl
from runner.training.targets import cumulative_useful
from schemas.report_tables import DOWNSTREAM

COLUMNS = tuple(DOWNSTREAM.columns)


#: where the run stood at a scoring; rows recorded before these were stamped lack them
PROGRESS = ("useful_tokens", "wall_seconds", "device_wall_seconds")


def _row(r: dict, source: str, file: Path, useful_by_step) -> dict:
    try:
        row = {"source": source, **{c: r[c] for c in COLUMNS if c not in ("source", *PROGRESS)}}
    except KeyError as e:
        raise RunnerError(f"a downstream row lacks {e.args[0]}", file=str(file)) from None
    row["wall_seconds"] = float(r.get("wall_seconds", math.nan)) if source == "loop" else math.nan
    row["device_wall_seconds"] = float(r.get("device_wall_seconds", math.nan)) if source == "loop" else math.nan
    if "useful_tokens" in r and r["useful_tokens"] is not None:
        row["useful_tokens"] = int(r["useful_tokens"])
        return row
    useful = useful_by_step()  # a row written before scorings were stamped: train.jsonl's exact sum
    step = int(r["step"])
    if step not in useful:
        raise RunnerError(
            f"the row at step {step} predates useful_tokens and metrics/train.jsonl lacks steps 1..{step}",
            file=str(file),
        )
    row["useful_tokens"] = useful[step]
    return row


def downstream_table(run_dir: str | Path) -> pd.DataFrame:
    """Every downstream figure of the run, validated (pandera SchemaErrors on a bad one)."""
    run_dir = Path(run_dir)
    loop_file = run_dir / "metrics" / "downstream.jsonl"
    loop = read_jsonl(loop_file, skip_torn=True) if loop_file.exists() else []
    latest = {(int(r["step"]), r["task"], r["metric"]): r for r in loop}

    @functools.cache
    def useful_by_step() -> dict[int, int]:
        train_file = run_dir / "metrics" / "train.jsonl"
        train = read_jsonl(train_file, skip_torn=True) if train_file.exists() else []
        return cumulative_useful(list({int(r["step"]): r for r in train}.values()))

    rows = [_row(r, "loop", loop_file, useful_by_step) for r in latest.values()]
    for path in sorted((run_dir / "downstream").glob("eval-step-*.json")):
        rows += [_row(r, "runner eval", path, useful_by_step) for r in read_json(path).get("rows", [])]
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    df = df.astype({"step": "int64", "exposure_tokens": "int64", "documents": "int64", "useful_tokens": "int64"})
    df = df.astype({"value": "float64", "random_baseline": "float64", "t_eval_seconds": "float64"})
    df = df.astype({"wall_seconds": "float64", "device_wall_seconds": "float64"})
    df = df.astype(dict.fromkeys(("source", "task", "metric", "convention"), str))  # typed when empty too
    df = df.sort_values(["source", "step", "task", "metric"], kind="stable").reset_index(drop=True)
    return DOWNSTREAM.validate(df)
