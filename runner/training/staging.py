"""A checkpoint's copy to host memory without stopping the loop, and its files written and hashed in
one pass.

Owns:
- `PinnedStaging`: page-locked host buffers, allocated once per run (in a background thread from
  the parameters' shapes at the attempt's start, or on first need) and reused by every checkpoint;
  the device-to-host copies enqueued on a side stream after the step's kernels, the loop going on at
  once; the next optimizer step ordered after the copies on the device (`before_optimizer_step`: a
  stream wait, no host sync), and the writer waiting for them (`Staged.ready`) before it reads the
  buffers. A staging for the CPU device runs the same bookkeeping with plain buffers and synchronous
  copies of the host tensors (what the CPU tests exercise; the loop keeps `checkpoint.host_copy` there).
  Measured on an H200 (bench/measurements/h200-20261204-session2/pinned.json): 15.6 GB to pageable
  memory 9.80 s; pinned allocation for 15.6 GB 7.6-8.0 s (hence once per run, off the loop);
  device to pinned, non_blocking on a side stream, enqueued in 1.5 ms, done in 0.282 s (55 GB/s).
- `checkpoint_copy`: whether rank 0 stages at all, and why (run.json `runtime.checkpoint_copy` and
  `checkpoint_copy_note`): on a GPU without FSDP, pinned buffers only when the whole state's (12 B/param)
  fit under runner.planning.resources.PINNED_HOST_FRACTION of the host's available memory at the
  attempt's start; else, and elsewhere, the pageable copy (runner.training.checkpoint.host_copy).
- `save_safetensors_hashed`: a safetensors file byte-identical to `safetensors.torch.save_file`'s,
  written and sha256-hashed chunk by chunk (the hash of one chunk beside the write of the next), so
  no file is read back to hash it.
Never: decides when a checkpoint is due, or what it holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from runner.planning.resources import pinned_fit

# ---- the copy to host memory ------------------------------------------------------------------


@dataclass
class Staged:
    model_state: dict
    optimizer_state: dict
    ready: Callable[[], None]  #: blocks until every copy into the buffers is done (the writer calls it)
    allocated_bytes: int  #: bytes of buffers this checkpoint had to allocate (0 once the pool holds them)


def storage_key(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard: its own memory
    return local.untyped_storage().data_ptr()


def copy_state(
    model_state: dict,
    optimizer_state: dict,
    live: Iterable[torch.Tensor],
    to_host: Callable[[torch.Tensor], torch.Tensor],
    copy_host: bool = False,
) -> tuple[dict, dict]:
    """The gathered state with each tensor that training may still change copied by `to_host`: a
    tensor on a device (and, with `copy_host`, one on the host too); a host tensor that is training's
    own memory (`live`) cloned; one the gather already copied kept. A storage under several names
    (tied embeddings) is copied once; the structure around the tensors (param groups, scalars) is
    copied too (the loop sets the learning rate every step)."""
    own = {storage_key(t) for t in live if t.device.type == "cpu"}
    copies: dict[tuple, torch.Tensor] = {}

    def copy(x):
        if torch.is_tensor(x):
            key = (str(x.device), storage_key(x), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)
            if key not in copies:
                t = x.detach()
                if t.device.type != "cpu" or copy_host:
                    copies[key] = to_host(t)
                elif key[1] in own:
                    copies[key] = t.clone()
                else:
                    copies[key] = t
            return copies[key]
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x  # numbers, strings, None: immutable

    return copy(model_state), copy(optimizer_state)


def host_available_bytes() -> int | None:
    """What the host can give without swapping (Linux's MemAvailable, through psutil); None unknown."""
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        return None


def staging_bytes(params: Iterable[torch.Tensor], copies_each: int = 3) -> int:
    """Bytes of the buffers `PinnedStaging.prefill` allocates: `copies_each` per parameter (itself and
    AdamW's two moments): 12 B per fp32 parameter, the checkpoint's size."""
    return copies_each * sum(p.numel() * p.element_size() for p in params)


@dataclass(frozen=True)
class CheckpointCopy:
    """How rank 0 copies a checkpoint to host memory, and why; `refused`: pinned buffers were the
    path but the host's memory could not spare them (the line is said at the start)."""

    pinned: bool
    note: str
    refused: bool = False

    def record(self) -> dict[str, str]:
        """run.json `runtime`'s entries, beside `checkpoint_write`."""
        return {"checkpoint_copy": "pinned" if self.pinned else "pageable", "checkpoint_copy_note": self.note}


def checkpoint_copy(
    device: torch.device, distributed: str, params: Iterable[torch.Tensor], available_bytes: int | None
) -> CheckpointCopy:
    """Pinned staging on a GPU without FSDP whose state fits the host's available memory (runner.
    planning.resources.pinned_fit); the pageable copy otherwise. Touches no device: the GPU's decision
    is made, and tested, on a CPU."""
    if torch.device(device).type != "cuda":
        return CheckpointCopy(False, "pageable: the device is the host (host_copy clones what training holds)")
    if distributed == "fsdp":
        return CheckpointCopy(False, "pageable: FSDP's gather copies the shards to host memory itself")
    fit = pinned_fit(staging_bytes(params), available_bytes)
    return CheckpointCopy(fit.pinned, fit.note, refused=not fit.pinned)


class PinnedStaging:
    """Reusable host buffers for a checkpoint's tensors (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> free buffers
        self.in_use: list[tuple[tuple, torch.Tensor]] = []  # lent to the checkpoint being written
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pending: Any = None  # the last copies' event, until the next optimizer step waits for it
        self.allocated_bytes = 0
        self._lock = threading.Lock()
        self._prefill: threading.Thread | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> PinnedStaging | None:
        """Staging where the device is an accelerator torch copies from asynchronously; else None."""
        return cls(device) if torch.device(device).type == "cuda" else None

    @classmethod
    def for_checkpoints(
        cls, acc, distributed: str, model: torch.nn.Module, available: Callable[[], int | None] = host_available_bytes
    ) -> tuple[PinnedStaging | None, CheckpointCopy]:
        """Rank 0's pinned checkpoint buffers, filled in a background thread from the parameters'
        shapes, where `checkpoint_copy` chooses them (`available`: the host's available memory now);
        with the choice (rank 0's is recorded and said; the other ranks never stage)."""
        params = list(model.parameters())
        gpu = torch.device(acc.device).type == "cuda" and distributed != "fsdp"
        copy = checkpoint_copy(acc.device, distributed, params, available() if gpu else None)
        if not acc.is_main_process or not copy.pinned:
            return None, copy
        staging = cls(acc.device)
        staging.prefill(params)  # each parameter, and AdamW's two moments of it
        return staging, copy

    def _new(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, pin_memory=self.cuda)
        self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def prefill(self, tensors: Iterable[torch.Tensor], copies_each: int = 3) -> threading.Thread:
        """Allocate, in a background thread, `copies_each` buffers per tensor (a parameter: itself and
        AdamW's two moments), so the first checkpoint finds them; one allocation per tensor, so the
        thread holds the interpreter briefly each time."""
        shapes = [(tuple(t.shape), t.dtype) for t in tensors]

        def fill() -> None:
            for key in shapes:
                for _ in range(copies_each):
                    buf = self._new(*key)
                    with self._lock:
                        self.pool.setdefault(key, []).append(buf)

        self._prefill = threading.Thread(target=fill, name="runner-pinned-prefill", daemon=True)
        self._prefill.start()
        return self._prefill

    def _take(self, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        key = (shape, dtype)
        with self._lock:
            free = self.pool.get(key)
            buf = free.pop() if free else None
        fresh = 0
        if buf is None:
            buf = self._new(shape, dtype)
            fresh = buf.numel() * buf.element_size()
        self.in_use.append((key, buf))
        return buf, fresh

    def release(self) -> None:
        """The checkpoint's files are written: its buffers go back to the pool for the next one."""
        with self._lock:
            for key, buf in reversed(self.in_use):  # the stack as it was: each name gets its buffer again
                self.pool.setdefault(key, []).append(buf)
            self.in_use = []

    def stage(self, model_state: dict, optimizer_state: dict, live: Iterable[torch.Tensor] = ()) -> Staged:
        """The state's device tensors copied into host buffers (enqueued: `ready` waits for them);
        a host tensor that is training's own memory (`live`) cloned, any other host tensor kept (the
        gather's own copy). A storage under several names is copied once."""
        self.release()  # the previous checkpoint's write is done (the loop waited for it)
        fresh = 0
        main = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.stream is not None and main is not None:
            self.stream.wait_stream(main)  # the copies read the step's finished values

        def into_buffer(t: torch.Tensor) -> torch.Tensor:
            nonlocal fresh
            buf, n = self._take(tuple(t.shape), t.dtype)
            fresh += n
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    buf.copy_(t, non_blocking=True)
            else:
                buf.copy_(t)
            return buf

        # a CPU staging copies host tensors too (what the CPU tests exercise)
        model_h, optim_h = copy_state(
            model_state, optimizer_state, live, into_buffer, copy_host=self.device.type == "cpu"
        )
        if self.stream is not None:
            event = self.stream.record_event()
            self.pending = event
            ready: Callable[[], None] = event.synchronize
        else:
            ready = lambda: None  # noqa: E731  (the copies were synchronous)
        return Staged(model_h, optim_h, ready, fresh)

    def before_optimizer_step(self) -> None:
        """The next optimizer step (which changes the parameters and moments in place) waits on the
        device for the last checkpoint's copies; the host does not wait."""
        if self.pending is not None and self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.pending)
        self.pending = None


# ---- one pass over the bytes: write and hash --------------------------------------------------

#: safetensors' dtype names, in its serializer's order (it writes the data by dtype, last first, then name)
_DTYPE_ORDER = (
    (torch.bool, "BOOL"),
    (torch.uint8, "U8"),
    (torch.int8, "I8"),
    (torch.int16, "I16"),
    (torch.uint16, "U16"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.int32, "I32"),
    (torch.uint32, "U32"),
    (torch.float32, "F32"),
    (torch.float64, "F64"),
    (torch.int64, "I64"),
    (torch.uint64, "U64"),
)
_DTYPES = {dtype: (name, rank) for rank, (dtype, name) in enumerate(_DTYPE_ORDER)}
CHUNK_BYTES = 64 * 2**20


def hashable_layout(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `save_safetensors_hashed` writes these (every dtype known, every tensor on the host)."""
    return all(t.dtype in _DTYPES and t.device.type == "cpu" for t in tensors.values())


def _header(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[str]]:
    """safetensors' header (JSON padded with spaces to 8 bytes) and the tensors' order in the data:
    by dtype, descending in its enum's order, then by name (safetensors' `prepare`)."""
    order = sorted(tensors, key=lambda n: (-_DTYPES[tensors[n].dtype][1], n))
    meta, offset = {}, 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        meta[name] = {"dtype": _DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def save_safetensors_hashed(tensors: dict[str, torch.Tensor], path: Path, fsync: bool = True) -> str:
    """Write `tensors` as safetensors' save_file would (fsynced unless `fsync` is False: the caller
    does it), and return the file's sha256, each chunk hashed while it is written (hashlib and file
    writes release the GIL)."""
    head, order = _header(tensors)
    digest = hashlib.sha256()
    digest.update(head)
    with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="runner-sha256") as pool:
        f.write(head)
        pending = None
        for name in order:
            t = tensors[name].detach()
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
            view = memoryview(data).cast("B") if t.numel() else memoryview(b"")  # type: ignore[arg-type]
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start : start + CHUNK_BYTES]
                if pending is not None:
                    pending.result()  # sha256 is sequential: the previous chunk's update first
                pending = pool.submit(digest.update, chunk)  # hashed while this chunk is written
                f.write(chunk)
        if pending is not None:
            pending.result()
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()
