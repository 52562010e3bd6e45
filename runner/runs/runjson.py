"""run.json as a typed record: its fields, what each means, and the defaults of older formats.

`RunJson.from_dict` is the one reader (a run folder's run.json, a published report's copy, an old
run folder's: every key a format lacked gets its default here, never at the call site);
`RunFolder.update` (runner.runs.folder) is the one writer, and refuses a key this record
does not name. Keys a newer runner wrote that this one does not know are kept (`extra`), so a
read-modify-write never drops them. Never reads or writes a file itself.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from runner.errors import RunnerError

#: a run id given as `launch --run-name`: one folder under runs/<experiment>/ (never a path out of it), an
#: MLflow run name, and a word the model card's reproduce line can carry unquoted; a run.json's run_id and
#: experiment are such names too (publish makes reports/<experiment>/<run_id>/ of them)
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_NAMES = ("run_id", "experiment")  # the keys that become folder names
_NOT_KEYS = frozenset({"extra", "recorded_keys"})  # the record's own bookkeeping, never run.json keys


@dataclass
class RunJson:
    """One run folder's run.json (DESIGN.md: run folder). None: not recorded (yet, or by this format)."""

    # written when the folder is created (runner.runs.folder.create_run_folder)
    run_id: str | None = None
    experiment: str | None = None
    fingerprint: str | None = None  #: the current segment's
    experiment_file: str | None = None
    project_root: str | None = None
    mlflow: dict = field(default_factory=dict)  #: tracking_uri, experiment_id, run_id
    segments: list[dict] = field(default_factory=list)  #: index, start_step, budgets, fingerprint, started_at
    status: str | None = None  #: created | running | finished | preempted | failed
    committed_steps: int = 0
    conventions: dict | None = None  #: the MFU convention record (step basis)
    created_at: str | None = None
    # written at each attempt's start (runner.training.loop._conventions)
    runtime: dict = field(default_factory=dict)
    world_size: int | None = None
    threads: int | None = None  #: torch's CPU threads per process, every attempt's (runner.training.threads)
    devices: int | None = None  #: devices the run held (the trainer's world size)
    nodes: int | None = None
    attempts: int | None = None
    flops_per_token: float | None = None
    conventions_goodput: dict | None = None
    hfu_flops_per_token: float | None = None
    conventions_hfu: dict | None = None
    # the run clock's totals, at each checkpoint and the attempt's end (runner.training.records)
    step_seconds_total: float | None = None
    device_step_seconds_total: float | None = None
    wall_seconds: float | None = None
    device_wall_seconds: float | None = None
    #: step, attempt, t_checkpoint (the loop's stop), t_checkpoint_waited (of it, waiting for the previous
    #: write), t_checkpoint_write, checkpoint_write (background/foreground)
    checkpoints: list[dict] = field(default_factory=list)
    #: evaluation wall seconds (runner.training.records.EvalTimes): validation_seconds, downstream_seconds,
    #: downstream_prepare_seconds over the run, and `attempts`: the same per attempt
    t_eval: dict | None = None
    #: process start to the first step, by part, per attempt and summed (runner.training.startup)
    t_startup: dict | None = None
    # the attempt's summary
    exposure_tokens: int | None = None
    useful_tokens: int | None = None
    processed_tokens: int | None = None
    lost_tokens: int | None = None
    mfu: float | None = None
    goodput_mfu: float | None = None
    hfu: float | None = None
    cost_per_billion_useful_tokens: float | None = None
    device_busy: float | None = None
    system: dict | None = None
    error: str | None = None  #: the first line of what failed the last attempt
    extra: dict = field(default_factory=dict)  #: keys this runner does not know, kept as read
    #: the known keys the source held (not null): `has` tells a recorded 0 from a format without the key
    recorded_keys: frozenset[str] = field(default_factory=frozenset, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: Any, file: str = "run.json") -> RunJson:
        """The typed record of a run.json's contents; a missing key gets its default (older formats),
        a null where the format allows none (segments, mlflow, runtime, checkpoints) too."""
        if not isinstance(data, dict):
            raise RunnerError("expected a JSON object (a run's record)", file=file)
        known = {f.name for f in dataclasses.fields(cls)} - _NOT_KEYS
        values = {k: v for k, v in data.items() if k in known and v is not None}
        for key in _NAMES:  # a forged "../../x" published a report outside reports/
            if key in values and not (isinstance(values[key], str) and RUN_NAME.fullmatch(values[key])):
                raise RunnerError(
                    f"{str(values[key])[:80]!r} is not a name (a letter or digit, then letters, digits, "
                    "'_', '.', '-'; at most 128; no path)",
                    file=file,
                    key=key,
                )
        # a forged or damaged record: one line naming the key, never a traceback where a reader uses it
        for key, value in values.items():
            kind = _SHAPES.get(key)
            if kind is not None and not _has_shape(value, kind):
                raise RunnerError(f"must be {_SHAPE_WORDS[kind]}, got {json.dumps(value)[:80]}", file=file, key=key)
        return cls(**values, extra={k: v for k, v in data.items() if k not in known}, recorded_keys=frozenset(values))

    def has(self, key: str) -> bool:
        """Whether the record read held `key` (a field whose default is a value, like committed_steps' 0,
        cannot say so itself)."""
        return key in self.recorded_keys

    def current_fingerprint(self) -> str | None:
        """The fingerprint the run trains under now: its last segment's (runs before segments: the top one)."""
        return self.segments[-1].get("fingerprint") if self.segments else self.fingerprint


def as_record(run: RunJson | dict) -> RunJson:
    """A run's record, typed: a RunJson as is, a run.json's dict read through `RunJson.from_dict`."""
    return run if isinstance(run, RunJson) else RunJson.from_dict(run)


FIELDS = frozenset(f.name for f in dataclasses.fields(RunJson)) - _NOT_KEYS


def check_fields(fields: dict, file: str) -> None:
    """The writer's check: every key written is one the record names (a typo never reaches a run.json)."""
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise RunnerError(
            f"not a run.json field: {', '.join(unknown)} (add it to runner.runs.runjson.RunJson)", file=file
        )


_SHAPE_WORDS = {
    "str": "a string",
    "int": "a whole number",
    "float": "a number",
    "dict": "a JSON object",
    "list[dict]": "a list of JSON objects",
}


def _shape_of(annotation: str) -> str | None:
    """The JSON shape a RunJson field's annotation asks for (None: unchecked)."""
    base = annotation.replace(" | None", "").strip()
    return base if base in _SHAPE_WORDS else None


def _has_shape(value: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "dict":
        return isinstance(value, dict)
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


#: each run.json key's shape, from RunJson's annotations (read as written: `from __future__ import annotations`)
_SHAPES = {
    f.name: shape
    for f in dataclasses.fields(RunJson)
    if f.name not in _NOT_KEYS and (shape := _shape_of(str(f.type))) is not None
}
