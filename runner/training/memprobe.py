"""Measured memory of one training forward, to hold the planner's estimates against.

Owns the saved-tensor probe: the bytes of the distinct storages autograd keeps for the backward
while the model runs its training forward (the loss included), found with
`torch.autograd.graph.saved_tensors_hooks`, split into activations, autocast's low-precision
copies of the weights, and the parameters themselves (model state, not activations). A storage
saved by several ops (a view, a tensor two ops both keep) is counted once, at its full size.
On a GPU it also reads the allocator's peak over the forward and backward.
Never changes the model's weights: the probe's gradients are zeroed again.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from runner.training import checkpointing


@dataclass
class SavedBytes:
    """What autograd held at the end of one forward, by kind, in bytes."""

    activations: int = 0
    weight_copies: int = 0  # autocast's bf16 casts of fp32 parameters, saved for the matmul backwards
    parameters: int = 0  # the parameters themselves (fp32 runs save them): model state, not activations
    by_dtype: dict[str, int] = field(default_factory=dict)  # activations only
    tensors: int = 0
    peak_allocated: int | None = None  # GPU only: allocator peak over forward + backward, everything included

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_VIEWS = ("TBackward", "TransposeBackward", "ViewBackward", "UnsafeViewBackward", "PermuteBackward", "ExpandBackward")


def _is_weight_copy(t: torch.Tensor) -> bool:
    """A cast of a leaf parameter, or a view of one (autocast's weight copy, saved transposed by the
    matmul): ToCopyBackward fed by an AccumulateGrad, behind at most a few view functions."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if "ToCopy" in name:
            return any(f is not None and type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions)
        if not name.startswith(_VIEWS):
            return False
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return False


def saved_bytes(model: torch.nn.Module, forward, *, backward: bool = True) -> SavedBytes:
    """Run `forward()` (it returns the loss) under saved-tensor hooks; then its backward, unless
    `backward` is False. Returns the distinct saved storages' bytes by kind."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int, str]] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and storage.nbytes() > 0:
            kind = "parameters" if ptr in params else "weight_copies" if _is_weight_copy(t) else "activations"
            seen[ptr] = (kind, storage.nbytes(), str(t.dtype).replace("torch.", ""))
        return t

    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # `selective` checkpointing keeps its matmul outputs in stores of its own, not through these
    # hooks (runner.training.checkpointing): activations too, read before the backward consumes them.
    checkpointing.SAVED.stores, checkpointing.SAVED.counting = [], True
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        selective = {ptr: n for ptr, n in checkpointing.SAVED.storages().items() if ptr not in seen}
    finally:
        checkpointing.SAVED.stores, checkpointing.SAVED.counting = [], False
    if backward:
        loss.backward()
    out = SavedBytes(tensors=len(seen) + len(selective))
    out.activations += sum(selective.values())
    for kind, nbytes, dtype in seen.values():
        setattr(out, kind, getattr(out, kind) + nbytes)
        if kind == "activations":
            out.by_dtype[dtype] = out.by_dtype.get(dtype, 0) + nbytes
    if cuda:
        torch.cuda.synchronize()
        out.peak_allocated = int(torch.cuda.max_memory_allocated())
    for p in model.parameters():
        p.grad = None
    return out


def probe_training_forward(model, input_ids, targets, mask, *, autocast_dtype: torch.dtype | None) -> SavedBytes:
    """The probe on the trainer's own forward (`model(input_ids, loss_targets, loss_mask)`), under
    the autocast the trainer uses (None: fp32, as CPU runs train)."""
    device_type = input_ids.device.type
    ctx = torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()

    def forward():
        with ctx:
            return model(input_ids=input_ids, loss_targets=targets, loss_mask=mask)

    model.train()
    return saved_bytes(model, forward)
