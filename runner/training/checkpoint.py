"""Atomic, verifiable checkpoints of a run: model, optimizer, ledger and loop state.

Owns the folder layout `checkpoints/step-NNNNNNN/`, the interval policy, the atomic write
(temp folder, fsync every file, rename, `COMPLETE` marker last), pruning, and finding the newest
checkpoint that verifies. Must never unpickle anything: tensors go through safetensors, everything
else through JSON; and must never prune a run into lost work: only checkpoints that verify count
toward `keep_last`, and none is deleted before a newer one verifies.

Format 3 (current): FULL, unsharded state keyed by parameter name (torch.distributed.checkpoint's
full state dict): one process, DDP and FSDP2 write the same files, and a run may resume with a
different world size or sharding. Gathering it is a collective under FSDP (every rank calls
`gather_full_state`; rank 0 receives the tensors and writes). `state.json` lists the sha256 of every
other file, and `COMPLETE`, written last, holds the sha256 of `state.json`: an edit anywhere,
state.json included, fails verification. A matrix shared by several names (tied embeddings) is
stored once, under its first name; `state.json` `tied` maps the others to it and loading restores
the tie.
The loop hands a checkpoint off at a step boundary and goes on: `host_copy` makes the gathered state
host memory of its own, and `BackgroundWriter` writes and hashes it in a thread while training
continues (`train.checkpoint.write: background`; `foreground` writes in the loop). One write is in
flight at a time: the next checkpoint, the attempt's end and a stop wait for it. A write killed
midway leaves a `.tmp-*` folder or a folder without `COMPLETE`: neither verifies, so a resume takes
the newest checkpoint that does.
Once a checkpoint is sealed, the writer records the files it hashed while writing them in the
cache runner.runs.checkpoints.CACHE_FILE names (runner.hashcache's trust rule), so this machine's
resume verifies them without reading them again; a file changed since (a write changes its ctime)
is hashed again, and one that differs from state.json is refused as before.
Format 2 (same files; COMPLETE held the model's sha256, state.json was not sealed, tied matrices
stored under each name) and format 1 (model via safetensors' save_model, optimizer keyed by
parameter index) are still read for runs begun before.
"""

from __future__ import annotations

import base64
import errno
import functools
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from safetensors import SafetensorError
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

from runner.config.schema import CheckpointSection
from runner.errors import RunnerError
from runner.fsio import fsync_dir, fsync_file, sha256_file
from runner.hashcache import HashCache, identity
from runner.runs.checkpoints import CACHE_FILE, FILES, FORMAT, MARKER, CheckpointState, dirname, step_of, verify
from runner.training.staging import copy_state, hashable_layout, save_safetensors_hashed, storage_key

#: train.checkpoint.write: where a checkpoint's files are written (the schema's Literal lists the same)
WRITE_MODES = ("background", "foreground")


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


def gather_full_state(model, optimizer, to_host: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """(model state, optimizer state), unsharded, on CPU, keyed by parameter name.

    `model` is the unwrapped module (plain, or FSDP2-sharded in place). A collective when the
    parameters are sharded: EVERY rank must call it; rank 0 receives the tensors, the others get
    empty dicts (cpu_offload keeps one copy in host memory, on the writer). `to_host=False` on a model
    that is not sharded: the training tensors themselves, where they are (each rank its own; the
    caller copies them: runner.training.staging.PinnedStaging)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    in_place = not to_host and not _sharded(model)
    options = _options(cpu_offload=distributed and not in_place)
    # Full state dicts of a module and of its optimizer: tensors by parameter name, torch's nested form.
    model_state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
    optim_state = cast(dict, get_optimizer_state_dict(model, optimizer, options=options))
    if not distributed and not in_place:  # one process: cpu_offload needs a process group, so copy to host here
        model_state = {k: v.detach().cpu() for k, v in model_state.items()}
    return model_state, optim_state


def _sharded(model) -> bool:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return any(isinstance(p, DTensor) for p in model.parameters())


def tied_parameters(model) -> dict[str, str]:
    """{alias: name} for every parameter reachable under more than one name (tied embeddings:
    `lm_head.weight` -> `model.embed_tokens.weight`), the first name in module order being the one
    stored. Found by identity of the parameter objects, so it holds for sharded models too."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _store_once(tensors: dict[str, torch.Tensor], tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors with each tied alias left out (its matrix is stored under the name it
    is tied to). Any other tensors sharing memory are copied: safetensors refuses shared memory."""
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if tied.get(name) in tensors:
            continue
        t = t.detach().contiguous().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def training_tensors(model, optimizer) -> list[torch.Tensor]:
    """The tensors training goes on changing: parameters, buffers and the optimizer's state."""
    state = [v for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v)]
    return [*model.parameters(), *model.buffers(), *state]


