"""The loop's seam: what one attempt holds (`Attempt`), the options it runs with (`Options`), and the
interface of the run folder's records it calls out to at a checkpoint and at the attempt's end
(`RunRecord`, handed the checkpoint's `Gathered` state).

The loop (runner.training.loop) builds and advances an `Attempt`; the records (runner.training.records)
and in-loop scoring (runner.training.inloop_downstream) read it by attribute, so mypy checks every
field they take. Never trains, writes or decides anything itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runner.config.load import Experiment
from runner.config.schema import ExperimentSchema
from runner.runs.folder import RunFolder
from runner.runs.runjson import RunJson
from runner.training.accelerator import SHARD_RUNNER_CPU, AttentionBackend
from runner.training.batches import Data
from runner.training.callbacks import Callback
from runner.training.checkpoint import Checkpointer
from runner.training.clock import RunClock
from runner.training.collectives import fsdp2_no_sync
from runner.training.downstream.run import Prepared
from runner.training.experts import RouterProbe
from runner.training.ledger import TokenLedger
from runner.training.moe.balancing import RoutingRecord
from runner.training.prefetch import Prefetcher
from runner.training.schedule import segment_schedule_steps
from runner.training.staging import PinnedStaging
from runner.training.steps import FlopsBasis, StepPlan
from runner.training.sysmetrics import SystemMetricsCallback
from runner.training.tracking import Tracker

if TYPE_CHECKING:
    from accelerate import Accelerator


#: what run.json's `t_eval` sums, per attempt and over the run (SPEC "Downstream evaluation")
EVAL_TIME_KEYS = ("validation_seconds", "downstream_seconds", "downstream_prepare_seconds")


def zero_eval_seconds() -> dict[str, float]:
    """An attempt's evaluation clock (`Attempt.eval_seconds`), every kind at zero."""
    return dict.fromkeys(EVAL_TIME_KEYS, 0.0)


#: A source of per-step figures (Options.step_figures): called on every rank after each committed step,
#: handed the attempt and the committed step count; its {name: value} goes into the step's record, so
#: metrics/train.jsonl holds it and MLflow logs it at the step (the callbacks; no other edit needed).
StepFigures = Callable[["Attempt", int], dict[str, float]]


@dataclass
class Options:
    """How `loop.train` runs an attempt beyond the experiment: tests' and tools' hooks, extra callbacks."""

    max_steps: int | None = None  # stop after this many steps in this attempt (tests, smoke)
    report: Callable[[str], None] = print
    nonfinite_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None  # tests: poison a loss
    peak_measure_seconds: float = 1.0
    callbacks: list[Callback] = field(default_factory=list)
    step_figures: list[StepFigures] = field(default_factory=list)  # per-step figures beyond the loop's own
    records: list[RunRecord] | None = None  # the run folder's records (rank 0 writes); None: records.default_records()
    kill_at_step: int | None = None  # fault injection: SIGKILL itself mid-step (smoke, tests)
    fault: Callable[[], None] | None = None  # what kill_at_step does instead of a SIGKILL (tests, --fault)
    verify_shards: bool = True  # hash every shard against its manifest before the first checkpoint (bench: off)


