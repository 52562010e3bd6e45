"""The audit's recount of a report's compute figures: params and FLOPs per token from the saved config
against the recorded convention, the peak (a datasheet figure, or a CPU's cores x clock x FLOP/cycle
recomputed) against the hardware record, and from them MFU, goodput MFU, HFU and cost against the
summary (SPEC's formulas; the audit's own arithmetic, not the trainer's). `check_compute` is what
runner.reports.audit.run calls.
"""

from __future__ import annotations

import math

import pandas as pd

from runner.planning.flops import Convention, flops_per_token, params_of_config
from runner.planning.hardware import PEAKS, canonical_device, theoretical_peak_from_source
from runner.reports import tables as rpt
from runner.reports.audit.input import AuditInput
from runner.reports.audit.result import AuditResult, close
from runner.runs.recorded import device_seconds


def _dense_peak(device_name: str) -> tuple[float | None, str]:
    key = canonical_device(device_name)
    if key is not None:
        return PEAKS[key].dense_bf16_tflops, f"{key} dense bf16 from the peak table"
    return None, "not in the peak table"


def _peak_records_agree(inp: AuditInput, s: pd.Series) -> list[str]:
    """The peak the summary divides by is the one run.json recorded for every convention."""
    problems = []
    for record in ("conventions", "conventions_goodput", "conventions_hfu"):
        conv = getattr(inp.record, record) or {}
        for key in ("peak_tflops", "peak_dtype", "peak_source"):
            if key not in conv:
                continue
            same = close(conv[key], s[key], 1e-12) if key == "peak_tflops" else str(conv[key]) == str(s[key])
            if not same:
                problems.append(f"run.json {record}.{key} = {conv[key]!r}, summary {s[key]!r}")
    return problems


def _check_peak(res: AuditResult, inp: AuditInput, s: pd.Series) -> float:
    """Check the peak behind MFU; return the peak (FLOP/s) the recount divides by.

    A datasheet device must use its dense figure. A CPU's theoretical peak is recomputed from the
    cores x clock x FLOP/cycle recorded in its source. Anything else (a measured burst, a peak a
    recipe states for a device without a datasheet row) is not a figure the audit can verify."""
    recorded, source = float(s["peak_tflops"]), str(s["peak_source"])
    problems = _peak_records_agree(inp, s)
    dense, where = _dense_peak(str(s["device_name"]))
    measured = source.startswith("measured")
    if dense is not None and not measured:
        if close(recorded, 2 * dense):
            problems.append(
                f"peak {recorded} TFLOP/s is the sparse figure of {s['device_name']} "
                f"(dense {dense}); sparse peaks are never a denominator"
            )
        elif not close(recorded, dense):
            problems.append(f"peak {recorded} TFLOP/s is not the dense peak {dense} of {s['device_name']} ({where})")
        res.add("peak is the device's dense peak", problems, ok_detail=f"{recorded} TFLOP/s ({where})")
        return dense * 1e12
    theoretical = theoretical_peak_from_source(source)
    if theoretical is not None:
        peak, rounding = theoretical
        if not math.isclose(recorded, peak, rel_tol=rounding + 1e-9):
            problems.append(f"peak {recorded} TFLOP/s, the recorded {source.split(' (')[0]} is {peak:.6g}")
        res.add(
            "peak recomputed from cores x clock x FLOP/cycle",
            problems,
            ok_detail=f"{recorded} TFLOP/s = {source.split(': ', 1)[1].split(' (')[0]}",
        )
        return recorded * 1e12
    if source.startswith("theoretical"):
        problems.append(f"peak source {source!r} does not state cores x clock x FLOP/cycle in the recorded form")
    stated = inp.config.hardware.peak_tflops
    if not measured and stated is not None and not close(stated, recorded):
        problems.append(f"peak {recorded} TFLOP/s, the hardware recipe in experiment.yaml states {stated}")
    if problems:
        res.add("peak is a figure the audit can verify", problems)
    else:
        why = "measured on the machine that ran" if measured else "stated in the hardware recipe"
        res.could_not(
            "peak is a figure the audit can verify",
            f"not a datasheet figure: {recorded} TFLOP/s {why} ({source}) for device {s['device_name']!r}",
        )
    return recorded * 1e12


