"""The experiment rules that need FLOPs or the hardware peak table: the device has a peak for its dtype,
the model's training state fits the device memory, a checkpoint gathered on rank 0 fits the host; and
whether rank 0's pinned checkpoint buffers may be taken from a host's available memory (`pinned_fit`,
the trainer's guard and `runner plan`'s row alike).

Owns those rules, that guard's arithmetic and the loaders that apply them with the config's own (`load_experiment`,
`load_recipe_file`: runner.config.load's, handed `RULES`). Every CLI verb loads through these, so a
fault is still named where the config's own rules name theirs, in the same error. They live here,
not in runner.config.rules, because they need runner.planning's arithmetic and config imports
nothing above it. Never reads a run folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.config import load
from runner.config.rules import devices
from runner.config.schema import ExperimentSchema, HardwareRecipe
from runner.errors import Problems, display_path, join_key
from runner.planning.flops import params_of_config
from runner.planning.hardware import canonical_device

#: bytes per parameter that training certainly holds: fp32 weights, fp32 grads, AdamW's two fp32 moments.
STATE_BYTES_PER_PARAM = 16
#: bytes per parameter a checkpoint holds, gathered whole in rank 0's host memory to be written:
#: fp32 weights and AdamW's two fp32 moments (gradients are not saved). The copy is held while the write
#: runs behind the loop; the next checkpoint waits for it, so one copy at a time
#: (runner.training.checkpoint.host_copy; its test measures the copy against this figure).
CHECKPOINT_BYTES_PER_PARAM = 12
#: The most of the host's available memory (MemAvailable when the attempt starts) that rank 0's pinned
#: checkpoint buffers (runner.training.staging.PinnedStaging: the checkpoint's bytes, 12 B/param) may take.
#: Pinned pages are locked: never swapped or reclaimed, and held for the whole run (allocated once,
#: reused by every checkpoint), where the pageable copy holds its memory only while a checkpoint is
#: written. Half leaves the other half, all run long, to what runs beside them: the data loader's pinned
#: batches and prefetch, the page cache of the shards and of the checkpoint being written, the writer's
#: and Python's own memory; and an allocation of most of a host's memory can fail outright or bring
#: the kernel's OOM killer. gpu-smoke's 15.6 GB on the H200 host (128 GiB) takes ~12%: pinned;
#: OLMoE-1B-7B's 83 GB would take ~65% or more: pageable.
PINNED_HOST_FRACTION = 0.5


def check_device_peak(hw: HardwareRecipe, path: Path, problems: Problems, prefix: str = "hardware") -> None:
    """An accelerator without a stated peak must be in the peak table, for its dtype: MFU is never
    measured against another device's number."""
    if hw.accelerator == "cpu" or hw.peak_tflops is not None:
        return
    if canonical_device(hw.device_name) is None or hw.peak_dtype != "bf16":
        problems.add(
            path,
            join_key(prefix, "device_name"),
            f"'{hw.device_name}' has no {hw.peak_dtype} peak in the table: state peak_tflops and peak_source "
            "(never another device's number)",
        )


def check_model_fits(cfg, path: Path, problems: Problems) -> None:
    """A model whose training state alone (16 B/param, before any activation) exceeds the hardware
    recipe's memory can never train: say so here, not as an allocation failure after launch wrote a run folder."""
    if not cfg.hardware.memory_gib or cfg.hardware.memory_gib <= 0:
        return
    shard = devices(cfg) if cfg.hardware.distributed == "fsdp" else 1
    need_bytes = params_of_config(cfg).all * STATE_BYTES_PER_PARAM // shard
    have_bytes = cfg.hardware.memory_gib * 2**30
    if need_bytes > have_bytes:
        problems.add(
            path,
            "model",
            f"{params_of_config(cfg).all:,} parameters need {need_bytes / 2**30:,.4g} GiB per device for weights, "
            f"gradients and AdamW moments alone ({STATE_BYTES_PER_PARAM} B/param"
            + (f", sharded over {shard}" if shard > 1 else "")
            + f"); hardware.memory_gib is {cfg.hardware.memory_gib:g}",
        )


