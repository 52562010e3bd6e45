"""Atomic, verifiable checkpoints of a run: model, optimizer, ledger and loop state.

Owns the folder layout `checkpoints/step-NNNNNNN/`, the interval policy, the atomic write
(temp folder, fsync every file, rename, `COMPLETE` marker last), pruning to the last K, and
finding the newest checkpoint that verifies. Must never unpickle anything: tensors go through
safetensors, everything else through JSON.

Format 2 (current) holds FULL, unsharded state keyed by parameter name (torch.distributed.checkpoint's
full state dict): one process, DDP and FSDP2 write the same files, and a run may resume with a
different world size or sharding. Gathering it is a collective under FSDP (every rank calls
`gather_full_state`; rank 0 receives the tensors and writes). Format 1 (model via safetensors'
save_model, optimizer keyed by parameter index) is still read for runs begun before format 2.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, load_model, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from runner.fsio import fsync_dir, fsync_file, sha256_file

MARKER = "COMPLETE"
FORMAT = 2
FILES = ("model.safetensors", "optimizer.safetensors", "ledger.safetensors", "optimizer.json")


def dirname(step: int) -> str:
    return f"step-{step:07d}"


# ---- optimizer state <-> flat tensors (no pickle) --------------------------------------------


def flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state as `state.<param>.<key>` tensors plus a JSON index (param groups, scalars).
    <param> is a parameter name (format 2) or index (format 1); <key> never holds a dot."""
    tensors, scalars = {}, {}
    for pid, entry in state_dict["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{pid}.{key}"] = value
    index = {"param_groups": state_dict["param_groups"], "scalars": scalars}
    return tensors, index


def unflatten_optimizer(tensors: dict[str, torch.Tensor], index: dict) -> dict:
    state: dict[int, dict] = {}

    def param(pid: str):
        return int(pid) if pid.isdigit() else pid

    for name, value in tensors.items():
        pid, key = name.removeprefix("state.").rsplit(".", 1)
        state.setdefault(param(pid), {})[key] = value
    for name, value in index.get("scalars", {}).items():
        pid, key = name.rsplit(".", 1)
        state.setdefault(param(pid), {})[key] = value
    return {"state": state, "param_groups": index["param_groups"]}


# ---- full (unsharded) state, whatever the wrapping -------------------------------------------


def _options(**kwargs):
    return StateDictOptions(full_state_dict=True, **kwargs)


def gather_full_state(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state, optimizer state), unsharded, on CPU, keyed by parameter name.

    `model` is the unwrapped module (plain, or FSDP2-sharded in place). A collective when the
    parameters are sharded: EVERY rank must call it; rank 0 receives the tensors, the others get
    empty dicts (cpu_offload keeps one copy in host memory, on the writer)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    options = _options(cpu_offload=distributed)
    # Full state dicts of a module and of its optimizer: tensors by parameter name, torch's nested form.
    model_state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
    optim_state = cast(dict, get_optimizer_state_dict(model, optimizer, options=options))
    if not distributed:  # one process: cpu_offload needs a process group, so copy to host here
        model_state = {k: v.detach().cpu() for k, v in model_state.items()}
    return model_state, optim_state


