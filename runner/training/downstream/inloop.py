"""Downstream tasks scored inside the training loop: the loop's one call-out, `at_step(run, committed)`.

Owns: when (every `eval.downstream_interval_steps` committed steps, and at the end of every
segment: the attempt's last step), preparing the tasks once per attempt (after its first step,
so a refused task stops the run there, not at its first scoring), the
scoring on every rank (the same forwards on each; results summed exactly), and where the figures
go: metrics/downstream.jsonl (one row per task and metric, with `t_eval_seconds` and where the run
stood when the scoring ended: useful tokens, wall and device-wall seconds), the per-request
log-likelihoods downstream/requests-loop-step-NNNNNNN.jsonl.gz, MLflow metrics
`downstream/<task>/<metric>` (and `downstream/t_eval_seconds`, `downstream/exposure_tokens` and
the stamp: `downstream/useful_tokens`, `downstream/wall_seconds`, `downstream/device_wall_seconds`) at
the step, the convention records as tags, the request files as artifacts. Its time is measured
after the step's own time is taken, so it is never step time, and none of its tokens is counted.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from runner.training.downstream.run import Prepared, prepare, requests_name, score, write_requests


def due(interval: int, committed: int, end_step: int) -> bool:
    return committed == end_step or (interval > 0 and committed % interval == 0)


def _summed(device) -> Any:
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        torch.distributed.all_reduce(t)
        return t.cpu()

    return all_reduce


def at_step(run: Any, committed: int) -> None:
    """Score the tasks when due (a no-op without tasks). `run` is the loop's _Run."""
    spec = run.cfg.eval
    if not spec.tasks:
        return
    if run.downstream is None:  # at the attempt's first step, due or not: a refused task stops it there
        started = time.perf_counter()
        run.downstream = prepare(run.exp, dict(spec.tasks))
        run.eval_seconds["downstream_prepare_seconds"] += time.perf_counter() - started
    if not due(spec.downstream_interval_steps, committed, run.steps.end_step):
        return
    prepared: Prepared = run.downstream
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
    (folder / "metrics").mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics" / "downstream.jsonl", "a") as f:
        for r in scored.rows:
            f.write(json.dumps({**r, **stamp, "forwards": scored.forwards}) + "\n")
    run.say(
        "downstream at step "
        + f"{committed}: "
        + ", ".join(f"{r['task']} {r['metric']} {r['value']:.4f}" for r in scored.rows)
        + f" (t_eval {scored.t_eval_seconds:.2f} s)"
    )
    tracker = getattr(run, "tracker", None)
    if tracker is None:
        return
    metrics = {f"downstream/{r['task']}/{r['metric']}": r["value"] for r in scored.rows}
    metrics |= {"downstream/t_eval_seconds": scored.t_eval_seconds, "downstream/exposure_tokens": exposure}
    # the stamp time- and cost-to-target are counted from, where an edit of the run folder cannot reach
    metrics |= {f"downstream/{k}": v for k, v in stamp.items()}
    tracker.log_metrics(metrics, step=committed)
    tracker.log_tags({f"downstream.{r['task']}.{r['metric']}.convention": r["convention"] for r in scored.rows})
    tracker.log_artifacts(requests, "downstream")
