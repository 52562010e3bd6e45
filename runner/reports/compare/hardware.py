"""What a comparison's speed and cost figures rest on: each run's hardware settings.

Owns the rule that runs measured under different hardware settings (the device, its peak, and on a
CPU the threads it computed with, which set that peak) have seconds, dollars and MFU that are NOT
comparable: they measure the setting as much as the experiment (a run on one thread of a busy
2-core machine beats one on two threads by 2x and more, whatever its learning rate). As different
tokenizers do for losses in nats, such a comparison names the difference first and crowns no
winner in seconds or dollars. Never reads files; `runner.reports.compare.runs` calls it.
"""

from __future__ import annotations

from typing import Any

from runner.runs.runjson import as_record

#: the settings compared, in the order a difference is named
SETTINGS = ("device_name", "threads", "peak_tflops")


def settings_of(summary: Any, run: dict) -> dict[str, str]:
    """One run's hardware settings as shown: device, CPU threads (CPU runs only: "not recorded" for a
    run from before they were), peak TFLOP/s to 4 significant digits."""
    device = str(summary["device_name"])
    out = {"device_name": device}
    if device.strip().lower() == "cpu":
        threads = as_record(run).threads
        out["threads"] = "not recorded" if threads is None else str(int(threads))
    out["peak_tflops"] = f"{float(summary['peak_tflops']):.4g}"
    return out


#: settings that change MFU's denominator: MFU figures under different ones are not comparable either
#: (a device alone may differ: two parts with one peak, e.g. H100 and H200 SXM, give comparable MFU)
DENOMINATOR = ("threads", "peak_tflops")


def hardware_differences(labels: list[str], settings: list[dict[str, str]]) -> dict[str, str]:
    """setting -> a phrase naming its values, e.g. `threads: 1 (a) vs 2 (b)`, for each setting whose
    values differ between the runs (in SETTINGS order; empty when the runs share them)."""
    out = {}
    for key in SETTINGS:
        values = [s.get(key, "-") for s in settings]
        if len(set(values)) > 1:
            out[key] = f"{key}: " + " vs ".join(f"{v} ({label})" for v, label in zip(values, labels))
    return out


def mfu_denominators_differ(differences: dict[str, str]) -> bool:
    return any(key in differences for key in DENOMINATOR)


def not_comparable_line(differences: dict[str, str]) -> str:
    """The sentence the comparison's speed section opens with when the settings differ."""
    return (
        "**Speed and cost NOT comparable**: the runs ran under different hardware settings ("
        + "; ".join(differences.values())
        + "): their seconds and dollars measure the setting as much as the experiment, and no run is "
        "first in them."
    )
