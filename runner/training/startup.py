"""How long an attempt takes to start: process start to its first step, by part (run.json `t_startup`).

Owns: the startup clock of one attempt and run.json's `t_startup` record. `runner launch` starts the
clock at the process's own start (the kernel's record of it: interpreter start-up and the CLI's
imports included); a caller of `runner.training.loop.train` without the CLI starts it when `train`
is called. The parts, consecutive and in the order they happen (SPEC "Wall-clock budget"):
  process_to_launch   process start to `runner launch`'s code (interpreter, the CLI's imports)
  config              the experiment loaded and validated
  imports             torch, transformers, accelerate and the trainer's modules
  accelerator_and_folder  the accelerator, the run folder claimed, MLflow started
  data                the manifests read and the shards opened (their verification runs behind)
  model_build         the model built (on the device where there is one) and its optimizer
  weights_on_device   accelerate's prepare (wrapping; the weights' copy when built on the host)
  checkpoint_load     on a resume: the newest checkpoint verified and loaded (0 on a fresh run)
  before_first_step   the rest: compile's wrapping, conventions, MLflow's flush, the first batches; split
                      in `before_first_step_parts` (compile_wrapping, peak, conventions, system_metrics,
                      attempt_start, rest), beside the parts and summing to this one
Each attempt also records `bytecode`: where its process read and wrote compiled modules
(runner.bytecode: beside the sources, or the runner's cache where the environment is read-only and
uncompiled), and, when it tracks, `mlflow`: where MLflow ran (its own process, started before torch's
import so that MLflow's import runs beside it, or the launch's process; runner.training.mlflow_child).
`seconds` sums them; the first step's own wall (compile and autotuning included) is
`first_step_seconds`, beside it and never in it. The attempt's wall (the run clock) starts at the
process start, so goodput's wall time counts the startup.
Never: imports torch, or decides anything about training.
"""

from __future__ import annotations

import os
import time
from typing import Any

from runner import bytecode

PARTS = (
    "process_to_launch",
    "config",
    "imports",
    "accelerator_and_folder",
    "data",
    "model_build",
    "weights_on_device",
    "checkpoint_load",
    "before_first_step",
)


def process_start_time() -> float | None:
    """The epoch second this process started, from the kernel (Linux /proc); None elsewhere.

    /proc/<pid>/stat gives the start in clock ticks after boot (10 ms, truncated); it is set against the
    boot clock (CLOCK_BOOTTIME, the clock those ticks count), so the result is as exact as the ticks.
    Not /proc/stat's `btime`: the boot's epoch in whole seconds, which put every start up to 1 s early."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot (field 22; 3 fields precede the split)
        return _boot_epoch() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME
        return None


def _boot_epoch() -> float:
    """The epoch second at which the boot clock read 0: the boot clock read between two reads of the
    wall clock, the tightest of five (a process preempted between two reads only widens one pair)."""
    width, epoch = float("inf"), 0.0
    for _ in range(5):
        before = time.time()
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        after = time.time()
        if after - before < width:
            width, epoch = after - before, (before + after) / 2 - boot
    return epoch


class StartupClock:
    """The marks of one attempt's start; `mark(part)` closes `part` at now (time.time)."""

    def __init__(self, origin: float | None = None):
        self.origin = time.time() if origin is None else origin
        self.last = self.origin
        self.parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.seconds: float | None = None  # set when the first step begins
        self.first_step_seconds: float | None = None
        self._first_t0: float | None = None
        self.detail: dict[str, float] = {}  #: before_first_step's pieces (`split`), in the order they ran
        self.mlflow: str | None = None  #: where MLflow ran (`tracking`); None: not tracked
        self._split_last = 0.0

    def mark(self, part: str) -> None:
        now = time.time()
        self.parts[part] = self.parts.get(part, 0.0) + max(0.0, now - self.last)
        self.last = now

    def split(self, piece: str) -> None:
        """Close `piece` of before_first_step at now: from the last mark or split, whichever is later."""
        now = time.time()
        self.detail[piece] = self.detail.get(piece, 0.0) + max(0.0, now - max(self.last, self._split_last))
        self._split_last = now

    def elapsed(self) -> float:
        """Seconds since the origin (what the attempt's wall counts before its first step)."""
        return max(0.0, time.time() - self.origin)

    def first_step_begins(self) -> None:
        if self.seconds is None:
            self.mark("before_first_step")
            self.seconds = sum(self.parts.values())
            self._first_t0 = time.time()

    def first_step_done(self) -> None:
        if self.first_step_seconds is None and self._first_t0 is not None:
            self.first_step_seconds = time.time() - self._first_t0

    def record(self, attempt: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "attempt": int(attempt),
            "seconds": round(self.seconds if self.seconds is not None else self.elapsed(), 3),
            "parts": {k: round(v, 3) for k, v in self.parts.items()},
            "first_step_seconds": None if self.first_step_seconds is None else round(self.first_step_seconds, 3),
            "bytecode": bytecode.state(),
        }
        if self.mlflow is not None:
            out["mlflow"] = self.mlflow
        if self.detail and self.seconds is not None:  # before_first_step by piece, `rest` what no piece named
            rest = self.parts["before_first_step"] - sum(self.detail.values())
            out["before_first_step_parts"] = {
                k: round(v, 3) for k, v in {**self.detail, "rest": max(0.0, rest)}.items()
            }
        return out


