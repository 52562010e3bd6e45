"""The plan's downstream evaluation cost: forward FLOPs of the eval recipe's task requests at the
recipe's cadence, and their time at the assumed MFU, as a share of the run's wall time.

Owns: the arithmetic only (SPEC "Downstream evaluation"; issue 22 item 7). A scoring runs one
forward over every request's window: its FLOPs are the input positions x the forward FLOPs per
token, one third of the training convention's (2N under 6N, with the same attention term).
Scorings happen every `downstream_interval_steps` committed steps and at the end of the segment
(0: the end only). The request counts and positions come from the caller (the tasks are read and
tokenized in runner.training.downstream.cost); never reads a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner.planning.flops import forward_flops_per_token


def scorings(total_steps: int, interval_steps: int) -> int:
    """Scorings over a run of one segment: every interval and the last step (counted once)."""
    if total_steps <= 0:
        return 0
    if interval_steps <= 0:
        return 1
    return total_steps // interval_steps + (1 if total_steps % interval_steps else 0)


def downstream_cost(
    tasks: Mapping[str, Mapping[str, Any]],
    *,
    training_flops_per_token: float,
    tokens_per_second: float,
    total_steps: int,
    interval_steps: int,
    wall_seconds: float,
) -> dict[str, Any]:
    """{per task: requests, positions; per scoring: positions, FLOPs, seconds; scorings; over the
    run: FLOPs, seconds and their share of `wall_seconds`}. `tokens_per_second` is the plan's
    training throughput (processed tokens/s at the assumed MFU): a forward token costs a third of a
    training token, so scoring runs at 3x that rate of positions."""
    forward_fpt = forward_flops_per_token(training_flops_per_token)
    positions = sum(float(t["positions"]) for t in tasks.values())
    per_flops = positions * forward_fpt
    per_seconds = positions / (3.0 * tokens_per_second) if tokens_per_second > 0 else float("inf")
    n = scorings(total_steps, interval_steps)
    return {
        "tasks": {name: dict(t) for name, t in sorted(tasks.items())},
        "requests": sum(int(t["requests"]) for t in tasks.values()),
        "positions_per_scoring": positions,
        "forward_flops_per_token": forward_fpt,
        "flops_per_scoring": per_flops,
        "seconds_per_scoring": per_seconds,
        "interval_steps": interval_steps,
        "scorings": n,
        "flops_total": per_flops * n,
        "seconds_total": per_seconds * n,
        "share_of_wall": per_seconds * n / wall_seconds if wall_seconds > 0 else float("inf"),
        "basis": "input positions x forward FLOPs per token (training convention / 3), at the assumed MFU; "
        "padding to each batch's longest request not counted",
    }


def format_lines(cost: Mapping[str, Any] | None, why: str | None = None) -> list[str]:
    """The plan's "downstream evaluation" block (a line saying why when it is not planned)."""
    if why:
        return [f"downstream evaluation: not planned ({why})"]
    if not cost:
        return ["downstream evaluation: none (the eval recipe lists no tasks)"]
    cadence = f"every {cost['interval_steps']:,} steps and at the end" if cost["interval_steps"] else "at the end only"
    out = [f"downstream evaluation ({cost['requests']:,} requests, {cadence}: {cost['scorings']:,} scorings)"]
    for name, t in cost["tasks"].items():
        out.append(f"  {name:<34}{t['requests']:>10,} requests{t['positions']:>14,.0f} positions   {t['basis']}")
    per, total = cost["seconds_per_scoring"], cost["seconds_total"]
    out.append(f"  {'per scoring':<34}{cost['flops_per_scoring']:>22.3e} FLOPs{per:>14.3g} s")
    out.append(
        f"  {'over the run':<34}{cost['flops_total']:>22.3e} FLOPs{total:>14.3g} s"
        f"   {cost['share_of_wall']:.3%} of the wall clock (t_eval)"
    )
    out.append(f"  basis: {cost['basis']}")
    return out