def host_copy(model_state: dict, optimizer_state: dict, live: Iterable[torch.Tensor]) -> tuple[dict, dict]:
    """The gathered state as host memory of its own, so training may go on while it is written.

    A tensor on a device is copied to the host; one on the host that is still training's own memory
    (`live`: one process on a CPU gets the parameters and AdamW's moments themselves from the gather)
    is cloned; one the gather already copied (cpu_offload) is kept as it is. A matrix under several
    names (tied embeddings) is copied once. The structure around the tensors (param groups, scalars)
    is copied too: the loop sets the learning rate every step. Rank 0 thus holds one checkpoint in
    host memory (runner.planning.resources.host_gather_bytes counts it)."""
    return copy_state(model_state, optimizer_state, live, lambda t: t.to("cpu"))


def state_bytes(*states) -> int:
    """Bytes of the tensors in (nested) state dicts, each storage once."""
    seen: dict[tuple, int] = {}

    def walk(x):
        if torch.is_tensor(x):
            seen[(storage_key(x), x.storage_offset())] = x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for s in states:
        walk(s)
    return sum(seen.values())


class BackgroundWriter:
    """At most one checkpoint write in flight. `submit` first waits for the previous write (raising its
    error in the caller), then runs the new one in a thread of its own (`background`: the caller goes
    on training) or in the caller (`foreground`). `wait` is what the next checkpoint, the attempt's end
    and a stop call: the write done, its error raised where the loop fails the run with it."""

    def __init__(self, mode: str = "background"):
        if mode not in WRITE_MODES:
            raise RunnerError(f"must be one of {', '.join(WRITE_MODES)}, got {mode!r}", key="train.checkpoint.write")
        self.mode = mode
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()
        if self.mode == "foreground":
            write()
            return
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-write")
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # handed to the loop's thread by wait()
            self._error = e

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Seconds spent waiting for the write in flight (0 when none); its error, raised here."""
        thread, self._thread = self._thread, None
        if thread is None:
            return 0.0
        t0 = time.perf_counter()
        thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - t0


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
    state: dict  #: state.json as read; `record` is it typed

    @functools.cached_property
    def record(self) -> CheckpointState:
        return CheckpointState.from_dict(self.state)

    @property
    def format(self) -> int:
        return int(self.record.format)

    def model_state(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The model's full state dict keyed by parameter name, tied aliases restored (format >= 2),
        read straight into `device`'s memory (a GPU's: no host copy to move again)."""
        tensors = load_file(str(self.path / "model.safetensors"), device=device)
        for alias, name in self.record.tied.items():
            if alias not in tensors and name in tensors:
                tensors[alias] = tensors[name]
        return tensors

    def load_into(self, model, optimizer, device: str = "cpu") -> None:
        """Weights and optimizer state into `model` (plain or FSDP2-sharded) and its optimizer.
        Every rank calls it and reads the files (run folders live on shared storage); each keeps its
        own shard. The world size and sharding need not match the writer's. `device`: where the
        files are read to (the model's accelerator: one copy from the file, none from the host)."""
        if self.format < 2:
            # Only checkpoints of the first format need it, and its public path moved between torch releases.
            from torch.distributed.tensor import DTensor  # noqa: PLC0415

            if any(isinstance(p, DTensor) for p in model.parameters()):
                raise ValueError(
                    "a format-1 checkpoint cannot be loaded into a sharded model; "
                    "resume it without FSDP once (it then writes format 3)"
                )
            load_model(model, str(self.path / "model.safetensors"), strict=True)
            optimizer.load_state_dict(self.optimizer_state())
            return
        set_model_state_dict(model, cast(dict, self.model_state(device)), options=_options(strict=True))
        set_optimizer_state_dict(model, optimizer, self.optimizer_state(device), options=_options())

    def optimizer_state(self, device: str = "cpu") -> dict:
        index = json.loads((self.path / "optimizer.json").read_text())
        tensors = load_file(str(self.path / "optimizer.safetensors"), device=device)
        # a 0-dim entry (AdamW's step) stays on the host, where torch's non-fused AdamW keeps it
        tensors = {k: v.cpu() if v.dim() == 0 else v for k, v in tensors.items()}
        return unflatten_optimizer(tensors, index)

    def ledger_state(self) -> dict[str, np.ndarray]:
        return load_numpy(str(self.path / "ledger.safetensors"))


