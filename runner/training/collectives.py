"""Collectives over the run's ranks (a no-op with one process) and the rank checks built on them.

Owns all-reduce and all-gather of small values, FSDP2's held gradient sync, a DTensor's scalar,
the check that every rank resumes from the same checkpoint, a step boundary's agreed decisions
(Decisions), the stop signal caught (StopFlag) and the bound on a stop's collectives
(StopDeadline). Never decides anything for a rank.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from runner.errors import EXIT_PREEMPTED, RunnerError


@contextlib.contextmanager
def fsdp2_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def scalar(t) -> float:
    """A 0-d tensor as float; a DTensor (a norm over sharded gradients) is reduced first."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def all_gather_ints(acc, value: int) -> list[int]:
    """`value` of every rank, in rank order (a list of one without a process group)."""
    if acc.num_processes == 1:
        return [int(value)]
    mine = torch.tensor([int(value)], dtype=torch.int64, device=acc.device)
    every = [torch.zeros_like(mine) for _ in range(acc.num_processes)]
    torch.distributed.all_gather(every, mine)
    return [int(t.item()) for t in every]


def check_same_checkpoint(steps_by_rank: list[int], run_dir: Path) -> None:
    """Every rank must resume from the same checkpoint: a node that sees another run folder (not on
    shared storage, or a stale copy) would train from another step, desynchronise and hang."""
    if len(set(steps_by_rank)) <= 1:
        return
    seen = ", ".join(f"rank {r}: {'none' if s < 0 else f'step {s}'}" for r, s in enumerate(steps_by_rank))
    raise RunnerError(
        f"ranks see different newest checkpoints ({seen}); the run folder must be on storage every node shares",
        file=str(run_dir),
    )


def all_reduce(acc, t: torch.Tensor) -> torch.Tensor:
    if acc.num_processes > 1:
        torch.distributed.all_reduce(t)
    return t


STOP_TIMEOUT_KEY = "train.checkpoint.stop_timeout_seconds"


class Decisions(NamedTuple):
    """A step boundary's decisions, each true when any rank says so (one all-reduce for the three)."""

    checkpoint: bool  #: the checkpointer's interval is due (rank 0's clock decides for all)
    stop: bool  #: a stop signal arrived
    data_failed: bool  #: a shard differs from its pin

    @classmethod
    def agreed(cls, acc, checkpoint: bool, stop: bool, data_failed: float) -> Decisions:
        summed = all_reduce(acc, torch.tensor([float(checkpoint), float(stop), data_failed], device=acc.device))
        return cls(*(bool(x > 0) for x in summed.tolist()))


class StopFlag:
    """Catches SIGTERM/SIGINT for the loop to stop at the next step boundary (and the handlers it replaced)."""

    def __init__(self):
        self.signum = None
        self.old_handlers: dict = {}
        self.deadline: StopDeadline | None = None  # with other ranks: the stop's bound

    def __call__(self, signum, frame):
        self.signum = signum


class StopDeadline:
    """The bound on a stop: after SIGTERM or SIGINT this process has `seconds` to save its stop
    checkpoint and record the attempt's end; past it, it says `line()` and exits (EXIT_PREEMPTED)
    wherever it was, a new checkpoint unsealed or unstarted.

    A stop checkpoint is collectives (the stop decision, the data check, the gather, the barrier after
    rank 0's write): a rank that is gone with its connections open (its node lost) or hung blocks them
    for the process group's timeout (gloo's: 30 min), past any scheduler's grace. A blocked collective
    is C++ (Python's signal handlers wait for it), so the countdown runs on a thread woken by the
    signal's C handler (signal.set_wakeup_fd). Exiting without a word to the folder is safe: a
    checkpoint is sealed last (runner.training.checkpoint), so the newest verified one is a whole one,
    and the journal (flushed per line) keeps the work spent, counted lost on resume, as after a kill.
    Made from the main thread, after the stop handlers are installed; `close()` when they are restored
    ends the listening (a countdown already begun runs on), `cancel()` once the attempt's end is
    recorded ends the countdown."""

    def __init__(self, seconds: float, line: Callable[[float], str]):
        self.seconds = float(seconds)
        self.line = line  # the one line said at expiry, given the seconds waited
        self._wake_r, self._wake_w = os.pipe()
        self._quit_r, self._quit_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # the C handler must never block on a full pipe
        self._previous_fd = signal.set_wakeup_fd(self._wake_w)
        self.signalled = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stop-deadline", daemon=True)
        self._thread.start()

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        os.write(self._quit_w, b"q")

    def cancel(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        stops = {int(signal.SIGTERM), int(signal.SIGINT)}
        while not self.signalled.is_set():
            ready, _, _ = select.select([self._wake_r, self._quit_r], [], [])
            if self._wake_r in ready and stops & set(os.read(self._wake_r, 64)):
                self.signalled.set()
            elif self._quit_r in ready:
                for fd in (self._wake_r, self._wake_w, self._quit_r, self._quit_w):
                    os.close(fd)
                return
        if self._done.wait(self.seconds):
            return
        try:  # os.write: the main thread may hold sys.stderr's lock
            os.write(2, (self.line(self.seconds) + "\n").encode())
        finally:
            os._exit(EXIT_PREEMPTED)
