"""The run clock: step and wall time of a run across its attempts, in seconds and device-seconds.

Owns the time figures every MFU, goodput and cost divides by (SPEC: time bases): each committed
step's time on the device's clock, each attempt's wall time, both also x the devices that attempt
held (a run resumed on another world size counts each attempt with its own), the processed-work
journal (`journal/processed.jsonl`: one line per micro step spent, and one per evaluation and
attempt end with the time alone), its replay on resume (a SIGKILL loses no processed work and no
wall time), and the clock's part of a checkpoint (`state_dict`/`load_state_dict`). Reading back the totals a
run recorded in run.json is runner.runs.recorded (`recorded_times`, for reports).
Never imports torch: the device's clock is handed in (runner.training.accelerator.StepClock).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TextIO

from runner.runs.checkpoints import CLOCK_KEYS
from runner.runs.recorded import device_seconds_or


class DeviceClock(Protocol):
    """What times a step: `now()` readings, and the seconds from one to the device being done;
    `basis` names it in the MFU convention (step_clock)."""

    basis: str

    def now(self) -> float: ...

    def seconds_since(self, t0: float) -> float: ...


class HostClock:
    """The host's clock as a device clock: a CPU computes synchronously (tests, planning tools)."""

    basis = "host"

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now

    def seconds_since(self, t0: float) -> float:
        return self.now() - t0


