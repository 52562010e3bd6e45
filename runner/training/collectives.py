"""Collectives over the run's ranks (a no-op with one process) and the rank checks built on them.

Owns all-reduce and all-gather of small values, FSDP2's held gradient sync, a DTensor's scalar and
the check that every rank resumes from the same checkpoint. Never decides anything for a rank.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from runner.errors import RunnerError


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
