"""Reading back what a run recorded: the devices it held, its MFU convention and its times
(runner.reports.tables, runner.reports.audit.run and the model card read a run through these), and
the manifest copies of a run or a report. Never writes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from runner.config.rules import devices
from runner.config.schema import ExperimentSchema
from runner.errors import RunnerError
from runner.fsio import read_json
from runner.planning.flops import Convention
from runner.runs.runjson import RunJson, as_record

# ---- reading what a run recorded ----------------------------------------------------------------


def device_seconds_or(recorded: float | None, seconds: float, world: int) -> float:
    """Recorded device-seconds, else `seconds` x `world`: what a record written before device-seconds
    were counted per attempt (one world size throughout) stands for. The one copy of this fallback."""
    return float(recorded) if recorded is not None else seconds * world


def read_manifest_copies(folder: Path, domains: list[str]) -> dict[str, dict]:
    """The manifest JSON of each domain from `folder/<domain>.json` (a run's or a report's copies;
    shards not needed)."""
    out = {}
    for d in domains:
        out[d] = read_json(folder / f"{d}.json")
        if not isinstance(out[d], dict) or "pool_tokens" not in out[d]:
            raise RunnerError("pool_tokens: missing", file=str(folder / f"{d}.json"))
    return out


def devices_held(run: RunJson | dict, cfg: ExperimentSchema) -> int:
    """Devices the run held: run.json `devices` (the trainer's world size), else
    conventions.devices_counted, else the hardware recipe (runs recorded before either existed).

    The recipe is only a last resort because a launcher (torchrun --nproc-per-node) can start more
    processes than the recipe names, and MFU and cost are over what was held.
    """
    rec = as_record(run)
    if rec.devices is not None:
        return int(rec.devices)
    recorded = (rec.conventions or {}).get("devices_counted")
    if recorded is not None:
        return int(recorded)
    return devices(cfg)


def conventions_of(run: RunJson | dict, cfg: ExperimentSchema) -> dict:
    """The MFU convention record: run.json's `conventions`, peak fields defaulting to the hardware
    recipe and devices_counted to the devices held."""
    run = as_record(run)
    recorded = dict(run.conventions or {})
    conv = Convention.from_dict(recorded).to_dict()
    hw = cfg.hardware
    conv["peak_tflops"] = recorded.get("peak_tflops", hw.peak_tflops)
    conv["peak_dtype"] = recorded.get("peak_dtype", hw.peak_dtype)
    conv["peak_source"] = recorded.get("peak_source", hw.peak_source)
    conv["devices_counted"] = int(recorded.get("devices_counted", devices_held(run, cfg)))
    conv["time_basis"] = recorded.get("time_basis", "step")
    if conv["time_basis"] == "step":  # runs before issue 28 read step time when the host had queued it
        conv["step_clock"] = recorded.get("step_clock", "host")
    if conv["peak_tflops"] is None:
        raise RunnerError(
            "no peak_tflops recorded in run.json conventions or hardware recipe", key="conventions.peak_tflops"
        )
    return conv


def device_seconds(
    run: RunJson | dict, cfg: ExperimentSchema, wall_seconds: float, step_seconds_total: float
) -> tuple[float, float]:
    """(device_wall_seconds, device_step_seconds): time x devices held, summed over attempts.

    run.json's figures when recorded (the trainer sums each attempt with its own world size),
    else the seconds x the devices held (runs recorded before; one world size throughout)."""
    rec = as_record(run)
    held = devices_held(rec, cfg)
    return (
        device_seconds_or(rec.device_wall_seconds, wall_seconds, held),
        device_seconds_or(rec.device_step_seconds_total, step_seconds_total, held),
    )


def run_times(run: RunJson | dict, train_rows: list[dict]) -> tuple[float, float]:
    """(wall_seconds, step_seconds_total): run.json's totals when recorded, else from train.jsonl
    (recorded_times)."""
    times = recorded_times(run, 1, train_rows)
    return times.wall_seconds, times.step_seconds_total


@dataclass(frozen=True)
class RecordedTimes:
    """A finished (or stopped) run's time figures as a report reads them."""

    wall_seconds: float
    step_seconds_total: float
    device_wall_seconds: float
    device_step_seconds: float


def recorded_times(run: RunJson | dict, held: int, train_rows: list[dict]) -> RecordedTimes:
    """The times a run recorded: run.json's totals when present; else the step and wall time from
    metrics/train.jsonl (a row's step_seconds stands for each step since the previous row:
    log_interval_steps > 1 logs one row per interval) and device-seconds as time x `held`."""
    rec = as_record(run)
    wall, step_total = _seconds(rec, train_rows)
    return RecordedTimes(
        wall,
        step_total,
        device_seconds_or(rec.device_wall_seconds, wall, held),
        device_seconds_or(rec.device_step_seconds_total, step_total, held),
    )


def _seconds(run: RunJson, train_rows: list[dict]) -> tuple[float, float]:
    wall: float | None = run.wall_seconds
    step_total: float | None = run.step_seconds_total
    if train_rows and (wall is None or step_total is None):
        rows = sorted(train_rows, key=lambda r: r["step"])
        prev, summed = 0, 0.0
        for r in rows:
            span = max(int(r["step"]) - prev, 1)
            summed += float(r["step_seconds"]) * span
            prev = int(r["step"])
        wall = wall if wall is not None else max(float(r["wall_seconds"]) for r in rows)
        step_total = step_total if step_total is not None else summed
    if wall is None or step_total is None:
        raise RunnerError("no wall_seconds/step_seconds_total and no metrics/train.jsonl rows", file="run.json")
    return float(wall), float(step_total)


#: the largest count a record may hold: every table stores counts as int64 (pandas' astype overflowed)
INT64_MAX = 2**63 - 1


def whole(value) -> bool:
    """A count as a record holds it: an int from 0 to INT64_MAX (never a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX


def number(value) -> bool:
    """A figure as a record holds it: an int or a float (never a bool; NaN and infinity are numbers)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


#: the fields of metrics/train.jsonl and eval.jsonl rows that reports, plans and fits read: counts are
#: whole numbers, figures numbers (NaN allowed: an older row's missing time), the domain text
TRAIN_FIELDS = dict.fromkeys(("step", "tokens_processed", "tokens_useful", "exposure_tokens", "devices"), "whole") | {
    k: "number"
    for k in (
        "loss",
        "lr",
        "grad_norm",
        "step_seconds",
        "data_wait_seconds",
        "wall_seconds",
        "tokens_per_second",
        "tokens_per_second_useful",
        "mfu",
        "goodput_mfu",
        # a mixture of experts' step figures (runner.training.callbacks.MOE_METRICS)
        "router_aux_loss",
        "router_z_loss",
        "expert_load_imbalance",
        "expert_load_cv",
        "expert_idle_capacity",
    )
}
#: what every train.jsonl row holds for the report's throughput table
TRAIN_REQUIRED = ("step", "tokens_per_second", "step_seconds", "mfu", "goodput_mfu")
EVAL_FIELDS = (
    dict.fromkeys(("step", "exposure_tokens", "samples", "tokens", "useful_tokens"), "whole")
    | dict.fromkeys(("loss_nats", "bpb", "wall_seconds", "device_wall_seconds"), "number")
    | {"domain": "text"}
)
#: what every eval.jsonl row holds for the validation table (samples and tokens: an older runner's rows
#: lack them, said in their own words by runner.training.targets.complete_eval_rows)
EVAL_REQUIRED = ("step", "domain", "exposure_tokens", "loss_nats", "bpb")
#: the lines of journal/processed.jsonl (runner.training.clock), which a resume replays into its clock and ledger
JOURNAL_FIELDS = (
    dict.fromkeys(("attempt", "step", "micro"), "whole")
    | {"world": "devices", "processed": "counts"}
    | dict.fromkeys(("wall_seconds", "step_seconds_total", "device_step_seconds_total"), "seconds")
)
_KINDS = {
    "whole": "a whole number >= 0",
    "devices": "a whole number >= 1",
    "text": "text",
    "number": "a number",
    "seconds": "a finite number of seconds >= 0",
    "counts": "a mapping of domains to whole numbers >= 0",
}


def _of_kind(v, kind: str) -> bool:
    if kind == "whole":
        return whole(v)
    if kind == "devices":
        return whole(v) and v >= 1
    if kind == "text":
        return isinstance(v, str)
    if kind == "counts":
        return isinstance(v, dict) and all(whole(n) for n in v.values())
    return number(v) and (kind == "number" or (math.isfinite(v) and v >= 0))


def checked_rows(rows: list, fields: dict[str, str], file: Path, required: tuple[str, ...] = ()) -> list[dict]:
    """metrics (or journal) rows, each an object whose known fields have their kind and that holds every
    `required` one (a forged or damaged row is one line naming the file, field and line, not a traceback
    wherever it is read)."""
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise RunnerError(f"line {n}: must be a JSON object, got {json.dumps(row)[:40]}", file=str(file))
        for field, kind in fields.items():
            if field not in row:
                continue
            v = row[field]
            if not _of_kind(v, kind):
                beyond = kind in ("whole", "devices") and isinstance(v, int) and v > INT64_MAX
                raise RunnerError(
                    f"line {n}: must be {_KINDS[kind]}{' up to 2**63 - 1' if beyond else ''}, got {json.dumps(v)[:40]}",
                    file=str(file),
                    key=field,
                )
        for field in required:  # after the kinds: a field of another type is named first
            if field not in row:
                raise RunnerError(f"line {n}: missing", file=str(file), key=field)
    return rows
