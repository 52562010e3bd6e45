"""What planning reads from runs and reports: a pilot run's scaling-law point (N, D, final loss)
and a calibration run's measured throughput. Planning itself is arithmetic over the numbers these
hand it (runner.planning.scaling fits Points, runner.planning.plan uses a Calibration); it never
reads a run folder.
Never: fits, plans, trains or edits a run folder.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runner.config.load import load_saved_experiment
from runner.config.rules import devices
from runner.config.schema import ExperimentSchema
from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl
from runner.planning import hardware
from runner.planning.flops import Convention, convention_for, flops_per_token, params_of_config
from runner.planning.memory import as_schema
from runner.planning.plan import Calibration, architecture
from runner.planning.scaling import Point, check_point
from runner.runs.folder import is_report_copy
from runner.runs.recorded import EVAL_FIELDS, TRAIN_FIELDS, checked_rows
from runner.runs.runjson import RunJson


# ---------------------------------------------------------------- pilot points
def read_report_point(report_dir: Path) -> Point:
    """A point from a report folder: run_summary.parquet (N, D) and validation.parquet (final loss)."""
    table = _report_table(report_dir / "run_summary.parquet", ("params_counted", "params", "exposure_tokens"))
    if table.empty:
        raise RunnerError("no row", file=str(report_dir / "run_summary.parquet"))
    summary = table.iloc[0]
    if summary.get("params_counted") not in ("non_embedding", "active"):
        raise RunnerError(
            f"run_summary counts {summary.get('params_counted')!r} params; the fit needs "
            "non-embedding N: pass the run folder instead",
            file=str(report_dir),
        )
    validation = _report_table(report_dir / "validation.parquet", ("step", "domain", "loss_nats", "bpb"))
    if validation.empty:
        raise RunnerError("no evaluation recorded", file=str(report_dir / "validation.parquet"))
    final = validation[validation["step"] == validation["step"].max()]
    if "tokens" in final:  # a domain with no validation sample is never measured: not in the point
        final = final[final["tokens"] != 0]
    losses = {str(d): float(v) for d, v in zip(final["domain"], final["loss_nats"])}
    name = str(summary.get("run_id") or report_dir.name)
    point = Point(
        name,
        float(summary["params"]),
        float(summary["exposure_tokens"]),
        float(np.mean(list(losses.values()))),
        losses,
        str(summary.get("experiment") or ""),
        {str(d): float(v) for d, v in zip(final["domain"], final["bpb"])},
        {str(d): _count(v) for d, v in zip(final["domain"], final["tokens"])} if "tokens" in final else {},
    )
    return check_point(point, str(report_dir))


def _count(value: Any) -> Any:
    """A token count as an int; a NaN or infinity is kept for check_point to name."""
    return int(value) if math.isfinite(value) else float(value)


_NUMERIC = (
    *("params", "exposure_tokens", "step", "loss_nats", "bpb", "tokens"),
    *("tokens_per_second", "step_seconds", "devices", "wall_seconds", "processed_tokens", "useful_tokens"),
)


def _report_table(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    """A report table the fit reads, with the columns it needs (numbers where numbers are meant), or
    one line naming the file and the column."""
    try:
        df = pd.read_parquet(path)
    except FileNotFoundError:
        raise RunnerError("missing table", file=str(path)) from None
    except Exception as err:  # pyarrow raises several types for a corrupt file
        raise RunnerError(
            f"unreadable parquet: {str(err).splitlines()[0][:160] if str(err) else err!r}", file=str(path)
        ) from None
    for col in columns:
        if col not in df.columns:
            raise RunnerError("column missing (rebuild the report: `runner report RUN`)", file=str(path), key=col)
    for col in (c for c in _NUMERIC if c in df.columns):
        if not pd.api.types.is_numeric_dtype(df[col]):
            raise RunnerError(f"must hold numbers, holds {df[col].dtype}", file=str(path), key=col)
    for col in (c for c in columns if pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])):
        # NaN is a figure not measured (an older row's); infinity is no figure, and a step must be one
        bad = df[col].isin([np.inf, -np.inf]) | (df[col].isna() if col == "step" else False)
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise RunnerError(f"row {row}: not a finite number: {df[col].iloc[row]}", file=str(path), key=col)
    return df


def _eval_rows(path: Path) -> list[dict]:
    """metrics/eval.jsonl's rows, each with the keys the fit reads (one line naming the row and key otherwise)."""
    return checked_rows(read_jsonl(path), EVAL_FIELDS, path, required=("step", "domain", "loss_nats"))


