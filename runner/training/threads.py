"""The CPU threads torch computes with in one training process (`hardware.threads`).

Owns the choice of the count an attempt uses and its application (torch.set_num_threads). The count
is operational (not in the fingerprint), but a CPU's reductions split differently over another count,
so a resumed run computes with the count its first attempt recorded in run.json (`threads`), or is
refused in one line when its recipe now states another. On a CPU the count is also the cores the
theoretical peak counts (runner.planning.hardware.cpu_theoretical_tflops reads torch's count after
this applied it), so MFU says it. Never reads or writes run.json itself.
"""

from __future__ import annotations

import torch

from runner.errors import RunnerError
from runner.host import usable_cores


def attempt_threads(stated: int | None, recorded: int | None, file: str | None = None) -> int | None:
    """The count this attempt computes with: the run's recorded count on a resume (None: a first
    attempt, or a run from before the count was recorded), else the recipe's (None: torch's default).
    A resume whose recipe states another count than the run's is refused: it would not be bit-identical."""
    if recorded is None:
        return stated
    if stated is not None and int(stated) != int(recorded):
        raise RunnerError(
            f"this run computed with {recorded} thread(s); resuming with {stated} would not be bit-identical: "
            f"set threads: {recorded} to resume it (or start a new run)",
            file=file,
            key="hardware.threads",
        )
    return int(recorded)


def check_threads(stated: int | None, file: str | None = None) -> None:
    """A stated count within the cores this process may use, checked before a run folder is written:
    more threads than cores overstate a CPU's peak (it counts them as cores) and only slow the run
    (1,024 on 2 cores: 10x slower; 4,096 never finished; 100,000 a segmentation fault in torch)."""
    cores = usable_cores()
    if stated is not None and int(stated) > cores:
        raise RunnerError(
            f"{int(stated):,} threads, but this process may use {cores} core(s): at most {cores} "
            "(more overstate the CPU's peak and slow the run)",
            file=file,
            key="hardware.threads",
        )


def apply_threads(count: int | None) -> int:
    """Set torch's intra-op threads to `count` (None: leave torch's default); returns what torch now uses."""
    if count is not None:
        torch.set_num_threads(int(count))
    return int(torch.get_num_threads())