@dataclass
class Attempt:
    """What one attempt holds. loop._setup builds it, _resume and _conventions fill it in, the loop advances
    it; the run folder's records and in-loop scoring read it (the loop's one seam, typed)."""

    exp: Experiment
    acc: Accelerator
    opts: Options
    folder: RunFolder
    say: Callable[[str], None]
    steps: StepPlan  # the step geometry and the attempt's last step
    runtime: dict  # the runtime record (run.json's `runtime`): what was applied, flat
    attention: AttentionBackend  # the checked attention choice, entered around forward/backward and evaluation
    records: list[RunRecord]  # Options.records, or the default ones
    data: Data
    model: torch.nn.Module
    raw_model: torch.nn.Module  # the model without accelerate's wrapper (set by _resume)
    optimizer: torch.optim.Optimizer
    ledger: TokenLedger
    checkpointer: Checkpointer
    resolved_config: dict
    sharding: str  # backends.SHARD_*: who shards the model, if anyone
    info: RunJson = field(default_factory=RunJson)  # run.json as this attempt found it
    start_step: int = 0
    last_saved: int = 0
    last_eval: int = 0
    basis: FlopsBasis | None = None  # MFU's FLOPs per token and peak: set by _conventions, before the first step
    tracker: Tracker | None = None
    callbacks: list[Callback] = field(default_factory=list)

    @property
    def flops(self) -> FlopsBasis:
        if self.basis is None:
            raise RuntimeError("the FLOPs basis is read before _conventions resolved it")
        return self.basis

    batches: Prefetcher | None = None  # of HostBatch, one per step of this attempt
    system: SystemMetricsCallback | None = None  # when system metrics are on
    experts: RouterProbe | None = None  # of a mixture-of-experts model, else None
    routing: RoutingRecord | None = None  # of a mixture-of-experts model: per-step loads, balancing bias
    clock: RunClock = field(default_factory=lambda: RunClock(1))  # _setup: the run's world and device clock
    downstream: Prepared | None = None  # the downstream tasks, prepared at their first scoring (inloop_downstream)
    eval_seconds: dict = field(default_factory=zero_eval_seconds)  # this attempt's t_eval (records.EvalTimes)
    staging: PinnedStaging | None = None  # rank 0 on a GPU: the checkpoints' reusable pinned buffers

    @property
    def cfg(self) -> ExperimentSchema:
        return self.exp.config

    @property
    def rank(self) -> int:
        return self.acc.process_index

    @property
    def world(self) -> int:
        return self.acc.num_processes

    @property
    def main(self) -> bool:
        return self.acc.is_main_process

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # under accelerate's wrapper

    def no_sync(self):
        """Hold gradient reduction during the micro steps before the last (DDP or FSDP2)."""
        if self.sharding != SHARD_RUNNER_CPU:
            return self.acc.no_sync(self.model)
        return fsdp2_no_sync(self.raw_model)

    @property
    def pin(self) -> bool:
        # The runtime record only says pin_memory on a GPU; the device check keeps CPU copies synchronous.
        return bool(self.runtime.get("pin_memory")) and self.acc.device.type == "cuda"

    def schedule_steps_at(self, step: int) -> int:
        return segment_schedule_steps(self.info.segments, step, self.steps.tokens, self.steps.schedule_steps)


@dataclass
class Gathered:
    """A checkpoint's full state on rank 0, host memory of its own (checkpoint.gather_full_state, then
    checkpoint.host_copy), and its times."""

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    started: float  #: perf_counter when the loop stopped for it (before waiting for the previous write)
    resumed: float | None = None  #: perf_counter when the loop went on, the write handed off (background)
    write_seconds: float | None = None  #: the files' own write: serialize, fsync, hash, rename, seal, prune
    written: str | None = None  #: "background" or "foreground": the thread that wrote the files, as seen there
    ready: Callable[[], None] | None = None  #: waits for the copies into host memory (PinnedStaging), if any
    waited: float = 0.0  #: of the stop, seconds waiting for the previous checkpoint's write to end

    def stopped_seconds(self) -> float:
        """How long the loop stood still for this checkpoint (SPEC's t_checkpoint): until it went on,
        or, written in the loop, until now."""
        return (self.resumed if self.resumed is not None else time.perf_counter()) - self.started


Write = Callable[[], None]


class RunRecord:
    """One record of the run folder (runner.training.records), handed the loop's state of the attempt.

    `at_checkpoint` runs on the loop's thread at the step boundary: it takes from `run` what it will
    write and returns the write (None: nothing to write), which may run after training went on."""

    def at_checkpoint(self, run: Attempt, saved: Gathered) -> Write | None: ...

    def at_end(self, run: Attempt, committed: int, status: str, summary: dict, system: dict | None) -> None: ...
