"""A run's checkpoints as a reader sees them, without torch: the folder names (`dirname`, `step_of`),
the seal (`MARKER`, written last), state.json typed (`CheckpointState`: the one reader, older formats'
defaults included), verification (`verify`: the seal, every file against the sha256 state.json lists,
the step) and a verified checkpoint's state (`verified_state`), for the loop's resume, the audit, the
export and `runner eval` alike. A resume passes `verify` the cache its writer filled
(`CACHE_FILE`, runner.hashcache's rule: a file whose path, size, mtime, ctime, inode and device are
those it had when the writer hashed it while writing is not read again); `verified_state` (the
audit, the export, `runner eval`) hashes every file. Writing a checkpoint and loading its tensors is
runner.training.checkpoint's (the format is described there). Never imports torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from runner.fsio import read_json, sha256_file
from runner.hashcache import HashCache

MARKER = "COMPLETE"
#: the cache (runner.hashcache) in which the checkpoint writer records the files it hashed while writing
CACHE_FILE = "verified-checkpoints.json"
FORMAT = 3
FILES = ("model.safetensors", "optimizer.safetensors", "ledger.safetensors", "optimizer.json")
#: the run clock's part of state.json, flat (runner.training.clock.RunClock.state_dict)
CLOCK_KEYS = ("step_seconds_total", "device_step_seconds_total", "world_size")


def dirname(step: int) -> str:
    return f"step-{step:07d}"


def step_of(path: Path) -> int:
    """The step in a `step-NNNNNNN` folder name; -1 for any other name."""
    number = path.name.removeprefix("step-")
    return int(number) if number.isdigit() and path.name.startswith("step-") else -1


@dataclass(frozen=True)
class CheckpointState:
    """A checkpoint's state.json, typed: the one reader, holding the older formats' defaults (format 1
    had no `format`, `tied` or fingerprint). What the loop stores (runner.training.records
    .checkpoint_state) and the run clock's totals (runner.training.clock.RunClock.state_dict) stay flat in the file."""

    step: int
    format: int = 1
    files: dict = field(default_factory=dict)  #: file name -> sha256
    tied: dict = field(default_factory=dict)  #: alias -> the parameter stored once (format >= 2)
    fingerprint: str | None = None
    config: dict | None = None  #: the resolved experiment that wrote it
    rng: dict | None = None
    sampler_step: int | None = None
    segment: int | None = None
    attempt: int | None = None
    scheduler: dict | None = None
    mlflow_run_id: str | None = None
    clock: dict = field(default_factory=dict)  #: step_seconds_total, device_step_seconds_total, world_size

    @classmethod
    def from_dict(cls, state: dict) -> CheckpointState:
        names = {f.name for f in dataclasses.fields(cls)} - {"clock"}
        values = {k: v for k, v in state.items() if k in names and v is not None}
        return cls(**values, clock={k: state[k] for k in CLOCK_KEYS if k in state})


def sealed_state_sha256(path: Path) -> str | None:
    """The state.json sha256 a format-3 COMPLETE marker seals; None for an older marker."""
    try:
        seal = json.loads((path / MARKER).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return seal.get("state.json") if isinstance(seal, dict) else None


def verify(path: Path, known: HashCache | None = None) -> str | None:
    """None when the checkpoint is complete, its state.json is the one COMPLETE seals (format 3),
    every file matches the sha256 state.json records, and state.json is the state of this step.
    A file `known` vouches for with the very sha256 state.json lists (the writer's cache, the file
    unchanged since) is not hashed again; state.json always is, against the seal (a few kB)."""
    if not (path / MARKER).exists():
        return f"no {MARKER} marker"
    sealed = sealed_state_sha256(path)
    try:
        if sealed is not None and sha256_file(path / "state.json") != sealed:
            return "state.json sha256 mismatch (edited after it was written)"
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        return f"state.json unreadable: {e}"
    if not isinstance(state, dict) or not isinstance(state.get("files"), dict):
        return "state.json holds no file hashes"
    written_format = state.get("format", 1)
    if sealed is None and not (isinstance(written_format, int) and written_format <= 2):
        return f"{MARKER} does not seal state.json (a format-{written_format} checkpoint needs it)"
    for name, digest in state["files"].items():
        if not (path / name).is_file():
            return f"{name} missing"
        if (known is None or known.vouched(path / name) != digest) and sha256_file(path / name) != digest:
            return f"{name} sha256 mismatch"
    if set(state["files"]) != set(FILES):
        return "state.json lists the wrong files"
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step != step_of(path):
        return f"state.json says step {step!r}, the folder is {path.name}"
    return None


def verified_state(path: Path) -> tuple[dict | None, str | None]:
    """A checkpoint's state.json once the checkpoint verifies (every file hashed against its sha256,
    whatever a cache says; the seal; the step): (state, None), or (None, "step-N: the problem")."""
    problem = verify(path)
    if problem is not None:
        return None, f"{path.name}: {problem}"
    return read_json(path / "state.json"), None