def _unaliased(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, tied weights stored once per name (safetensors refuses shared memory)."""
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


# ---- RNG state as JSON ------------------------------------------------------------------------


def rng_state() -> dict:
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy: the 5-tuple set_state takes back
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_internal), py_gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


# ---- save -------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict

    @property
    def format(self) -> int:
        return int(self.state.get("format", 1))

    def load_into(self, model, optimizer) -> None:
        """Weights and optimizer state into `model` (plain or FSDP2-sharded) and its optimizer.
        Every rank calls it and reads the files (run folders live on shared storage); each keeps its
        own shard. The world size and sharding need not match the writer's."""
        if self.format < 2:
            # Only checkpoints of the first format need it, and its public path moved between torch releases.
            from torch.distributed.tensor import DTensor  # noqa: PLC0415

            if any(isinstance(p, DTensor) for p in model.parameters()):
                raise ValueError(
                    "a format-1 checkpoint cannot be loaded into a sharded model; "
                    "resume it without FSDP once (it then writes format 2)"
                )
            load_model(model, str(self.path / "model.safetensors"), strict=True)
            optimizer.load_state_dict(self.optimizer_state())
            return
        weights = load_file(str(self.path / "model.safetensors"))
        set_model_state_dict(model, cast(dict, weights), options=_options(strict=True))
        set_optimizer_state_dict(model, optimizer, self.optimizer_state(), options=_options())

    def optimizer_state(self) -> dict:
        index = json.loads((self.path / "optimizer.json").read_text())
        return unflatten_optimizer(load_file(str(self.path / "optimizer.safetensors")), index)

    def ledger_state(self) -> dict[str, np.ndarray]:
        return load_numpy(str(self.path / "ledger.safetensors"))


class Checkpointer:
    """Interval policy plus atomic save/verify/prune under `<run_dir>/checkpoints`."""

    def __init__(self, run_dir: Path, interval_steps: int | None, interval_minutes: float | None, keep_last: int):
        self.root = Path(run_dir) / "checkpoints"
        self.interval_steps = int(interval_steps or 0)
        self.interval_seconds = float(interval_minutes or 0) * 60.0
        self.keep_last = max(1, int(keep_last))
        self.last_save_time = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether `step` committed steps call for a checkpoint by steps or by minutes."""
        if self.interval_steps and step % self.interval_steps == 0:
            return True
        return bool(self.interval_seconds) and time.monotonic() - self.last_save_time >= self.interval_seconds

    def save(
        self,
        step: int,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict,
        ledger_state: dict[str, np.ndarray],
        state: dict,
    ) -> Path:
        """Write one checkpoint (rank 0 only) from full state dicts (see gather_full_state)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / dirname(step)
        tmp = self.root / f".tmp-{dirname(step)}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_file(_unaliased(model_state), str(tmp / "model.safetensors"))
        tensors, index = flatten_optimizer(optimizer_state)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(index))
        save_numpy({k: np.ascontiguousarray(v) for k, v in ledger_state.items()}, str(tmp / "ledger.safetensors"))
        for name in FILES:
            fsync_file(tmp / name)
        full_state = dict(state, step=step, format=FORMAT, files={name: sha256_file(tmp / name) for name in FILES})
        (tmp / "state.json").write_text(json.dumps(full_state, indent=1, sort_keys=True))
        fsync_file(tmp / "state.json")
        fsync_dir(tmp)
        if final.exists():  # an unfinished or corrupt folder of the same step from a killed attempt
            shutil.rmtree(final)
        os.rename(tmp, final)
        (final / MARKER).write_text(full_state["files"]["model.safetensors"] + "\n")
        fsync_file(final / MARKER)
        fsync_dir(self.root)
        self.last_save_time = time.monotonic()
        self._prune(keep=final)
        return final

    def _prune(self, keep: Path) -> None:
        """After a successful save: drop leftovers (folders without the marker, temp folders) and
        all but the newest `keep_last` complete checkpoints. A resume that fell back past a broken
        folder never looks at it again, so without this it would sit in checkpoints/ forever."""
        self.clean_temporaries()
        complete = []
        for p in self.root.glob("step-*"):
            if (p / MARKER).exists():
                complete.append(p)
            elif p != keep:
                shutil.rmtree(p, ignore_errors=True)
        for old in sorted(complete)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- load ---------------------------------------------------------------------------------

    def candidates(self) -> list[Path]:
        """Checkpoint folders, newest first (by step number in the name)."""
        if not self.root.exists():
            return []
        found = []
        for p in self.root.glob("step-*"):
            try:
                found.append((int(p.name.split("-", 1)[1]), p))
            except ValueError:
                continue
        return [p for _, p in sorted(found, reverse=True)]

    def latest_valid(self, report=print) -> Checkpoint | None:
        """The newest checkpoint that verifies; each rejected one is reported on one line."""
        for path in self.candidates():
            problem = verify(path)
            if problem is None:
                state = json.loads((path / "state.json").read_text())
                return Checkpoint(path=path, step=int(state["step"]), state=state)
            report(f"checkpoint {path.name} unusable ({problem}); trying the previous one")
        return None

    def clean_temporaries(self) -> None:
        for tmp in self.root.glob(".tmp-*") if self.root.exists() else []:
            shutil.rmtree(tmp, ignore_errors=True)


def verify(path: Path) -> str | None:
    """None when the checkpoint is complete and every file matches its recorded sha256."""
    if not (path / MARKER).exists():
        return f"no {MARKER} marker"
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        return f"state.json unreadable: {e}"
    for name, digest in state.get("files", {}).items():
        if not (path / name).exists():
            return f"{name} missing"
        if sha256_file(path / name) != digest:
            return f"{name} sha256 mismatch"
    if set(state.get("files", {})) != set(FILES):
        return "state.json lists the wrong files"
    return None
