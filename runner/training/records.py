"""The records a run folder keeps, each written by its own component at the loop's named points.

The loop calls every record of `default_records()` (rank 0 only), in order, at two points:
`at_checkpoint` (a checkpoint's full state gathered: the checkpoint files, ledger.json, run.json's
totals and its `checkpoints` list) and `at_end` (the attempt's summary: ledger.json and run.json's
status and totals). A new record is a new component added here, not an edit of the loop. The
processed-work journal is the run clock's (runner.training.clock); metrics files and MLflow are
callbacks (runner.training.callbacks). Never decides when a checkpoint is due (the Checkpointer's
interval policy does) or what a step trains on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from runner.training.checkpoint import rng_state, tied_parameters
from runner.training.runfolder import write_ledger_json
from runner.training.schedule import lr_at


@dataclass
class Gathered:
    """A checkpoint's full state on rank 0 (see checkpoint.gather_full_state), and when it started."""

    step: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    started: float  # perf_counter before the gather: run.json's t_checkpoint counts from it


class RunRecord:
    """One record of the run folder. `run` is the loop's state of the attempt (runner.training.loop._Run)."""

    def at_checkpoint(self, run: Any, saved: Gathered) -> None: ...

    def at_end(self, run: Any, committed: int, status: str, summary: dict, system: dict | None) -> None: ...


class CheckpointFiles(RunRecord):
    """checkpoints/step_N: model, optimizer, ledger (+ expert load) and the loop's state, atomically."""

    def at_checkpoint(self, run: Any, saved: Gathered) -> None:
        ledger_state = run.ledger.state_dict() | (run.experts.state_dict() if run.experts is not None else {})
        run.checkpointer.save(
            saved.step,
            saved.model_state,
            saved.optimizer_state,
            ledger_state,
            checkpoint_state(run, saved.step),
            tied=tied_parameters(run.raw_model),
        )


def checkpoint_state(run: Any, step: int) -> dict:
    """The loop's part of a checkpoint: sampler cursor, RNG, lineage, scheduler and the run clock."""
    cfg, tracker = run.cfg, run.tracker
    segment_steps = run.schedule_steps_at(step)
    # The resolved config rides along (as in OLMo-core) so an edited experiment.yaml can be diffed.
    return {
        "sampler_step": step,
        "rng": rng_state(),
        "fingerprint": run.exp.fingerprint,
        "config": run.resolved_config,
        "segment": len(run.info.segments) - 1,
        "attempt": run.clock.attempt,
        "scheduler": {
            "schedule": cfg.optim.schedule,
            "schedule_steps": run.steps.schedule_steps,
            "warmup_steps": run.steps.warmup_steps,
            "segment_schedule_steps": segment_steps,
            "next_lr": lr_at(step, cfg.optim, segment_steps, run.steps.warmup_steps),
        },
        "mlflow_run_id": tracker.run_id if tracker is not None else None,
        **run.clock.state_dict(),
    }


class LedgerJson(RunRecord):
    """ledger.json (counters, repetition, realized ratios) and, of a mixture of experts, its expert load."""

    def _write(self, run: Any, step: int) -> None:
        write_ledger_json(run.folder.path, run.ledger)
        if run.experts is not None:
            run.experts.load.write_json(run.folder.path, step)

    def at_checkpoint(self, run: Any, saved: Gathered) -> None:
        self._write(run, saved.step)

    def at_end(self, run: Any, committed: int, status: str, summary: dict, system: dict | None) -> None:
        self._write(run, committed)


class RunJson(RunRecord):
    """run.json: the committed step and the clock's totals at each checkpoint, with what the checkpoint
    cost; the status and the summary at the attempt's end."""

    def at_checkpoint(self, run: Any, saved: Gathered) -> None:
        # t_checkpoint: gather and write, while training waited (the wall-clock formula sums them)
        seconds = time.perf_counter() - saved.started
        earlier = run.folder.record().checkpoints
        entry = {"step": saved.step, "attempt": run.clock.attempt, "t_checkpoint": round(seconds, 6)}
        run.folder.update(committed_steps=saved.step, **run.clock.totals(), checkpoints=earlier + [entry])

    def at_end(self, run: Any, committed: int, status: str, summary: dict, system: dict | None) -> None:
        run.folder.update(status=status, **summary, **({"system": system} if system is not None else {}))


#: what run.json's `t_eval` sums, per attempt and over the run (SPEC "Downstream evaluation")
EVAL_TIME_KEYS = ("validation_seconds", "downstream_seconds", "downstream_prepare_seconds")


def zero_eval_seconds() -> dict[str, float]:
    """An attempt's evaluation clock (the loop's `_Run.eval_seconds`), every kind at zero."""
    return dict.fromkeys(EVAL_TIME_KEYS, 0.0)


class EvalTimes(RunRecord):
    """run.json's `t_eval`: wall seconds this attempt spent on validation (the loop's evaluate) and on
    downstream scoring (the scorings' t_eval_seconds, and preparing the tasks), next to the earlier
    attempts' and summed over all of them. Written at every checkpoint and at the attempt's end, so
    an attempt killed in between keeps what it had at its last checkpoint."""

    def _write(self, run: Any) -> None:
        record = run.folder.record().t_eval or {}
        attempt = int(run.clock.attempt)
        earlier = [a for a in record.get("attempts", []) if int(a.get("attempt", -1)) != attempt]
        mine = {"attempt": attempt, **{k: round(float(run.eval_seconds[k]), 6) for k in EVAL_TIME_KEYS}}
        attempts = sorted(earlier + [mine], key=lambda a: int(a["attempt"]))
        totals = {k: round(sum(float(a.get(k, 0.0)) for a in attempts), 6) for k in EVAL_TIME_KEYS}
        run.folder.update(t_eval={**totals, "attempts": attempts})

    def at_checkpoint(self, run: Any, saved: Gathered) -> None:
        self._write(run)

    def at_end(self, run: Any, committed: int, status: str, summary: dict, system: dict | None) -> None:
        self._write(run)


def default_records() -> list[RunRecord]:
    """The records every run keeps, in the order they are written (run.json last: it points at the rest)."""
    return [CheckpointFiles(), LedgerJson(), EvalTimes(), RunJson()]
