"""The `downstream` report table of a run folder (schemas.report_tables.DOWNSTREAM).

Owns: reading a run's downstream figures, those scored in the loop (metrics/downstream.jsonl;
a resumed run's later row for a step wins, as for validation) and those `runner eval` added
(downstream/eval-step-NNNNNNN.json), into one validated frame, sorted by source, step, task and
metric, with where the run stood at each loop scoring (useful tokens, wall and device-wall seconds:
what a downstream target's time- and cost-to-target are counted from). A malformed row or record is
one RunnerError naming its file and column (or key), never a pandas or pandera traceback. Never
scores anything.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, TypeGuard

import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaError

from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl
from runner.runs.recorded import number
from runner.training.targets import cumulative_useful
from schemas.report_tables import DOWNSTREAM

COLUMNS = tuple(DOWNSTREAM.columns)


#: where the run stood at a scoring; rows recorded before these were stamped lack them
PROGRESS = ("useful_tokens", "wall_seconds", "device_wall_seconds")
_DTYPES = {c: str(spec.dtype) for c, spec in DOWNSTREAM.columns.items()}
#: the column a frame-wide check of the schema judges (named in the error line)
_CHECKED = {
    "downstream_metric_in_range": "value",
    "downstream_convention_names_its_metric": "convention",
    "downstream_baseline_unless_bpb": "random_baseline",
}
#: a `runner eval` record's per-request file: a name beside it, never a path elsewhere
_REQUESTS_NAME = re.compile(r"^requests-eval-step-\d{7}(-\d+)?\.jsonl\.gz$")


def read_eval_record(path: Path) -> dict[str, Any]:
    """A `runner eval` record (downstream/eval-step-NNNNNNN.json), checked for what its readers
    use: RunnerError naming the file and key otherwise."""
    record = read_json(path)
    if not isinstance(record, dict):
        raise RunnerError("a runner eval record must be a JSON object", file=str(path))
    rows = record.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise RunnerError("must be a list of JSON objects (one per figure)", file=str(path), key="rows")
    name = record.get("requests_file")
    if not isinstance(name, str) or not _REQUESTS_NAME.match(name):
        raise RunnerError(
            f"must name the per-request file beside it (requests-eval-step-NNNNNNN.jsonl.gz), got {name!r}",
            file=str(path),
            key="requests_file",
        )
    step = record.get("step")
    if not _integer(step) or step < 0:
        raise RunnerError(f"must be a step (an integer >= 0), got {step!r}", file=str(path), key="step")
    for n, r in enumerate(rows, 1):  # one checkpoint's scoring: every figure at the record's step
        if problem := _keys_problem(r):
            raise RunnerError(f"figure {n}: {problem}", file=str(path), key="rows")
        if r["step"] != step:
            raise RunnerError(
                f"figure {n} is at step {r['step']}, the record at step {step}", file=str(path), key="rows"
            )
    checkpoint = record.get("checkpoint")
    if not isinstance(checkpoint, str) or not re.fullmatch(r"step-\d{7}", checkpoint):
        raise RunnerError(
            f"must name a checkpoint (step-NNNNNNN), got {checkpoint!r}", file=str(path), key="checkpoint"
        )
    return record


def loop_rows(file: Path) -> list[dict[str, Any]]:
    """metrics/downstream.jsonl's rows (a torn last line dropped), each a JSON object with an
    integer step and a task and metric named; RunnerError naming the file otherwise."""
    try:
        rows = read_jsonl(file, skip_torn=True)
    except ValueError as err:  # not UTF-8, an integer of too many digits
        raise RunnerError(f"unreadable: {err}", file=str(file)) from None
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict):
            raise RunnerError(f"row {n} is not a JSON object", file=str(file))
        if problem := _keys_problem(r):
            raise RunnerError(f"row {n}: {problem}", file=str(file))
    return rows


def _integer(v: Any) -> TypeGuard[int]:
    """An integer as JSON holds it (never a bool: true is not 1 here)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _keys_problem(r: dict) -> str | None:
    """What is wrong with a figure's keys (a loop row or a `runner eval` record's row), or None: its
    step a whole number, its task and metric strings."""
    step, task, metric = r.get("step"), r.get("task"), r.get("metric")
    if not _integer(step) or not isinstance(task, str) or not isinstance(metric, str):
        return f"step must be an integer and task, metric strings, got {step!r}, {task!r}, {metric!r}"
    return None


