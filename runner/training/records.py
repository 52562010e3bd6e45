"""The records a run folder keeps, each written by its own component at the loop's named points.

The loop calls every record of `default_records()` (rank 0 only), in order, at two points:
`at_checkpoint` (a checkpoint's full state gathered and copied to host memory: the checkpoint files,
ledger.json, run.json's totals and its `checkpoints` list) and `at_end` (the attempt's summary:
ledger.json and run.json's status and totals). At a checkpoint each record takes, on the loop's
thread, what it will write (the step's ledger, RNG and clock) and returns the write; the writes run
in order behind the loop (the Checkpointer's BackgroundWriter: a thread, or the loop itself under
`train.checkpoint.write: foreground`), so run.json names a checkpoint only once its files are
sealed. A new record is a new component added here, not an edit of the loop. The processed-work
journal is the run clock's (runner.training.clock); metrics files and MLflow are callbacks
(runner.training.callbacks). Never decides when a checkpoint is due (the Checkpointer's interval
policy does) or what a step trains on.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from runner.fsio import atomic_write_json
from runner.training import startup
from runner.training.attempt import EVAL_TIME_KEYS, Attempt, Gathered, RunRecord, Write
from runner.training.checkpoint import rng_state, tied_parameters
from runner.training.expert_load import FILE as EXPERT_LOAD_FILE
from runner.training.ledger import TokenLedger
from runner.training.schedule import lr_at


class CheckpointFiles(RunRecord):
    """checkpoints/step_N: model, optimizer, ledger (+ expert load) and the loop's state, atomically."""

    def at_checkpoint(self, run: Attempt, saved: Gathered) -> Write:
        ledger_state = run.ledger.state_dict() | (run.experts.state_dict() if run.experts is not None else {})
        state, tied = checkpoint_state(run, saved.step), tied_parameters(run.raw_model)
        checkpointer, loop_thread = run.checkpointer, threading.current_thread()

        def write() -> None:
            t0 = time.perf_counter()
            saved.written = "foreground" if threading.current_thread() is loop_thread else "background"
            checkpointer.save(saved.step, saved.model_state, saved.optimizer_state, ledger_state, state, tied=tied)
            saved.write_seconds = time.perf_counter() - t0
            saved.model_state, saved.optimizer_state = {}, {}  # the host copy goes once it is on disk

        return write


def checkpoint_state(run: Attempt, step: int) -> dict:
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

    def at_checkpoint(self, run: Attempt, saved: Gathered) -> Write:
        ledger = ledger_document(run.ledger)
        load = run.experts.load.to_json(saved.step) if run.experts is not None else None
        folder = run.folder.path

        def write() -> None:
            write_ledger_json(folder, ledger)
            if load is not None:
                atomic_write_json(folder / EXPERT_LOAD_FILE, load)

        return write

    def at_end(self, run: Attempt, committed: int, status: str, summary: dict, system: dict | None) -> None:
        write_ledger_json(run.folder.path, ledger_document(run.ledger))
        if run.experts is not None:
            run.experts.load.write_json(run.folder.path, committed)


class RunJsonWriter(RunRecord):
    """run.json: the committed step and the clock's totals at each checkpoint, with what the checkpoint
    cost; the status and the summary at the attempt's end."""

    def at_checkpoint(self, run: Attempt, saved: Gathered) -> Write:
        totals, attempt, folder = run.clock.totals(), run.clock.attempt, run.folder

        def write() -> None:
            # SPEC: t_checkpoint is what the loop stood still for (the wall-clock formula sums them), of
            # which t_checkpoint_waited waiting for the previous write (checkpoints faster than the disk);
            # t_checkpoint_write the files' own write, behind the loop when checkpoint_write is background.
            entry = {
                "step": saved.step,
                "attempt": attempt,
                "t_checkpoint": round(saved.stopped_seconds(), 6),
                "t_checkpoint_waited": round(saved.waited, 6),
                "t_checkpoint_write": round(saved.write_seconds or 0.0, 6),
                "checkpoint_write": saved.written,
            }
            earlier = folder.record().checkpoints
            folder.update(committed_steps=saved.step, **totals, checkpoints=earlier + [entry])

        return write

    def at_end(self, run: Attempt, committed: int, status: str, summary: dict, system: dict | None) -> None:
        run.folder.update(status=status, **summary, **({"system": system} if system is not None else {}))