_current: StartupClock | None = None
_launched = False  # `runner launch` started the clock at the process start; train() takes it as it is


_process_launches = 0


def _process_is_runner() -> bool:
    """This process was started to run `runner` (`python -m runner`, the console script, a launcher's
    worker of either), not a host that calls the CLI in process (a test, a notebook)."""
    import sys  # noqa: PLC0415

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and str(spec.name).split(".")[0] == "runner":
        return True
    return os.path.basename(sys.argv[0] if sys.argv else "") == "runner"


def begin_launch() -> None:
    """`runner launch`: this attempt started when the process did (the part before now is the
    interpreter's and the CLI's), when the process was started for it; else now."""
    global _current, _launched, _process_launches
    _process_launches += 1
    origin = process_start_time() if _process_launches == 1 and _process_is_runner() else None
    _current, _launched = StartupClock(origin), True
    _current.mark("process_to_launch")


def begin_train() -> StartupClock:
    """`train()`: the clock the launch started, or one starting now (tests, benches calling train)."""
    global _current, _launched
    if not _launched or _current is None:
        _current = StartupClock()
    _launched = False
    return _current


def mark(part: str) -> None:
    """Close `part` on the current attempt's clock (nothing when none runs)."""
    if _current is not None:
        _current.mark(part)


def split(piece: str) -> None:
    """Close `piece` of before_first_step on the current attempt's clock (nothing when none runs)."""
    if _current is not None:
        _current.split(piece)


def tracking(where: str | None) -> None:
    """Where this attempt's MLflow runs (runner.training.tracking.Tracker.where); None: not tracked."""
    if _current is not None:
        _current.mlflow = where


def current() -> StartupClock | None:
    return _current


def elapsed() -> float:
    """Seconds the current attempt has spent starting (0 when no clock runs)."""
    return _current.elapsed() if _current is not None else 0.0


def step_begins() -> None:
    """A step begins: the first one ends t_startup."""
    if _current is not None:
        _current.first_step_begins()


def step_done() -> None:
    """A step is committed: the first one's wall is recorded."""
    if _current is not None:
        _current.first_step_done()


def load_device(device: Any) -> str:
    """Where a resume reads a checkpoint's tensors: the accelerator's memory (safetensors copies each
    tensor from the file's mapping there), or the host."""
    return "cpu" if getattr(device, "type", "cpu") == "cpu" else str(device)


def on_device(device: Any):
    """A context that makes new tensors on `device` when it is an accelerator (the model's parameters
    built and initialised there, never on the host and copied: 1.3B fp32 parameters are 5.3 GB of
    host work and a host-to-device copy); on a CPU, nothing (the weights stay bit-identical)."""
    import contextlib  # noqa: PLC0415

    if getattr(device, "type", "cpu") == "cpu":
        return contextlib.nullcontext()
    import torch  # noqa: PLC0415  (this module stays torch-free for the reports that read its lines)

    return torch.device(device)


def merged(record: dict | None, mine: dict[str, Any]) -> dict[str, Any]:
    """run.json's `t_startup` with this attempt's entry in it: every attempt's, and their sums."""
    earlier = [a for a in (record or {}).get("attempts", []) if int(a.get("attempt", -1)) != mine["attempt"]]
    attempts = sorted(earlier + [mine], key=lambda a: int(a["attempt"]))
    first = [a["first_step_seconds"] for a in attempts if a.get("first_step_seconds") is not None]
    return {
        "seconds": round(sum(float(a["seconds"]) for a in attempts), 3),
        "first_step_seconds": round(sum(first), 3),
        "attempts": attempts,
    }


def report_lines(run: dict | None) -> list[str]:
    """report.md's startup line (run.json's `t_startup`; none for runs recorded before it)."""
    t = (run or {}).get("t_startup")
    if not isinstance(t, dict) or not t.get("attempts"):
        return []
    n = len(t["attempts"])
    last = t["attempts"][-1]
    parts = ", ".join(f"{k} {float(v):.2f}" for k, v in last.get("parts", {}).items() if float(v) >= 0.005)
    first = last.get("first_step_seconds")
    code = last.get("bytecode") or {}
    if code.get("cache", "beside the sources") != "beside the sources":
        warm = code.get("warm")
        how = "read from it: " if warm is True else "compiled into it: " if warm is False else ""
        code_text = f"; bytecode cached in {code['cache']} ({how}{code.get('why') or 'set by ' + str(code.get('by'))})"
    else:  # Python's default; `why` only where the runner's cache was wanted and could not be used
        code_text = f"; bytecode compiled by every process ({code['why']})" if code.get("why") else ""
    if last.get("mlflow"):
        code_text += f"; MLflow in {last['mlflow']}"
    return [
        f"- Startup (t_startup, process start to the first step, in the wall time; run.json `t_startup`): "
        f"{float(t['seconds']):.1f} s over {n} attempt{'s' if n != 1 else ''}; the last attempt "
        f"{float(last['seconds']):.2f} s ({parts or 'no part measured'}); its first step "
        f"{'-' if first is None else f'{float(first):.2f} s'} (compile included, not in t_startup){code_text}."
    ]