class RunClock:
    """Step and wall time of one run, advanced by the loop of one attempt (see the module docstring).

    `world` is this attempt's device count; `step_clock` times steps on the device (its `now()`
    readings are what the journal's in-step times are taken from); `host_now` is the wall clock."""

    def __init__(
        self, world: int, step_clock: DeviceClock | None = None, host_now: Callable[[], float] = time.perf_counter
    ):
        self.world = int(world)
        self.step_clock: DeviceClock = step_clock if step_clock is not None else HostClock(host_now)
        self.host_now = host_now
        self.attempt = 1
        self.prior_wall_seconds = 0.0  # earlier attempts, crashed ones included
        self.prior_device_wall_seconds = 0.0  # the same, each attempt's wall x the devices it held
        self.step_seconds_total = 0.0  # all attempts: committed steps and the work lost after them
        self.device_step_seconds_total = 0.0  # the same, each step's time x the devices that ran it
        self.t_attempt = host_now()  # start_attempt sets it at the attempt's first step
        self.ended_seconds: float | None = None  # the attempt's wall as end_attempt journaled it
        self.step_t0 = 0.0  # the device clock's reading when the current step started
        self.journal: TextIO | None = None

    # ---- checkpoints and resume ------------------------------------------------------------------

    #: the keys of state_dict(), flat in a checkpoint's state.json (runner.runs.checkpoints.CheckpointState)
    STATE_KEYS = CLOCK_KEYS

    def state_dict(self) -> dict:
        """The clock's part of a checkpoint's state (unrounded: a resume takes the largest total)."""
        return dict(zip(self.STATE_KEYS, (self.step_seconds_total, self.device_step_seconds_total, self.world)))

    def load_state_dict(self, state: Mapping) -> None:
        """The step totals as of a checkpoint (states before device-seconds: step time x its world)."""
        self.step_seconds_total = float(state.get("step_seconds_total", 0.0))
        world = int(state.get("world_size", self.world))
        self.device_step_seconds_total = device_seconds_or(
            state.get("device_step_seconds_total"), self.step_seconds_total, world
        )

    def replay(self, journal: list[dict], domains: Iterable[str]) -> dict[str, int]:
        """Continue from the journal of every attempt: this attempt's number, the wall time of the
        earlier ones (SPEC: wall basis), and the step time of work lost after the checkpoint (MFU
        divides processed tokens, lost ones included, by it). Returns the processed input positions
        per domain the journal records, for the ledger to catch up with."""
        self.attempt = 1 + max((int(e.get("attempt", 0)) for e in journal), default=0)
        spent = {d: 0 for d in domains}
        for e in journal:
            for d, n in e.get("processed", {}).items():
                spent[d] = spent.get(d, 0) + int(n)
        by_attempt: dict[int, tuple[float, int]] = {}
        for e in journal:
            a, world = int(e.get("attempt", 0)), int(e.get("world", self.world))  # journals before "world": this one's
            by_attempt[a] = (max(by_attempt.get(a, (0.0, world))[0], float(e.get("wall_seconds", 0.0))), world)
        self.prior_wall_seconds = sum(wall for wall, _ in by_attempt.values())
        self.prior_device_wall_seconds = sum(wall * world for wall, world in by_attempt.values())
        steps = [float(e.get("step_seconds_total", 0.0)) for e in journal]
        self.step_seconds_total = max([self.step_seconds_total] + steps)
        device = [
            device_seconds_or(e.get("device_step_seconds_total"), s, int(e.get("world", self.world)))
            for e, s in zip(journal, steps)
        ]
        self.device_step_seconds_total = max([self.device_step_seconds_total] + device)
        return spent

    # ---- one attempt ------------------------------------------------------------------------------

    def start_attempt(self, journal: TextIO | None, started_before: float = 0.0) -> None:
        """The attempt's first step starts now; `journal` (rank 0's, else None) gets its lines. Its wall
        counts `started_before` seconds already spent starting it (runner.training.startup)."""
        self.journal = journal
        self.t_attempt = self.host_now() - max(0.0, started_before)
        self.ended_seconds = None

    def begin_step(self) -> None:
        self.step_t0 = self.step_clock.now()

    def end_step(self) -> float:
        """The committed step's seconds on the device's clock (its optimizer's kernels done), counted."""
        seconds = self.step_clock.seconds_since(self.step_t0)
        self.step_seconds_total += seconds
        self.device_step_seconds_total += seconds * self.world
        return seconds

    def attempt_seconds(self) -> float:
        """This attempt's wall so far; after end_attempt, the figure it journaled (the clock stops there:
        run.json's wall and device-seconds, the cost and goodput MFU computed from them, and the next
        resume's replay of the journal are one reading, not several taken moments apart)."""
        if self.ended_seconds is not None:
            return self.ended_seconds
        return self.host_now() - self.t_attempt

    def wall_seconds(self) -> float:
        """Wall seconds of the run so far, every attempt's."""
        return self.prior_wall_seconds + self.attempt_seconds()

    def device_wall_seconds(self) -> float:
        """Device-seconds held so far: the goodput MFU and cost denominator."""
        return self.prior_device_wall_seconds + self.attempt_seconds() * self.world

    def totals(self) -> dict:
        """run.json's time figures as of now."""
        return {
            "step_seconds_total": self.step_seconds_total,
            "device_step_seconds_total": self.device_step_seconds_total,
            "wall_seconds": self.wall_seconds(),
            "device_wall_seconds": self.device_wall_seconds(),
        }

    # ---- the journal -------------------------------------------------------------------------------

    def journal_micro(self, step: int, micro: int, processed: dict[str, int]) -> None:
        """Journal one micro step's processed work as it is spent, with the times as of it."""
        if self.journal is None:
            return
        in_step = self.step_clock.now() - self.step_t0
        line = {
            "attempt": self.attempt,
            "world": self.world,
            "step": step,
            "micro": micro,
            "processed": processed,
            "wall_seconds": round(self.attempt_seconds(), 3),
            "step_seconds_total": round(self.step_seconds_total + in_step, 3),
            "device_step_seconds_total": round(self.device_step_seconds_total + in_step * self.world, 3),
        }
        self._write(line)

    def journal_time(self) -> tuple[float, float]:
        """Journal how long this attempt has run (no work) and return (wall, device wall) as of that
        line: what an evaluation is stamped with, so a later resume, which counts an attempt's wall
        from its journal, never starts below a figure the attempt already reported."""
        held = self.ended_seconds
        if held is None:
            held = math.ceil(self.attempt_seconds() * 1000) / 1000
        if self.journal is not None:
            line = {
                "attempt": self.attempt,
                "world": self.world,
                "processed": {},
                "wall_seconds": held,
                # unrounded: a resume takes the largest total it finds, and must find the checkpoint's
                "step_seconds_total": self.step_seconds_total,
                "device_step_seconds_total": self.device_step_seconds_total,
            }
            self._write(line)
        return self.prior_wall_seconds + held, self.prior_device_wall_seconds + held * self.world

    def end_attempt(self) -> None:
        """The attempt's whole wall, for the next resume (a kill loses only the tail); the journal closed.
        The clock stops here: every later reading is the journaled one."""
        if self.ended_seconds is None:
            self.ended_seconds = math.ceil((self.host_now() - self.t_attempt) * 1000) / 1000
            self.journal_time()
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    def _write(self, line: dict) -> None:
        assert self.journal is not None
        self.journal.write(json.dumps(line) + "\n")
        self.journal.flush()
