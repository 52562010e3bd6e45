"""Batched log-likelihoods of encoded requests: many requests per forward, never one example per
forward (SPEC "Downstream evaluation": Window).

Owns: batching (requests sorted by length, longest first, `micro_batch` per forward, padded on
the right: under a causal mask a request's positions see only its own tokens, and positions
start at 0 for every row, so each row equals that request alone), the fp32 log-softmax and sum
over the continuation's positions, and the split across ranks (every rank runs the same number
of forwards; a rank short of work runs its first batch again and discards it; each request is
scored by exactly one rank, the others add an exact 0.0). Never changes the model's weights or
any RNG state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from runner.training.downstream.encode import Encoded


def batches(encoded: Sequence[Encoded], micro_batch: int) -> list[list[int]]:
    """Request indices per forward: longest first (so padding stays small), `micro_batch` each."""
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i].inputs), i))
    return [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]


def _forward(model, encoded: Sequence[Encoded], idx: list[int], device, autocast, shape) -> torch.Tensor:
    """The fp64 copy of each request's fp32 log-likelihood sum (nats). `shape` (rows, width) pads
    every forward to one shape (a compiled model then compiles once), else the batch's own."""
    height, width = shape or (len(idx), max(len(encoded[i].inputs) for i in idx))
    x = torch.zeros(height, width, dtype=torch.long)  # rows past len(idx) (a fixed shape's padding) are never read
    for row, i in enumerate(idx):
        x[row, : len(encoded[i].inputs)] = torch.as_tensor(encoded[i].inputs)
    with autocast():
        logits = model(input_ids=x.to(device)).logits
    picked, targets, owner = [], [], []
    for row, i in enumerate(idx):
        n, k = len(encoded[i].inputs), encoded[i].targets
        picked.append(logits[row, n - len(k) : n])
        targets.append(torch.as_tensor(k))
        owner.append(torch.full((len(k),), row))
    rows = torch.cat(picked).float().log_softmax(-1)
    target = torch.cat(targets).to(rows.device)
    token_ll = rows.gather(1, target[:, None])[:, 0].cpu()
    # fp32 sums per request, as HFLM adds its fp32 log-probs
    sums = torch.zeros(len(idx), dtype=torch.float32).index_add_(0, torch.cat(owner), token_ll)
    return sums.double()


@torch.no_grad()
def loglikelihoods(
    model,
    encoded: Sequence[Encoded],
    micro_batch: int,
    *,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world: int = 1,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fixed_shape: bool = False,
) -> tuple[list[float], int]:
    """Each request's `ll` (nats) and the number of forwards this rank ran. Under several ranks
    `all_reduce` sums a float64 tensor over them (required when world > 1). `fixed_shape` pads
    every forward to (micro_batch, longest input), for a compiled model: no recompilation per shape."""
    plan = batches(encoded, micro_batch)
    shape = (micro_batch, max((len(e.inputs) for e in encoded), default=1)) if fixed_shape else None
    mine = plan[rank::world]
    forwards = math.ceil(len(plan) / world)
    out = torch.zeros(len(encoded), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for n in range(forwards):
            idx = mine[n] if n < len(mine) else plan[0]
            sums = _forward(model, encoded, idx, device, autocast, shape)
            if n < len(mine):
                out[torch.as_tensor(idx)] = sums
    finally:
        if was_training:
            model.train()
    if world > 1:
        assert all_reduce is not None, "several ranks need all_reduce"
        out = all_reduce(out)
    return [float(v) for v in out], forwards