def _row(r: dict, source: str, file: Path, useful_by_step) -> dict:
    try:
        row = {"source": source, **{c: r[c] for c in COLUMNS if c not in ("source", *PROGRESS)}}
    except KeyError as e:
        raise RunnerError(f"a downstream row lacks {e.args[0]}", file=str(file)) from None
    for key in ("wall_seconds", "device_wall_seconds"):
        v = r.get(key, math.nan) if source == "loop" else math.nan
        if not number(v):  # float() read "2" as 2.0, true as 1.0
            raise RunnerError(
                f"wall_seconds and device_wall_seconds must be numbers, got {r.get('wall_seconds')!r}, "
                f"{r.get('device_wall_seconds')!r}",
                file=str(file),
            )
        row[key] = float(v)
    if "useful_tokens" in r and r["useful_tokens"] is not None:
        if not _integer(r["useful_tokens"]):
            raise RunnerError(f"useful_tokens must be an integer, got {r['useful_tokens']!r}", file=str(file))
        row["useful_tokens"] = r["useful_tokens"]
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


def _schema_problem(err: SchemaError, df: pd.DataFrame) -> str:
    """One line for a pandera failure: the column, the failing value and the row's scoring."""
    check = err.check
    what = getattr(check, "error", None) or getattr(check, "name", None) or str(check or err.reason_code)
    cases = err.failure_cases
    index = cases["index"].iloc[0] if isinstance(cases, pd.DataFrame) and "index" in cases and len(cases) else None
    where = ""
    if index is not None and index in df.index:
        r = df.loc[index]
        where = f" (the row of step {r['step']}, task {r['task']}, metric {r['metric']})"
    if isinstance(err.schema, pa.Column):
        value: Any = cases["failure_case"].iloc[0] if isinstance(cases, pd.DataFrame) and len(cases) else None
        value = value.item() if hasattr(value, "item") else value  # numpy's scalar, said as the file holds it
        return f"{err.schema.name}: {value!r} fails {what}{where}"
    column = _CHECKED.get(getattr(check, "name", ""), "")
    return f"{column + ': ' if column else ''}fails {what}{where}"


def _frame(rows: list[dict], file: Path | None) -> pd.DataFrame:
    """One file's rows as the schema types them, validated; RunnerError naming the file and column."""
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    for col, dtype in _DTYPES.items():
        if dtype in ("int64", "float64"):  # astype would read 1.5 or true as 1, "0.5" as 0.5
            odd = [v for v in df[col] if not (_integer(v) if dtype == "int64" else v is None or number(v))]  # None: NaN
            if odd:
                what = "a whole number" if dtype == "int64" else "a number"
                raise RunnerError(f"{col}: not {dtype} ({odd[0]!r} is not {what})", file=str(file) if file else None)
        try:
            df[col] = df[col].astype(dtype if dtype in ("int64", "float64") else str)  # typed when empty too
        except (TypeError, ValueError, OverflowError) as err:
            raise RunnerError(f"{col}: not {dtype} ({str(err).splitlines()[0]})", file=str(file)) from None
    try:
        return DOWNSTREAM.validate(df)
    except SchemaError as err:
        raise RunnerError(_schema_problem(err, df), file=str(file) if file else None) from None


def downstream_table(run_dir: str | Path, exclude: Collection[Path] = ()) -> pd.DataFrame:
    """Every downstream figure of the run, validated (RunnerError naming the file and column of a bad
    one); without the `runner eval` records in `exclude` (the table as it stood before them)."""
    run_dir = Path(run_dir)
    skipped = {Path(p).name for p in exclude}
    loop_file = run_dir / "metrics" / "downstream.jsonl"
    loop = loop_rows(loop_file) if loop_file.exists() else []
    latest = {(r["step"], r["task"], r["metric"]): r for r in loop}

    @functools.cache
    def useful_by_step() -> dict[int, int]:
        train_file = run_dir / "metrics" / "train.jsonl"
        train = read_jsonl(train_file, skip_torn=True) if train_file.exists() else []
        return cumulative_useful(list({int(r["step"]): r for r in train}.values()))

    frames = [_frame([_row(r, "loop", loop_file, useful_by_step) for r in latest.values()], loop_file)]
    for path in sorted((run_dir / "downstream").glob("eval-step-*.json")):
        if path.name in skipped:
            continue
        rows = read_eval_record(path)["rows"]
        frames.append(_frame([_row(r, "runner eval", path, useful_by_step) for r in rows], path))
    frames = [f for f in frames if len(f)] or frames[:1]  # each typed and validated, the empty one too
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    return df.sort_values(["source", "step", "task", "metric"], kind="stable").reset_index(drop=True)
