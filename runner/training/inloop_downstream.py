"""Downstream tasks scored inside the training loop: the loop's one call-out, `at_step(run, committed)`.

Owns: when (every `eval.downstream_interval_steps` committed steps, and at the end of every
segment: the attempt's last step), preparing the tasks once per attempt (after its first step,
so a refused task stops the run there, not at its first scoring), the
scoring on every rank (the same forwards on each; results summed exactly), the per-request
log-likelihoods downstream/requests-loop-step-NNNNNNN.jsonl.gz, and the rows it hands the callbacks
(`on_downstream`: one per task and metric, with `t_eval_seconds` and where the run stood when the
scoring ended: useful tokens, wall and device-wall seconds), which write metrics/downstream.jsonl
and MLflow (runner.training.callbacks). Its time is measured after the step's own time is taken, so
it is never step time, and none of its tokens is counted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from runner.training.callbacks import DownstreamScoring
from runner.training.downstream.run import prepare, requests_name, score, write_requests

if TYPE_CHECKING:
    from runner.training.attempt import Attempt


def due(interval: int, committed: int, end_step: int) -> bool:
    return committed == end_step or (interval > 0 and committed % interval == 0)


def _summed(device) -> Any:
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        torch.distributed.all_reduce(t)
        return t.cpu()

    return all_reduce


def at_step(run: Attempt, committed: int) -> None:
    """Score the tasks when due (a no-op without tasks)."""
    spec = run.cfg.eval
    if not spec.tasks:
        return
    if run.downstream is None:  # at the attempt's first step, due or not: a refused task stops it there
        started = time.perf_counter()
        run.downstream = prepare(run.exp, dict(spec.tasks))
        run.eval_seconds["downstream_prepare_seconds"] += time.perf_counter() - started
    if not due(spec.downstream_interval_steps, committed, run.steps.end_step):
        return
    prepared = run.downstream
    acc = run.acc
    exposure = int(run.ledger.counters()["total"]["exposure"])
    scored = score(
        run.raw_model,
        prepared,
        step=committed,
        exposure_tokens=exposure,
        micro_batch=spec.downstream_micro_batch,
        dtype="bfloat16 autocast" if str(run.cfg.hardware.precision) == "bf16" else "float32",
        device=acc.device,
        rank=acc.process_index,
        world=acc.num_processes,
        autocast=acc.autocast,
        all_reduce=_summed(acc.device) if acc.num_processes > 1 else None,
    )
    run.eval_seconds["downstream_seconds"] += scored.t_eval_seconds  # run.json's t_eval (records.EvalTimes)
    if not run.main:
        return
    # Where the run stood when this scoring ended: a downstream target's time-to-target (SPEC).
    wall, device_wall = run.clock.journal_time()
    useful = int(run.ledger.counters()["total"]["useful"])
    stamp = {"useful_tokens": useful, "wall_seconds": wall, "device_wall_seconds": device_wall}
    folder = run.folder.path
    requests = write_requests(folder / "downstream" / requests_name(committed, "loop"), scored, committed)
    rows = [{**r, **stamp, "forwards": scored.forwards} for r in scored.rows]
    for cb in run.callbacks:
        cb.on_downstream(DownstreamScoring(committed, rows, scored.t_eval_seconds, exposure, requests))
    run.say(
        "downstream at step "
        + f"{committed}: "
        + ", ".join(f"{r['task']} {r['metric']} {r['value']:.4f}" for r in scored.rows)
        + f" (t_eval {scored.t_eval_seconds:.2f} s)"
    )
