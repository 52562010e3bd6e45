"""How a scoring's requests are laid out in forwards: which requests share a row (the choices of one
context: SPEC "Downstream evaluation", Shared context) and which rows go in one forward.

Owns: the row of each request (grouped by the context tokens before its first target position),
a row's width in input positions, the batches (widest first, at most `micro_batch` requests each)
and which attention implementations take the packed row's mask. Pure arithmetic over encoded
requests (no torch): runner.training.downstream.score runs the forwards, and `runner plan` counts
positions with it (runner.training.downstream.cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: `runner plan` counts positions without importing tokenizers first
    from runner.training.downstream.encode import Encoded

#: attention implementations that take a custom 4D mask with explicit positions (transformers'
#: create_causal_mask returns a 4D mask as is): a context shared by several choices is packed once
SHARING_ATTENTION = {"sdpa": "bool", "eager": "additive"}


@dataclass(frozen=True)
class Row:
    """Requests whose inputs begin with the same context tokens (their first `prefix` inputs): one
    row holds that context once, then each request's remaining inputs (SPEC "Window": a request
    attends only to its own tokens, so each suffix sees the context and itself, at the positions it
    would have alone)."""

    members: tuple[int, ...]
    prefix: int

    def width(self, encoded: Sequence[Encoded]) -> int:
        return self.prefix + sum(len(encoded[i].inputs) - self.prefix for i in self.members)


def rows(encoded: Sequence[Encoded], share: bool) -> list[Row]:
    """Each request's row: with `share`, requests of one context (the inputs before their first
    target position, and that position: `len(inputs) - len(targets) + 1` tokens) share a row."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(encoded):
        context = e.inputs[: len(e.inputs) - len(e.targets) + 1]
        groups.setdefault(context if share else (i,), []).append(i)
    return [Row(tuple(m), len(encoded[m[0]].inputs) - len(encoded[m[0]].targets) + 1) for m in groups.values()]


def batches(encoded: Sequence[Encoded], micro_batch: int, share: bool = True) -> list[list[Row]]:
    """Rows per forward: widest first (so padding stays small), at most `micro_batch` rows and at
    most `micro_batch` x the longest request's inputs in padded positions (what `micro_batch`
    requests alone would take: a row wider than any request holds several, so fewer fit)."""
    order = sorted(rows(encoded, share), key=lambda r: (-r.width(encoded), r.members[0]))
    budget = micro_batch * max((len(e.inputs) for e in encoded), default=1)
    plan: list[list[Row]] = []
    for row in order:
        if not plan or len(plan[-1]) == micro_batch or (len(plan[-1]) + 1) * plan[-1][0].width(encoded) > budget:
            plan.append([])
        plan[-1].append(row)
    return plan
