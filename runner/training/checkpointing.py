"""Activation checkpointing modes: which activations a decoder layer keeps for its backward.

Owns the op-level policy of `model.activation_checkpointing: selective` (as torchtitan's `op`
selective activation checkpointing): inside each checkpointed decoder layer the outputs of the
matmuls (every projection, the experts' grouped matmuls) and of attention are saved, everything
else (norms, RoPE, SiLU x up, the router's softmax and top-k, the MoE permutation, residual adds)
is recomputed in the backward. `full` recomputes the whole layer from its input; `none` keeps all.
Also counts, for the saved-tensor probe (runner.training.memprobe), the bytes the policy saved: the
distinct storages its forward contexts hold once the forward is done (the same on every torch: only
torch >= 2.13 hands the policy each op's output, and the device image's 2.11 does not).
Never: changes what a forward computes (the recomputation replays the same ops on the same inputs).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _ops(*names: str) -> set[Any]:
    """The default overloads of the aten ops named that this torch build has."""
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found.add(packet.default)
    return found


#: ops whose outputs `selective` saves: matmuls (a Linear without bias is mm; addmm with one),
#: grouped matmuls, and every SDPA kernel's forward (its output and logsumexp)
SAVED_OPS = _ops(
    "mm",
    "addmm",
    "bmm",
    "_grouped_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _runner_grouped_mm() -> set[Any]:
    """The runner's grouped matmul for dtypes torch's traced grouped_mm refuses (runner.training.moe.layer)."""
    import runner.training.moe.layer  # noqa: F401, PLC0415  (registers torch.ops.runner.grouped_mm)

    return {torch.ops.runner.grouped_mm.default}


class SavedBytes:
    """The stores of the checkpointed forwards run while counting (not recomputations): each
    holds the op outputs `selective` saved for its layer's backward."""

    def __init__(self) -> None:
        self.counting = False
        self.stores: list[dict[Any, list[Any]]] = []

    def storages(self) -> dict[int, int]:
        """The stores' distinct tensor storages (data pointer -> bytes), read before the backward
        consumes them."""
        found: dict[int, int] = {}
        for store in self.stores:
            for leaf in tree_leaves(list(store.values())):
                t = getattr(leaf, "val", leaf)  # torch's _VersionWrapper around each saved output
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                    found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return found


SAVED = SavedBytes()


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in SAVED_OPS or op in _RUNNER_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_RUNNER_OPS = _runner_grouped_mm()


def selective_context():
    """`context_fn` for torch.utils.checkpoint: the `selective` policy's two contexts (called once per
    checkpointed forward; the forward's context keeps what it saved in its `storage`)."""
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    if SAVED.counting:
        SAVED.stores.append(forward.storage)
    return forward, recompute


def checkpoint_kwargs(mode: str) -> dict[str, Any]:
    """torch.utils.checkpoint's keyword arguments for a full or selective mode (non-reentrant)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(selective_context)
    elif mode != "full":
        raise ValueError(f"no checkpointing in mode {mode!r}")
    return kwargs