def read_point(run_dir: str | Path) -> Point:
    """A point from a run folder: experiment.yaml (N), ledger.json / run.json (D), metrics/eval.jsonl
    (loss); or from a report folder (run_summary.parquet), or a run folder holding only report/."""
    run_dir = Path(run_dir)
    if (run_dir / "run_summary.parquet").exists():
        return read_report_point(run_dir)
    if not (run_dir / "experiment.yaml").exists() and (run_dir / "report" / "run_summary.parquet").exists():
        return read_report_point(run_dir / "report")
    exp = run_dir / "experiment.yaml"
    evals = run_dir / "metrics" / "eval.jsonl"
    for needed in (exp, evals):
        if not needed.exists():
            raise RunnerError(f"missing {needed.relative_to(run_dir)}: not a finished run folder", file=str(run_dir))
    cfg = load_saved_experiment(exp).config
    params = params_of_config(cfg).non_embedding
    tokens = _exposure_tokens(run_dir, cfg)
    rows = _eval_rows(evals)
    if not rows:
        raise RunnerError("no evaluation recorded", file=str(evals))
    last_step = max(int(r["step"]) for r in rows)
    # a domain with no validation sample is never measured (its row: tokens 0, loss NaN): not in the point
    last = {r["domain"]: r for r in rows if int(r["step"]) == last_step and r.get("tokens") != 0}
    final = {d: float(r["loss_nats"]) for d, r in last.items()}
    if not final:
        raise RunnerError("no per-domain loss at the final evaluation", file=str(evals))
    loss = float(np.mean(list(final.values())))
    if not math.isfinite(loss):
        raise RunnerError(f"final validation loss is {loss}", file=str(evals))
    bpb = {d: float(r["bpb"]) for d, r in last.items() if "bpb" in r}
    weights = {d: _count(r["tokens"]) for d, r in last.items() if "tokens" in r}
    return check_point(
        Point(run_dir.name, float(params), float(tokens), loss, final, cfg.name, bpb, weights), str(run_dir)
    )


def read_fit_points(runs: Iterable[str | Path], holdout: Iterable[str | Path]) -> tuple[list[Point], list[Point]]:
    """The fit's points and the held-out ones, each run once: `runner fit runs/EXP R` (R inside
    runs/EXP), or R and R/report, fitted one run twice; `runner fit runs/EXP --holdout R` fitted R and
    then "predicted" it. A held-out run is never fitted, however the fit's folders named it."""

    def once(paths: Iterable[str | Path]) -> dict[tuple[str, str], Point]:
        points: dict[tuple[str, str], Point] = {}
        for path in expand_run_dirs(paths):
            point = read_point(path)
            points.setdefault((point.experiment, point.run), point)
        return points

    held = once(holdout)
    return [p for key, p in once(runs).items() if key not in held], list(held.values())


