"""Batched log-likelihoods of encoded requests: many requests per forward, never one example per
forward (SPEC "Downstream evaluation": Window, Shared context).

Owns: running the forwards of the rows runner.training.downstream.rows lays out (widest first,
`micro_batch` rows per forward, padded on the right), sharing a context's forward across its
choices (the requests of one context in one row: the context once, then each choice's tokens,
with a 4D mask by which each choice sees the context and itself, at the positions it has alone;
a row of one request is a plain causal row, positions from 0, equal to that request alone), the
fp32 log-softmax and sum over the continuation's positions, and the split across ranks (every rank
runs the same number of forwards; a rank short of work runs its first batch again and discards
it; each request is scored by exactly one rank, the others add an exact 0.0). Never changes the
model's weights or any RNG state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from runner.training.downstream.encode import Encoded
from runner.training.downstream.rows import SHARING_ATTENTION, Row, batches, rows
from runner.training.evaluate import eager_forwards

__all__ = ["SHARING_ATTENTION", "Packed", "Row", "batches", "loglikelihoods", "mask_kind_of", "pack", "rows"]


@dataclass
class Packed:
    """A forward's inputs: token ids, and where any row holds several requests their positions and a
    4D mask (None otherwise: a plain causal batch); `picks[m]` = (row, the positions whose logits
    score request m's targets) in the batch's request order."""

    ids: torch.Tensor
    positions: torch.Tensor | None
    allowed: torch.Tensor | None  # (rows, width, width) bool: query attends to key
    picks: list[tuple[int, list[int]]]
    members: list[int]

    def model_kwargs(self, device, mask_kind: str | None) -> dict:
        kwargs = {"input_ids": self.ids.to(device)}
        if self.allowed is not None:
            assert self.positions is not None
            mask = self.allowed[:, None].to(device)
            if mask_kind == "additive":
                mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
            kwargs |= {"attention_mask": mask, "position_ids": self.positions.to(device)}
        return kwargs


def pack(encoded: Sequence[Encoded], batch: list[Row]) -> Packed:
    """The batch's rows padded on the right to its widest; with a mask where a row holds several
    requests."""
    height, width = len(batch), max(r.width(encoded) for r in batch)
    ids = [[0] * width for _ in range(height)]
    positions = [[0] * width for _ in range(height)]
    segments = [[-1] * width for _ in range(height)]  # 0: the row's context, j: its j-th request, -1: padding
    picks, members = [], []
    for b, row in enumerate(batch):
        p = row.prefix
        ids[b][:p], positions[b][:p], segments[b][:p] = encoded[row.members[0]].inputs[:p], range(p), [0] * p
        at = p
        for j, i in enumerate(row.members, start=1):
            suffix = encoded[i].inputs[p:]
            n = len(suffix)
            ids[b][at : at + n], positions[b][at : at + n], segments[b][at : at + n] = suffix, range(p, p + n), [j] * n
            # the targets sit at the request's own inputs len(inputs) - len(targets) .. len(inputs) - 1:
            # the context's last position, then the suffix's
            picks.append((b, [p - 1, *range(at, at + n)]))
            members.append(i)
            at += n
    if not any(len(r.members) > 1 for r in batch):
        return Packed(torch.tensor(ids), None, None, picks, members)  # one request per row: causal alone
    seg = torch.tensor(segments)
    q, k = seg[:, :, None], seg[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    # a request's tokens see the context and their own earlier tokens; padding sees only itself
    allowed = causal & (((k == 0) & (q >= 0)) | ((k == q) & (q > 0)))
    allowed |= torch.eye(width, dtype=torch.bool) & (q == -1)
    return Packed(torch.tensor(ids), torch.tensor(positions), allowed, picks, members)


def _forward(model, encoded: Sequence[Encoded], batch: list[Row], device, autocast, mask_kind) -> tuple:
    """(request indices, the fp64 copy of each one's fp32 log-likelihood sum in nats)."""
    packed = pack(encoded, batch)
    # every request's target positions in one index: (row, position), its target token, its request
    rows_at = torch.tensor([row for row, at in packed.picks for _ in at], device=device)
    cols_at = torch.tensor([x for _, at in packed.picks for x in at], device=device)
    target = torch.tensor([t for i in packed.members for t in encoded[i].targets], device=device)
    owner = torch.tensor([m for m, (_, at) in enumerate(packed.picks) for _ in at])
    with autocast():
        # the head on the scored positions only (a context's logits are never read)
        if _scores_positions(model):
            picked = model(**packed.model_kwargs(device, mask_kind), score_at=(rows_at, cols_at))
        else:
            picked = model(**packed.model_kwargs(device, mask_kind)).logits[rows_at, cols_at]
    scores = picked.float().log_softmax(-1)
    token_ll = scores.gather(1, target[:, None])[:, 0].cpu()
    # fp32 sums per request, as HFLM adds its fp32 log-probs
    sums = torch.zeros(len(packed.members), dtype=torch.float32).index_add_(0, owner, token_ll)
    return packed.members, sums.double()


def _scores_positions(model) -> bool:
    """Whether the model (under DDP's `module` or torch.compile's `_orig_mod`) takes `score_at`."""
    for _ in range(4):
        if getattr(type(model), "scores_positions", False):
            return True
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if model is None:
            return False
    return False


def mask_kind_of(model) -> str | None:
    """How the model takes a packed row's mask ('bool' or 'additive'), or None: it cannot (its
    attention implementation takes no custom 4D mask), so no context is shared."""
    config = getattr(model, "config", None)
    return SHARING_ATTENTION.get(str(getattr(config, "_attn_implementation", None)))


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
    share: bool | None = None,
) -> tuple[list[float], int]:
    """Each request's `ll` (nats) and the number of forwards this rank ran. Under several ranks
    `all_reduce` sums a float64 tensor over them (required when world > 1). A compiled model's
    forwards run eager (evaluate.eager_forwards): nothing is traced, whatever the batch's shape.
    `share` packs the choices of one context in one row (None: where the model's attention takes a
    custom mask, mask_kind_of)."""
    mask_kind = mask_kind_of(model)
    share = mask_kind is not None if share is None else share
    if share and mask_kind is None:
        raise ValueError("sharing a context needs an attention implementation that takes a 4D mask (sdpa, eager)")
    plan = batches(encoded, micro_batch, share)
    mine = plan[rank::world]
    forwards = math.ceil(len(plan) / world)
    out = torch.zeros(len(encoded), dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with eager_forwards():
            for n in range(forwards):
                batch = mine[n] if n < len(mine) else plan[0]
                idx, sums = _forward(model, encoded, batch, device, autocast, mask_kind if share else None)
                if n < len(mine):
                    out[torch.as_tensor(idx)] = sums
    finally:
        if was_training:
            model.train()
    if world > 1:
        assert all_reduce is not None, "several ranks need all_reduce"
        out = all_reduce(out)
    return [float(v) for v in out], forwards