def host_gather_bytes(cfg: ExperimentSchema) -> int:
    """Bytes rank 0 holds in host memory while it writes a checkpoint: the full state, gathered and
    copied to host memory of its own (one checkpoint at a time)."""
    return params_of_config(cfg).all * CHECKPOINT_BYTES_PER_PARAM


@dataclass(frozen=True)
class PinnedFit:
    """Whether rank 0's checkpoint copies go to pinned buffers, and the line that says why."""

    pinned: bool
    note: str


def pinned_fit(need_bytes: float, available_bytes: float | None, fraction: float = PINNED_HOST_FRACTION) -> PinnedFit:
    """Pinned buffers of `need_bytes` only when they take at most `fraction` of `available_bytes` (the
    host's MemAvailable; `runner plan`: the recipe's host memory, an upper bound of it); unknown
    available memory pins nothing blind."""
    need = f"{need_bytes / 1e9:,.1f} GB"
    if available_bytes is None or available_bytes <= 0:
        return PinnedFit(
            False, f"pageable: pinned buffers for {need} not taken, the host's available memory is unknown"
        )
    share = f"{need_bytes / available_bytes:.0%} of the host's {available_bytes / 1e9:,.1f} GB available"
    if need_bytes <= fraction * available_bytes:
        return PinnedFit(True, f"pinned: {need} of buffers, {share} (at most {fraction:.0%})")
    return PinnedFit(
        False,
        f"pageable: pinned buffers for {need} would take {share}, over the {fraction:.0%} they may "
        "(runner.planning.resources.PINNED_HOST_FRACTION); each checkpoint is copied into pageable host "
        "memory instead (a longer stop of the loop)",
    )


def check_host_gather(cfg: ExperimentSchema, path: Path, problems: Problems) -> list[str]:
    """Refuse a GPU experiment whose checkpoint, gathered whole on rank 0, exceeds the node's stated host
    memory (it would be killed at its first checkpoint, hours in); unknown host memory is a note."""
    if cfg.hardware.accelerator == "cpu":
        return []  # the device memory is the host's: check_model_fits covers it
    need = host_gather_bytes(cfg)
    host = cfg.hardware.host_memory_gib
    if host is None:
        return [
            f"{display_path(path)}: hardware.host_memory_gib: unknown; rank 0 gathers {need / 2**30:,.4g} GiB "
            "(fp32 weights + AdamW moments) in host memory and holds it while each checkpoint is written: "
            "state the node's host memory"
        ]
    if need > host * 2**30:
        problems.add(
            path,
            "hardware.host_memory_gib",
            f"a checkpoint gathers {need / 2**30:,.4g} GiB on rank 0 ({params_of_config(cfg).all:,} parameters x "
            f"{CHECKPOINT_BYTES_PER_PARAM} B: fp32 weights + AdamW moments), more than the {host:g} GiB of host "
            "memory; use nodes with more host memory (a sharded checkpoint format, which would not gather, "
            "is not implemented)",
        )
    return []


class _Rules:
    """runner.config.rules.ResourceRules: the rules above, where the loader checks the config's own."""

    def check_hardware(self, hw: HardwareRecipe, path: Path, problems: Problems, prefix: str) -> None:
        check_device_peak(hw, path, problems, prefix)

    def check_experiment(self, cfg: ExperimentSchema, path: Path, problems: Problems) -> list[str]:
        check_model_fits(cfg, path, problems)
        return check_host_gather(cfg, path, problems)


RULES = _Rules()


def load_experiment(path: str | Path, *, check_files: bool = True) -> load.Experiment:
    """runner.config.load.load_experiment with these rules too: every rule an experiment must satisfy."""
    return load.load_experiment(path, check_files=check_files, resources=RULES)


def load_experiment_data(data: dict, path: Path, root: Path, *, check_files: bool = True) -> load.Experiment:
    """runner.config.load.load_experiment_data with these rules too."""
    return load.load_experiment_data(data, path, root, check_files=check_files, resources=RULES)


def load_recipe_file(path: Path, kind: str, problems: Problems) -> dict | None:
    """runner.config.load.load_recipe_file with these rules too (a hardware recipe's device peak)."""
    return load.load_recipe_file(path, kind, problems, resources=RULES)