def expand_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders from what a user types: a run folder as is, and `runs/EXPERIMENT` (the folder
    `runner launch` puts an experiment's runs in) as every finished run inside it."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise RunnerError("no such run folder", file=str(path))
        if (
            (path / "experiment.yaml").exists()
            or (path / "run_summary.parquet").exists()
            or (path / "report" / "run_summary.parquet").exists()
        ):
            out.append(path)
            continue
        inner = sorted(p for p in path.iterdir() if p.is_dir() and (p / "metrics" / "eval.jsonl").exists())
        if not inner:
            raise RunnerError(
                "neither a finished run folder (experiment.yaml, metrics/eval.jsonl) nor a folder "
                "of runs (runs/EXPERIMENT)",
                file=str(path),
            )
        out.extend(inner)
    return out


def _exposure_tokens(run_dir: Path, cfg: ExperimentSchema) -> float:
    ledger = run_dir / "ledger.json"
    if ledger.exists():
        data = read_json(ledger)
        total = (data.get("counters") or {}).get("total") or {}
        if total.get("exposure"):
            return float(total["exposure"])
    run_json = run_dir / "run.json"
    if run_json.exists():
        steps = read_json(run_json).get("committed_steps")
        if steps:
            return float(steps * cfg.train.global_batch_sequences * cfg.train.seq_len)
    raise RunnerError(
        "no exposure tokens: neither ledger.json counters.total.exposure nor run.json committed_steps",
        file=str(run_dir),
    )


# ---------------------------------------------------------------- calibration
def _report_rows(folder: Path) -> list[dict]:
    """A report folder's steps as metrics/train.jsonl rows: its throughput table (each step's tokens/s
    and step time), the run summary's devices on each, and on the last its whole wall clock (start-up
    and the final evaluation included) and processed and useful tokens."""
    steps = _report_table(folder / "throughput.parquet", ("step", "tokens_per_second", "step_seconds"))
    columns = ("devices", "wall_seconds", "processed_tokens", "useful_tokens")
    table = _report_table(folder / "run_summary.parquet", columns)
    if table.empty:
        raise RunnerError("no row", file=str(folder / "run_summary.parquet"))
    summary = table.iloc[0]
    for col in columns:
        if not math.isfinite(float(summary[col])):
            raise RunnerError(f"not a number: {summary[col]}", file=str(folder / "run_summary.parquet"), key=col)
    rows = [
        {"step": int(r.step), "tokens_per_second": float(r.tokens_per_second), "step_seconds": float(r.step_seconds)}
        for r in steps.itertuples()
        if pd.notna(r.tokens_per_second)
        and r.tokens_per_second > 0
        and pd.notna(r.step_seconds)
        and r.step_seconds >= 0
    ]
    for r in rows:
        r["devices"] = int(summary["devices"])
    if rows:
        rows[-1].update(
            wall_seconds=float(summary["wall_seconds"]),
            tokens_processed=float(summary["processed_tokens"]),
            tokens_useful=float(summary["useful_tokens"]),
        )
    return rows


def read_calibration(
    run_dir: str | Path, cfg: ExperimentSchema | Mapping[str, Any], convention: Convention | None = None
) -> Calibration:
    """Measured throughput (median tokens_per_second after the first step), overheads
    (wall / sum of step time - 1) and useful fraction of a run folder, or of a report folder (its
    throughput table and run summary: _report_rows). The MFU is under
    `convention`, by default the one a run of `cfg` records (flops.convention_for)."""
    run_dir = Path(run_dir)
    cfg = as_schema(cfg)
    convention = convention or convention_for(cfg)
    metrics = run_dir / "metrics" / "train.jsonl"
    if metrics.exists():
        rows = [r for r in checked_rows(read_jsonl(metrics), TRAIN_FIELDS, metrics) if r.get("tokens_per_second")]
    elif is_report_copy(run_dir):  # a published report (a colleague's H200 run) calibrates as its run would
        rows, metrics = _report_rows(run_dir), run_dir / "throughput.parquet"
    else:
        raise RunnerError(
            "no metrics/train.jsonl: not a run folder or a report folder, or it has not logged a step",
            file=str(run_dir),
        )
    if not rows:
        raise RunnerError("no step with tokens_per_second", file=str(metrics))
    # The first step pays for compilation and warm-up; it counts as overhead, not throughput.
    steady = rows[1:] or rows
    tps = statistics.median(float(r["tokens_per_second"]) for r in steady)
    step_total = sum(float(r.get("step_seconds") or 0) for r in rows)
    walls = [float(r["wall_seconds"]) for r in rows if r.get("wall_seconds") is not None]
    # wall_seconds is elapsed since the run started (non-decreasing); per-step values are summed.
    wall = (walls[-1] if all(b >= a for a, b in zip(walls, walls[1:])) else sum(walls)) if walls else step_total
    # Start-up (run.json t_startup, in wall_seconds since it was recorded) is a fixed cost per attempt,
    # not a fraction of training: a 6-step smoke's 3.5 s start over 1 s of steps made its full run's
    # measured wall 4.5x its steps (1.8 min at 18% MFU, against 0.9 min at an assumed 9%).
    raw = read_json(run_dir / "run.json") if (run_dir / "run.json").exists() else {}
    startup = raw.get("t_startup") if isinstance(raw, dict) else None
    startup_seconds = 0.0  # one attempt's: the plan adds it once
    if walls and isinstance(startup, dict) and isinstance(startup.get("seconds"), (int, float)):
        wall = max(step_total, wall - float(startup["seconds"]))
        attempts = startup.get("attempts")
        startup_seconds = float(startup["seconds"]) / (attempts if isinstance(attempts, int) and attempts > 0 else 1)
    overhead = max(0.0, wall / step_total - 1.0) if step_total > 0 else 0.0
    last = rows[-1]
    useful_fraction = 1.0
    if last.get("tokens_useful") and last.get("tokens_processed"):
        useful_fraction = float(last["tokens_useful"]) / float(last["tokens_processed"])

    exp_file = run_dir / "experiment.yaml"
    run_cfg = load_saved_experiment(exp_file).config if exp_file.exists() else cfg
    kinds = [("cpu" if str(c.hardware.accelerator) == "cpu" else "GPU") for c in (run_cfg, cfg)]
    if kinds[0] != kinds[1]:  # a CPU run's 13% carried to an H200 plan made 1p3b 20.8 days
        raise RunnerError(
            f"trained on a {kinds[0]} ({run_cfg.hardware.device_name}), this plan is for a {kinds[1]} "
            f"({cfg.hardware.device_name}): an MFU measured on one kind of device says nothing of the other; "
            f"calibrate with a run on a {kinds[1]}",
            file=str(run_dir),
            key="--calibrate",
        )
    same = run_cfg is cfg or (
        run_cfg.model == cfg.model and run_cfg.hardware == cfg.hardware and run_cfg.train.seq_len == cfg.train.seq_len
    )
    note = ""
    if run_cfg is cfg:
        note = "run folder has no experiment.yaml: assumed to be this experiment"
    elif not same:
        note = "calibration run differs in model/hardware/seq_len: its MFU is carried over, not its tokens/s"
    mfu_value = None
    run_info = RunJson.from_dict(raw if isinstance(raw, dict) else {})
    conventions = run_info.conventions or {}
    # The devices that ran the measured steps (rows record them; a launcher may differ from the recipe).
    held = [int(r["devices"]) for r in steady if r.get("devices")]
    n_devices = int(statistics.median_low(held)) if held else int(run_info.devices or devices(run_cfg))
    try:
        peak = float(conventions.get("peak_tflops") or hardware.resolve_peak(run_cfg.hardware).peak_tflops)
        mfu_value = hardware.mfu(flops_per_token(run_cfg, convention), tps, 1.0, peak, n_devices)
    except RunnerError as e:
        note = (note + "; " if note else "") + f"MFU not derivable: {e}"
    if mfu_value is not None and not mfu_value <= 1.0:  # audit-claims' IMPOSSIBLE; 1e300 tokens/s showed "1e302%"
        raise RunnerError(
            f"its median {tps:.4g} tokens/s is MFU {mfu_value:.4g} (over 100%) of {n_devices} x {peak:g} TFLOP/s"
            " peak: not a throughput that device can reach, so not a calibration",
            file=str(metrics),
            key="--calibrate",
        )
    arch = architecture(run_cfg)
    return Calibration(
        str(run_dir), len(rows), tps, useful_fraction, overhead, mfu_value, same, note, arch, startup_seconds
    )