def take_records(records: list[RunRecord], run: Attempt, saved: Gathered) -> Write:
    """Every record's take of the checkpoint, in order, on the loop's thread; the write returned runs
    theirs in the same order (a failed one stops the rest: run.json never names unsealed files)."""
    writes = [w for w in (record.at_checkpoint(run, saved) for record in records) if w is not None]

    def write() -> None:
        if saved.ready is not None:  # the device-to-host copies, enqueued by the loop, done first
            saved.ready()
        for w in writes:
            w()

    return write


class EvalTimes(RunRecord):
    """run.json's `t_eval`: wall seconds this attempt spent on validation (the loop's evaluate) and on
    downstream scoring (the scorings' t_eval_seconds, and preparing the tasks), next to the earlier
    attempts' and summed over all of them. Written at every checkpoint and at the attempt's end, so
    an attempt killed in between keeps what it had at its last checkpoint."""

    @staticmethod
    def _take(run: Attempt) -> Write:
        """The attempt's seconds now, on the loop's thread; the write (run.json's read-modify-write) runs
        where the checkpoint's other records run theirs, in order, so no two writers race."""
        folder, attempt = run.folder, int(run.clock.attempt)
        mine = {"attempt": attempt, **{k: round(float(run.eval_seconds[k]), 6) for k in EVAL_TIME_KEYS}}

        def write() -> None:
            record = folder.record().t_eval or {}
            earlier = [a for a in record.get("attempts", []) if int(a.get("attempt", -1)) != attempt]
            attempts = sorted(earlier + [mine], key=lambda a: int(a["attempt"]))
            totals = {k: round(sum(float(a.get(k, 0.0)) for a in attempts), 6) for k in EVAL_TIME_KEYS}
            folder.update(t_eval={**totals, "attempts": attempts})

        return write

    def at_checkpoint(self, run: Attempt, saved: Gathered) -> Write:
        return self._take(run)

    def at_end(self, run: Attempt, committed: int, status: str, summary: dict, system: dict | None) -> None:
        self._take(run)()


class StartupTimes(RunRecord):
    """run.json's `t_startup` (runner.training.startup): this attempt's start by part and its first
    step, next to the earlier attempts' and summed; written at every checkpoint and the attempt's end."""

    @staticmethod
    def _take(run: Attempt) -> Write | None:
        clock = startup.current()
        if clock is None:
            return None
        folder, mine = run.folder, clock.record(int(run.clock.attempt))

        def write() -> None:
            folder.update(t_startup=startup.merged(folder.record().t_startup, mine))

        return write

    def at_checkpoint(self, run: Attempt, saved: Gathered) -> Write | None:
        return self._take(run)

    def at_end(self, run: Attempt, committed: int, status: str, summary: dict, system: dict | None) -> None:
        write = self._take(run)
        if write is not None:
            write()


def default_records() -> list[RunRecord]:
    """The records every run keeps, in the order they are written (run.json last: it points at the rest)."""
    return [CheckpointFiles(), LedgerJson(), EvalTimes(), StartupTimes(), RunJsonWriter()]


def ledger_document(ledger: TokenLedger) -> dict:
    """ledger.json's content as of now: counters, repetition histogram and realized ratios (plain JSON)."""

    def plain(x):
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (np.integer,)):
            return int(x)
        if isinstance(x, (np.floating,)):
            return float(x)
        return x

    return {
        "counters": plain(ledger.counters()),
        "histogram": plain(ledger.histogram()),
        "realized_ratios": plain(ledger.realized_ratios()),
    }


def write_ledger_json(run_dir: Path, document: dict) -> None:
    """ledger.json (for report/audit) from a ledger_document, taken when the figures were current."""
    atomic_write_json(Path(run_dir) / "ledger.json", document)