def _save_hashed(tensors: dict[str, torch.Tensor], path: Path) -> str | None:
    """Write `tensors` to `path` (safetensors, fsynced) and return its sha256 when hashed while
    written; None when written by safetensors itself (a dtype the one-pass writer does not know)."""
    digest = save_safetensors_hashed(tensors, path, fsync=False) if hashable_layout(tensors) else None
    if digest is None:
        save_file(tensors, str(path))
    fsync_file(path)
    return digest


class Checkpointer:
    """Interval policy plus atomic save/verify/prune under `<run_dir>/checkpoints`.

    Remembers, for the life of the process, which folders it verified (keyed by their files'
    identities, runner.hashcache.identity), so pruning after every save hashes each old checkpoint at
    most once; and, across processes, the files its saves hashed while writing (`known`, the
    machine's cache), so a resume does not hash them again."""

    def __init__(
        self,
        run_dir: Path,
        interval_steps: int | None,
        interval_minutes: float | None,
        keep_last: int,
        report: Callable[[str], None] | None = None,
        write: str = "background",
    ):
        if keep_last < 1:
            raise RunnerError(f"must be >= 1, got {keep_last}", key="train.checkpoint.keep_last")
        self.root = Path(run_dir) / "checkpoints"
        self.interval_steps = interval_steps or 0
        self.interval_seconds = (interval_minutes or 0) * 60.0
        self.keep_last = keep_last
        self.report = report or (lambda message: None)
        self.last_save_time = time.monotonic()
        self._checked: dict[str, tuple[tuple, str | None]] = {}  # folder name -> (file signature, problem)
        self._checked_lock = threading.Lock()  # the writer's pruning and the loop's fallbacks both verify
        self.writes = BackgroundWriter(write)  #: the loop's hand-off of each checkpoint (train.checkpoint.write)
        self.known = HashCache(CACHE_FILE)  #: the files this machine's writers hashed (runner.hashcache)

    @classmethod
    def for_run(
        cls, run_dir: Path, section: CheckpointSection, report: Callable[[str], None] | None = None
    ) -> Checkpointer:
        """The checkpointer of a run, its interval policy and retention from `train.checkpoint`."""
        return cls(run_dir, section.interval_steps, section.interval_minutes, section.keep_last, report, section.write)

    @classmethod
    def reader(cls, run_dir: Path) -> Checkpointer:
        """A checkpointer that only finds and verifies a run's checkpoints (it never saves)."""
        return cls(run_dir, 0, 0, 1)

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
        tied: dict[str, str] | None = None,
    ) -> Path:
        """Write one checkpoint (rank 0 only) from full state dicts (see gather_full_state); `tied`
        (see tied_parameters) names the aliases stored once. A write that fails (a full disk) leaves
        the previous checkpoints as they were and raises a RunnerError."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / dirname(step)
        tmp = self.root / f".tmp-{dirname(step)}-{os.getpid()}"
        try:
            written = self._write(tmp, model_state, optimizer_state, ledger_state, dict(state, step=step), tied)
            if final.exists():  # an unfinished or corrupt folder of the same step from a killed attempt
                shutil.rmtree(final)
            os.rename(tmp, final)
            seal = json.dumps({"format": FORMAT, "state.json": sha256_file(final / "state.json")})
            (final / MARKER).write_text(seal + "\n")
            fsync_file(final / MARKER)
            fsync_dir(self.root)
        except (OSError, SafetensorError) as e:  # safetensors reports its I/O errors as SafetensorError
            shutil.rmtree(tmp, ignore_errors=True)
            if final.exists() and not (final / MARKER).exists():
                shutil.rmtree(final, ignore_errors=True)
            reason, code = _io_error(e)
            raise RunnerError(
                f"cannot write checkpoint {final.name}: {reason}"
                + ("; free some space" if code in (errno.ENOSPC, errno.EDQUOT) else "")
                + "; the previous checkpoints are untouched and the run resumes from the newest of them",
                file=str(self.root),
            ) from None
        with self._checked_lock:
            self._checked[final.name] = (_signature(final), None)  # its files were hashed as they were written
        # sealed: the files as they are now are the ones hashed (a later write changes their ctime)
        self.known.remember(
            {final / name: (digest, (final / name).stat()) for name, digest in written["files"].items()}
        )
        self.last_save_time = time.monotonic()
        self._prune(keep=final)
        return final

    def _write(self, tmp: Path, model_state, optimizer_state, ledger_state, state: dict, tied) -> dict:
        """Every file of a checkpoint into `tmp`, fsynced; returns the state.json written."""
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        tied = {a: n for a, n in (tied or {}).items() if a in model_state and n in model_state}
        tensors, index = flatten_optimizer(optimizer_state)
        # the large files written and hashed in one pass (runner.training.staging), never read back
        digests = {
            name: _save_hashed(part, tmp / name)
            for name, part in (
                ("model.safetensors", _store_once(model_state, tied)),
                ("optimizer.safetensors", tensors),
            )
        }
        (tmp / "optimizer.json").write_text(json.dumps(index))
        save_numpy({k: np.ascontiguousarray(v) for k, v in ledger_state.items()}, str(tmp / "ledger.safetensors"))
        for name in FILES:
            if name not in digests:
                fsync_file(tmp / name)
        files = {name: digests.get(name) or sha256_file(tmp / name) for name in FILES}
        full_state = dict(state, format=FORMAT, tied=tied, files=files)
        (tmp / "state.json").write_text(json.dumps(full_state, indent=1, sort_keys=True))
        fsync_file(tmp / "state.json")
        fsync_dir(tmp)
        return full_state

    def check(self, path: Path) -> str | None:
        """verify(path) with what this machine's writers hashed (`known`), remembered while the
        folder's files keep their identities."""
        signature = _signature(path)
        with self._checked_lock:
            known = self._checked.get(path.name)
        if known is not None and known[0] == signature:
            return known[1]
        problem = verify(path, self.known)
        with self._checked_lock:
            self._checked[path.name] = (signature, problem)
        return problem

    def _prune(self, keep: Path) -> None:
        """After a successful save of `keep`: drop temporaries, and every checkpoint at or below its
        step except the newest `keep_last` that VERIFY. A damaged or unfinished folder counts for
        nothing (a resume falls back past it), so it never pushes a good one out; and since `keep`
        itself verifies, the checkpoint a run resumed from goes only once a newer one verified.
        Folders above `keep`'s step are left alone: this run has not yet written their replacement."""
        self.clean_temporaries()
        kept = 0
        keep_step = step_of(keep)
        for path in self.candidates():
            if step_of(path) > keep_step:
                continue
            if kept < self.keep_last:
                problem = self.check(path)
                if problem is None:
                    kept += 1
                    continue
                if (path / MARKER).exists():
                    self.report(f"checkpoint {path.name} removed: it does not verify ({problem})")
            shutil.rmtree(path, ignore_errors=True)

    # ---- load ---------------------------------------------------------------------------------

    def candidates(self) -> list[Path]:
        """Checkpoint folders, newest first (by step number in the name)."""
        if not self.root.exists():
            return []
        found = [(step_of(p), p) for p in self.root.glob("step-*")]
        return [p for step, p in sorted(found, reverse=True) if step >= 0]

    def latest_valid(self, report=print) -> Checkpoint | None:
        """The newest checkpoint that verifies; each rejected one is reported on one line, and a folder
        whose checkpoints all fail says so loudly: the run then starts again from step 0."""
        rejected = []
        for path in self.candidates():
            problem = self.check(path)
            if problem is None:
                state = json.loads((path / "state.json").read_text())
                return Checkpoint(path=path, step=state["step"], state=state)
            rejected.append(path.name)
            report(f"checkpoint {path.name} unusable ({problem}); trying the previous one")
        if rejected:
            report(
                f"WARNING: none of the {len(rejected)} checkpoints in {self.root} verifies "
                f"({', '.join(rejected)}): this run starts again from step 0; the work they held is lost"
            )
        return None

    def clean_temporaries(self) -> None:
        for tmp in self.root.glob(".tmp-*") if self.root.exists() else []:
            shutil.rmtree(tmp, ignore_errors=True)


def _io_error(e: Exception) -> tuple[str, int | None]:
    """(what went wrong, errno) of an OSError, or of a SafetensorError wrapping one:
    'Error while serializing: I/O error: No space left on device (os error 28)'."""
    if isinstance(e, OSError):
        return e.strerror or str(e), e.errno
    text = str(e).split("I/O error: ", 1)[-1]
    found = re.search(r"\(os error (\d+)\)", text)
    return re.sub(r"\s*\(os error \d+\)", "", text), int(found.group(1)) if found else None


def _signature(path: Path) -> tuple:
    """The identities of a checkpoint folder's files (runner.hashcache.identity): a verification
    remembered in this process holds while they hold."""
    out: list[tuple[str, list[int] | None]] = []
    for name in (*FILES, "state.json", MARKER):
        try:
            out.append((name, identity((path / name).stat())))
        except OSError:
            out.append((name, None))
    return tuple(out)