def _check_flops(res: AuditResult, inp: AuditInput, s: pd.Series) -> tuple[Convention, float]:
    """Params and FLOPs per token from the model config under the recorded convention."""
    seq_len = inp.config.train.seq_len
    conv = Convention.from_dict(
        {k: s[k] for k in ("flops_formula", "params_counted", "attention_causal_half", "recompute_counted")}
    )
    n_params = params_of_config(inp.config).get(conv.params_counted)
    fpt = flops_per_token(inp.config, conv, seq_len=seq_len)
    problems = []
    if int(s["params"]) != n_params:
        problems.append(f"params = {int(s['params'])}, model config gives {n_params} ({conv.params_counted})")
    if not close(s["flops_per_token"], fpt):
        problems.append(
            f"flops_per_token = {s['flops_per_token']:.6g}, model config gives {fpt:.6g} ({conv.flops_formula})"
        )
    recorded_conv = inp.record.conventions or {}
    for key in ("flops_formula", "params_counted", "attention_causal_half", "recompute_counted"):
        if key in recorded_conv and str(recorded_conv[key]) != str(s[key]):
            problems.append(f"{key} = {s[key]!r}, run.json conventions say {recorded_conv[key]!r}")
    res.add("params and FLOPs per token from the model config", problems)
    return conv, fpt


def check_compute(res: AuditResult, inp: AuditInput) -> None:
    s = inp.tables["run_summary"].iloc[0]
    seq_len = inp.config.train.seq_len
    conv, fpt = _check_flops(res, inp, s)
    peak = _check_peak(res, inp, s)
    want: dict[str, float] = {}
    if inp.has_run_json:
        # The devices and device-seconds from run.json, not the summary's own columns: the recount
        # must not trust the figures it is checking.
        device_wall, device_step = device_seconds(
            inp.run, inp.config, float(s["wall_seconds"]), float(s["step_seconds_total"])
        )
        want.update(device_wall_seconds=device_wall, device_step_seconds=device_step)
    else:
        device_wall, device_step = float(s["device_wall_seconds"]), float(s["device_step_seconds"])
        res.could_not(
            "device-seconds recomputed",
            "no run.json: the summary's device-seconds cannot be recounted; MFU, goodput MFU and cost are "
            "recomputed over them as stated",
        )
    want |= {
        "mfu": fpt * int(s["processed_tokens"]) / (device_step * peak),
        "goodput_mfu": fpt * int(s["useful_tokens"]) / (device_wall * peak),
        "hfu": rpt.hfu_flops_per_token_or_nan(inp.config, conv, seq_len)
        * int(s["processed_tokens"])
        / (device_step * peak),
        "cost_per_billion_useful_tokens": float(s["price_per_device_hour"])
        * device_wall
        / 3600.0
        / (int(s["useful_tokens"]) / 1e9)
        if int(s["useful_tokens"])
        else 0.0,
    }
    if inp.has_run_json:
        for key in ("wall_seconds", "step_seconds_total"):
            if getattr(inp.record, key) is not None:
                want[key] = float(getattr(inp.record, key))
    for key, value in want.items():
        if key == "hfu" and math.isnan(float(s[key])) and math.isnan(value):
            res.info("hfu", "none: the run recomputes no activations (HFU = MFU)")
            continue
        ok = close(s[key], value)
        res.add(
            f"{key} recomputed",
            [] if ok else [f"report {float(s[key]):.6g}, recomputed {value:.6g}"],
            ok_detail=f"{value:.6g}",
        )
