"""The training loop: sampler -> batches -> forward/backward -> optimizer step -> ledger commit.

Owns the loop itself (nanoGPT-shaped: one screen per idea), the learning-rate schedule, the loss
normalisation (summed over useful target positions, divided by the GLOBAL count, so 1 or N
processes compute the same gradient), the processed-token journal, resume, the non-finite stop and
the preemption stop. Checkpoint files, MLflow, metrics files and evaluation are calls out of it.
Never decides what data a step sees (the sampler does) and never writes outside its run folder.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from runner.config.rules import grad_accum, max_duration_tokens, total_steps
from runner.errors import EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED, RunnerError
from runner.planning import hardware
from runner.planning.flops import convention_for, flops_per_token, hfu_convention, hfu_flops_per_token
from runner.planning.memory import choose_micro_batch
from runner.runs.checkpoints import MARKER
from runner.runs.folder import RunFolder
from runner.runs.steprecord import StepRecord
from runner.training import evaluate, startup
from runner.training import experts as experts_mod
from runner.training import inloop_downstream as downstream
from runner.training.accelerator import (
    SHARD_RUNNER_CPU,
    Runtime,
    apply_runtime,
    ddp_compile_settings,
    execution_record,
    fsdp_record,
    node_count,
    shard_fsdp2_cpu,
    sharding_mode,
    step_clock,
)
from runner.training.attempt import Attempt, Gathered, Options
from runner.training.batches import load_data, read_step
from runner.training.callbacks import Callback, MetricsFiles, TargetsCallback, TrackingCallback, TrainingProgress
from runner.training.checkpoint import Checkpointer, gather_full_state, host_copy, set_rng_state, training_tensors
from runner.training.clock import RunClock
from runner.training.collectives import (
    STOP_TIMEOUT_KEY,
    Decisions,
    StopDeadline,
    StopFlag,
    all_gather_ints,
    all_reduce,
    check_same_checkpoint,
    scalar,
)
from runner.training.ledger import TokenLedger
from runner.training.model import build_model, maybe_compile
from runner.training.moe import balancing
from runner.training.prefetch import Prefetcher
from runner.training.records import default_records, take_records
from runner.training.samples import samples_callback
from runner.training.schedule import lr_at, make_optimizer
from runner.training.staging import PinnedStaging
from runner.training.steps import FlopsBasis, StepPlan
from runner.training.sysmetrics import SystemMetricsCallback, close_and_summarize, system_callback
from runner.training.threads import apply_threads, attempt_threads
from runner.training.tracking import START_WAIT_SECONDS, Tracker

# ---- the run ------------------------------------------------------------------------------------


@dataclass
class _Step:
    loss: float  # nats per useful target, global batch
    grad_norm: float  # before clipping
    lr: float
    global_pairs: np.ndarray  # the whole global batch [B, 2]: the ledger commits all ranks' pairs
    useful: dict[str, int]  # useful targets per domain, all ranks
    useful_tokens: float


def _device_memory_bytes(acc) -> int | None:
    """What the GPU this process uses really holds (the recipe's memory_gib may name a larger part)."""
    if acc.device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(acc.device).total_memory)


def _runtime(cfg, acc, micro: int, accum: int) -> tuple[Runtime, int, int]:
    """The runtime applied (its record: kernels, sharding, micro batch and its policy; the attention
    choice) with the micro batch and the accumulation steps it settles on (policy auto: the largest
    micro batch the device's memory fits)."""
    world = acc.num_processes
    applied = apply_runtime(cfg.hardware, cfg.model, optim_cfg=cfg.optim)
    runtime = applied.record
    runtime["sharding"] = sharding_mode(cfg.hardware, acc)
    runtime.update(fsdp_record(acc))
    if cfg.train.micro_batch_policy == "auto":
        micro, why = choose_micro_batch(cfg, world, _device_memory_bytes(acc))
        accum = cfg.train.global_batch_sequences // (micro * world)
        runtime["micro_batch_note"] = why
    runtime.update(
        micro_batch_sequences=micro,
        micro_batch_policy=cfg.train.micro_batch_policy,
        accumulation_steps=accum,
        prefetch_batches=cfg.train.prefetch_batches,
        checkpoint_write=cfg.train.checkpoint.write,  # the setting; each checkpoint records the thread that wrote it
    )
    if world > 1:  # what bounded this attempt's stop (StopDeadline)
        runtime["stop_timeout_seconds"] = cfg.train.checkpoint.stop_timeout_seconds
    return applied, micro, accum


def _setup(exp, run_dir: Path, acc, opts: Options) -> Attempt:
    """Step arithmetic, runtime settings, data, model, optimizer and ledger, before any resume; each
    object is built once, in the order the next one needs: model before sharding before optimizer."""
    cfg, world = exp.config, acc.num_processes
    B, L, micro = cfg.train.global_batch_sequences, cfg.train.seq_len, cfg.train.micro_batch_sequences
    accum = grad_accum(cfg, world)  # a guard for callers that skip launch's check
    # natural_end is the budget's last step; a hard stop ends this attempt earlier but leaves the
    # run resumable (not finished), so removing the hard stop continues it on the same schedule.
    natural_end = end_step = total_steps(cfg)
    if cfg.train.hard_stop_tokens is not None:
        end_step = min(end_step, cfg.train.hard_stop_tokens // (B * L))

    # before anything computes: the run's recorded count on a resume (runner.training.threads)
    recorded = RunFolder(run_dir).record().threads
    where = exp.recipe_files.get("hardware") or exp.path or run_dir
    threads = apply_threads(attempt_threads(cfg.hardware.threads, recorded, file=str(where)))
    applied, micro, accum = _runtime(cfg, acc, micro, accum)
    startup.mark("accelerator_and_folder")
    runtime, sharding = applied.record, applied.record["sharding"]
    runtime["torch_threads"] = threads
    if acc.device.type == "cpu":
        # Bit-identical resume needs the same kernels every time; CPU kernels are deterministic.
        torch.use_deterministic_algorithms(True, warn_only=True)
    data = load_data(exp, L, verify=opts.verify_shards and acc.is_local_main_process)  # one hasher per node
    startup.mark("data")
    torch.manual_seed(cfg.seed)
    with startup.on_device(acc.device):  # parameters made and initialised there: no host copy to move
        model = build_model(cfg)
    probe = experts_mod.attach(model, cfg, data.domains)  # hooks on the routers, before any wrapping
    routing = balancing.attach(model, cfg, run_dir, acc.is_main_process)  # metrics/routing.jsonl, aux-free bias
    if sharding == SHARD_RUNNER_CPU:
        shard_fsdp2_cpu(model, world)  # before the optimizer: it must hold the sharded parameters
    optimizer = make_optimizer(model, cfg, fused=bool(runtime.get("adamw_fused")))
    ledger = TokenLedger(data.samples, L)
    checkpointer = Checkpointer.for_run(
        run_dir, cfg.train.checkpoint, report=opts.report if acc.is_main_process else None
    )
    staging, copy = PinnedStaging.for_checkpoints(acc, cfg.hardware.distributed, model)
    runtime.update(copy.record())  # beside checkpoint_write: how the loop's copy is taken, and why
    if copy.refused and acc.is_main_process:
        opts.report(f"checkpoint copy: {copy.note}")
    startup.mark("model_build")
    return Attempt(
        exp=exp,
        acc=acc,
        opts=opts,
        folder=RunFolder(run_dir, writer=acc.is_main_process),
        say=opts.report if acc.is_main_process else (lambda msg: None),
        steps=StepPlan(
            global_batch=B,
            seq_len=L,
            micro=micro,
            accum=accum,  # e.g. 16 seq / (8 micro * 1 proc) = 2 micro steps
            schedule_steps=max_duration_tokens(cfg) // (B * L),
            warmup_steps=cfg.optim.warmup_tokens // (B * L),
            natural_end=natural_end,
            end_step=end_step,
        ),
        runtime=runtime,
        attention=applied.attention,
        records=opts.records if opts.records is not None else default_records(),
        data=data,
        model=model,
        raw_model=model,
        optimizer=optimizer,
        ledger=ledger,
        checkpointer=checkpointer,
        resolved_config=exp.to_container(),
        sharding=sharding,
        experts=probe,
        routing=routing,
        clock=RunClock(world, step_clock(acc.device)),
        staging=staging,
    )


def _resume(run: Attempt) -> None:
    """Load the newest valid checkpoint, then catch the ledger up with the journal of lost work. The checks
    that a checkpoint belongs to this run come before any state is loaded, in one place."""
    acc, ledger, data = run.acc, run.ledger, run.data
    run.info = run.folder.record()
    fingerprints = {s["fingerprint"] for s in run.info.segments} | {run.exp.fingerprint}
    ckpt = run.checkpointer.latest_valid(report=run.say)
    check_same_checkpoint(all_gather_ints(acc, ckpt.step if ckpt is not None else -1), run.folder.path)
    if run.sharding == SHARD_RUNNER_CPU:
        run.optimizer = acc.prepare(run.optimizer)  # preparing the model would wrap it in DDP too
    else:
        run.model, run.optimizer = acc.prepare(run.model, run.optimizer)
    run.raw_model = acc.unwrap_model(run.model)
    startup.mark("weights_on_device")
    if ckpt is not None:
        state = ckpt.record
        if state.fingerprint not in fingerprints:
            raise RunnerError(
                f"checkpoint {ckpt.path.name} was written by fingerprint "
                f"{str(state.fingerprint)[:12]}, not by this run's",
                file=str(run.folder.path),
            )
        try:
            ckpt.load_into(run.raw_model, run.inner_optimizer, device=startup.load_device(acc.device))
        except (ValueError, RuntimeError, KeyError) as err:  # verified files that do not fit this model
            raise RunnerError(
                f"checkpoint {ckpt.path.name} does not fit this run's model: {str(err).splitlines()[0]}",
                file=str(ckpt.path),
            ) from None
        ledger_state = ckpt.ledger_state()
        ledger.load_state_dict(ledger_state)
        if run.experts is not None:
            run.experts.load_state_dict(ledger_state, str(ckpt.path))
        set_rng_state(ckpt.state["rng"])  # every format has it: its absence is a bug, and fails the attempt
        run.start_step = ckpt.step
        run.clock.load_state_dict(state.clock)
        run.say(f"resuming from {ckpt.path.name} (step {run.start_step})")
    acc.wait_for_everyone()
    if run.main:
        run.checkpointer.clean_temporaries()
        run.folder.repair_journal()
    acc.wait_for_everyone()
    # processed survives SIGKILL through the journal: work after the checkpoint was spent, then lost.
    ledger.catch_up_processed(run.clock.replay(run.folder.journal_entries(), data.domains))
    startup.mark("checkpoint_load")
    run.runtime.update(ddp_compile_settings(run.model, run.cfg.model.compile))
    run.model = maybe_compile(run.model, run.cfg)
    startup.split("compile_wrapping")


def _conventions(run: Attempt, tracker) -> None:
    """FLOPs per token and the peak behind every MFU figure; recorded in run.json and as MLflow tags."""
    # MFU: recomputation never counted (SPEC); a mixture of experts counts active parameters.
    convention = replace(convention_for(run.cfg), recompute_counted=False)
    recorded = run.info.conventions or {}
    if str(recorded.get("peak_source", "")).startswith(("measured", "theoretical")):
        # A run keeps the CPU peak it found first: its MFU denominators never change across resumes.
        peak = hardware.Peak(float(recorded["peak_tflops"]), recorded["peak_dtype"], recorded["peak_source"], "cpu")
    else:
        peak = hardware.resolve_peak(run.cfg.hardware, measure_seconds=run.opts.peak_measure_seconds)
    startup.split("peak")
    # HFU's FLOPs: None without activation checkpointing
    run.basis = FlopsBasis(flops_per_token(run.cfg, convention), hfu_flops_per_token(run.cfg, convention), peak)
    startup.split("conventions")  # the FLOPs per token
    run.system = _system_metrics(run, tracker)
    startup.split("system_metrics")
    busy_source = run.system.monitor.busy_source if run.system is not None else "not measured (interval 0)"
    conventions = {
        **hardware.convention_record(convention, peak, run.world, "step", run.clock.step_clock.basis),
        **execution_record(run.runtime, busy_source),
    }
    hfu_fields: dict[str, Any] = {}
    if run.basis.hfu_flops_per_token is not None:
        hfu_fields = {
            "hfu_flops_per_token": run.basis.hfu_flops_per_token,
            "conventions_hfu": hardware.convention_record(
                hfu_convention(convention), peak, run.world, "step", run.clock.step_clock.basis
            ),
        }
    if run.main:
        # `devices` is what the run HELD (the world size), not the recipe's plan: MFU and cost count it.
        run.folder.update(
            status="running",
            conventions=conventions,
            runtime=run.runtime,
            world_size=run.world,
            threads=int(run.runtime["torch_threads"]),
            devices=int(run.world),
            nodes=node_count(run.world),  # this attempt's nodes (torchrun's agents)
            attempts=run.clock.attempt,
            flops_per_token=run.basis.flops_per_token,
            conventions_goodput=hardware.convention_record(convention, peak, run.world, "wall"),
            **hfu_fields,
        )
    run.tracker = tracker
    run.callbacks = _callbacks(run, tracker)
    if tracker is not None:
        tracker.log_tags(
            {
                **{f"mfu.{k}": v for k, v in conventions.items()},
                "attempts": run.clock.attempt,
                **{f"hfu.{k}": v for k, v in hfu_fields.get("conventions_hfu", {}).items()},
            }
        )


def _callbacks(run: Attempt, tracker: Tracker | None) -> list[Callback]:
    """The callbacks of this attempt, in the order they see each step: metrics files, the caller's,
    progress, system metrics, samples, MLflow and the quality targets."""
    callbacks: list[Callback] = [MetricsFiles(run.folder.path, run.main)] + list(run.opts.callbacks)
    if run.main:  # end_step is the hard stop here (--max-steps applies later): the ETA names it
        hard_stop = run.steps.end_step if run.steps.end_step < run.steps.natural_end else None
        callbacks.append(TrainingProgress(run.start_step, run.steps.natural_end, hard_stop))
    if run.system is not None:
        callbacks.append(run.system)
    sampler = samples_callback(run.exp, run.raw_model, run.acc, run.attention, run.folder.path, tracker)
    if sampler is not None:  # export.samples: every rank generates at each evaluation, rank 0 logs
        callbacks.append(sampler)
    if tracker is not None:
        callbacks.append(TrackingCallback(tracker, run.cfg.train.log_interval_steps))
        callbacks.append(TargetsCallback(tracker, run.cfg, run.folder.path, run.start_step, run.main))
    return callbacks


def _system_metrics(run: Attempt, tracker: Tracker | None) -> SystemMetricsCallback | None:
    """The sampler of device utilisation, memory, power, CPU and RAM, or None when switched off."""
    return system_callback(
        float(run.cfg.train.system_metrics_interval_seconds),
        # A simulated GPU computes on this CPU: its busy figure is the CPU's.
        "cpu" if run.acc.device.type == "cpu" else run.runtime["device_accelerator"],
        device_index=run.acc.device.index or 0,
        torch_threads=torch.get_num_threads(),
        run_dir=run.folder.path,
        rank=run.rank,
        tracker=tracker if run.main else None,
        log_interval_steps=run.cfg.train.log_interval_steps,
        report=run.say,
    )


def _train_step(run: Attempt, step: int) -> _Step:
    """Forward/backward of one global batch; each micro step's processed work is journaled as it is
    spent. The micro-step loop is the hot path: it stays in one frame."""
    acc, data, model, opts = run.acc, run.data, run.model, run.opts
    assert run.batches is not None  # made before the first step
    host = run.batches.get(step)
    x, y, mask = (t.to(acc.device, non_blocking=run.pin) for t in host.tensors)
    # Useful targets per domain of the whole global batch: the loss divisor and the ledger's useful.
    useful = all_reduce(acc, host.useful.to(acc.device)).cpu() if run.world > 1 else host.useful
    n_useful = float(useful.sum())
    lr = lr_at(step, run.cfg.optim, run.schedule_steps_at(step), run.steps.warmup_steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    processed = host.processed
    loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
    for m in range(run.steps.accum):
        sl = slice(m * run.steps.micro, (m + 1) * run.steps.micro)
        sync = contextlib.nullcontext() if m == run.steps.accum - 1 else run.no_sync()
        with sync, run.attention.context():  # model.sdpa_kernel, forward and backward
            if run.experts is None:
                # The head and the loss run inside the model's forward (model.cross_entropy picks how).
                summed = model(input_ids=x[sl], loss_targets=y[sl], loss_mask=mask[sl])
            else:  # OLMoE: transformers' model; the router probe counts each domain's routing
                run.experts.arm(host.domain_ids[sl], acc.device)
                logits = model(input_ids=x[sl]).logits
                per_token = F.cross_entropy(logits.float().flatten(0, 1), y[sl].flatten(), reduction="none")
                summed = (per_token * mask[sl].flatten()).sum()
            if opts.nonfinite_hook is not None:
                summed = opts.nonfinite_hook(step, summed)
            # x world: DDP averages gradients over ranks; we want sum / global useful.
            objective = summed * (run.world / max(n_useful, 1.0))
            if run.experts is not None:  # router losses: a mean per micro batch, so / accum (DDP averages ranks)
                objective = objective + run.experts.disarm() / run.steps.accum
            acc.backward(objective)
        loss_sum += summed.detach().double()
        run.ledger.record_processed(processed[m])
        run.clock.journal_micro(step, m, processed[m])
        if opts.kill_at_step is not None and step + 1 == opts.kill_at_step:
            run.checkpointer.writes.wait()  # the checkpoints before this step on disk: what a test finds is fixed
            (opts.fault or (lambda: os.kill(os.getpid(), signal.SIGKILL)))()
    loss = float(all_reduce(acc, loss_sum).item()) / max(n_useful, 1.0)
    clip = run.cfg.optim.grad_clip
    grad_norm = scalar(acc.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")))
    return _Step(
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        global_pairs=host.global_pairs,
        useful={d: int(useful[i]) for i, d in enumerate(data.domains)},
        useful_tokens=n_useful,
    )


def _metrics_record(
    run: Attempt, committed: int, s: _Step, step_seconds: float, counters: dict, figures: dict
) -> StepRecord:
    tokens = run.steps.tokens
    fpt, hfu_fpt, peak_tflops = run.flops.flops_per_token, run.flops.hfu_flops_per_token, run.flops.peak_tflops
    return StepRecord(
        step=committed,
        loss=s.loss,
        lr=s.lr,
        grad_norm=s.grad_norm,
        step_seconds=step_seconds,
        data_wait_seconds=run.batches.wait_seconds if run.batches is not None else 0.0,
        wall_seconds=run.clock.wall_seconds(),
        devices=run.world,
        tokens_processed=tokens,
        tokens_useful=int(s.useful_tokens),
        tokens_per_second=tokens / step_seconds,
        tokens_per_second_useful=s.useful_tokens / step_seconds,
        mfu=hardware.mfu(fpt, tokens, step_seconds, peak_tflops, run.world),
        goodput_mfu=hardware.mfu(fpt, counters["total"]["useful"], run.clock.device_wall_seconds(), peak_tflops, 1),
        exposure_tokens=int(counters["total"]["exposure"]),
        hfu=hardware.mfu(hfu_fpt, tokens, step_seconds, peak_tflops, run.world) if hfu_fpt else None,
        figures=figures,
    )


def _save(run: Attempt, step: int, wait_for_data: bool = True) -> None:
    # No checkpoint rests on a shard that differs from its pin: every rank waits for its node's hashing.
    # Except a preemption's: its grace period may be shorter than the hashing, and losing the work is
    # worse; the resumed launch verifies again (unfinished shards are not cached) before its next one.
    mine = run.data.verification_failed(run.say, wait=wait_for_data)
    failed = all_reduce(run.acc, torch.tensor([mine], device=run.acc.device))
    if failed.item() > 0:
        run.data.raise_failure()
    # The previous write done first: rank 0 holds one checkpoint in host memory at a time.
    started = time.perf_counter()
    waited = run.checkpointer.writes.wait()  # nonzero when checkpoints come faster than the disk writes them
    # Every rank: under FSDP the gather is a collective. Rank 0 receives the full state and writes it.
    # every rank the same options (rank 0 stages in pinned buffers; the others hold references, no copy)
    staged_run = run.acc.device.type == "cuda" and run.cfg.hardware.distributed != "fsdp"
    model_state, optimizer_state = gather_full_state(run.raw_model, run.inner_optimizer, to_host=not staged_run)
    if run.main:
        live = training_tensors(run.raw_model, run.inner_optimizer)
        if run.staging is not None:  # copies enqueued into pinned buffers; the writer waits for them
            staged = run.staging.stage(model_state, optimizer_state, live)
            saved = Gathered(
                step, staged.model_state, staged.optimizer_state, started, ready=staged.ready, waited=waited
            )
        else:
            saved = Gathered(step, *host_copy(model_state, optimizer_state, live), started, waited=waited)
        # checkpoint files, ledger.json, run.json (runner.training.records): taken now, written behind the loop
        write = take_records(run.records, run, saved)
        if run.checkpointer.writes.mode == "background":
            saved.resumed = time.perf_counter()
        run.checkpointer.writes.submit(write)
    run.acc.wait_for_everyone()
    run.last_saved = step


def _evaluate(run: Attempt, step: int) -> None:
    """Per-domain validation loss at `step` (none without validation shards), stamped and handed on."""
    if run.data.val_reader is None:
        return
    total = run.ledger.counters()["total"]
    started = time.perf_counter()
    with run.attention.context():
        rows = evaluate.evaluate(
            run.raw_model, run.data, run.acc, run.cfg.eval.micro_batch_sequences, step, int(total["exposure"])
        )
    run.eval_seconds["validation_seconds"] += time.perf_counter() - started
    # Where the run stood when this evaluation ended: time-to-target is recounted from these (SPEC).
    wall, device_wall = run.clock.journal_time()
    stamp = {"useful_tokens": int(total["useful"]), "wall_seconds": wall, "device_wall_seconds": device_wall}
    rows = [{**r, **stamp} for r in rows]
    for cb in run.callbacks:
        cb.on_eval(step, rows[0]["exposure_tokens"] if rows else 0, rows)
    run.last_eval = step


def train(exp, run_dir: Path, acc, tracker, opts: Options | None = None) -> int:
    """Train (or resume) the run in `run_dir`. Returns the exit code (EXIT_OK / PREEMPTED / NONFINITE).
    An exception leaves run.json `failed`, never `running` (RunFolder.failed_on_error)."""
    opts = opts or Options()
    startup.begin_train()  # `runner launch` started it at the process start; else it starts now
    with RunFolder(Path(run_dir), writer=acc.is_main_process).failed_on_error():
        run = _setup(exp, Path(run_dir), acc, opts)
        try:
            _resume(run)
            return _attempt(run, tracker)
        finally:
            if run.data.verifier is not None:
                run.data.verifier.stop()


def _attempt(run: Attempt, tracker) -> int:
    """One attempt's loop, from the resumed step to the end (or a stop): train a step, commit it,
    evaluate, then the checkpoint and stop decisions, in the order the ledger requires."""
    _conventions(run, tracker)
    startup.split("conventions")  # run.json's conventions and runtime written, the callbacks, MLflow's tags
    flag = _start_attempt(run, tracker)
    startup.split("attempt_start")  # MLflow's flush, the signals, the journal, the prefetcher started
    exit_code = EXIT_OK
    try:
        run.model.train()
        for step in range(run.start_step, run.steps.end_step):
            startup.step_begins()  # the first: t_startup ends, the first step's own clock starts
            run.clock.begin_step()
            s = _train_step(run, step)
            if not (math.isfinite(s.loss) and math.isfinite(s.grad_norm)):
                _stop_nonfinite(run, step, s)
                exit_code = EXIT_NONFINITE
                break
            committed = _commit(run, step, s)
            startup.step_done()
            if run.cfg.eval.interval_steps and committed % run.cfg.eval.interval_steps == 0:
                _evaluate(run, committed)
            downstream.at_step(run, committed)  # at eval.downstream_interval_steps and the segment's last step
            if _checkpoint_or_stop(run, committed, flag) == EXIT_PREEMPTED:
                exit_code = EXIT_PREEMPTED
                break
        else:
            if run.last_eval != run.steps.end_step:
                _evaluate(run, run.steps.end_step)
            if run.last_saved != run.steps.end_step:
                _save(run, run.steps.end_step)
    finally:
        _end_attempt(run, flag)
    _finish(run, exit_code)
    if flag.deadline is not None:  # the attempt's end is recorded: the launch's last barrier waits as any other
        flag.deadline.cancel()
    return exit_code


def _start_attempt(run: Attempt, tracker) -> StopFlag:
    """MLflow started, the stop signals caught, the journal opened and the batches prefetched."""
    if tracker is not None:
        # MLflow's start-up (import, a new store's tables, the run) before the first step, not
        # during the first steps: on the delivery thread it holds the GIL for seconds. In its own
        # process (runner.training.mlflow_child) it began before torch's import: little is left.
        tracker.flush(timeout=START_WAIT_SECONDS)
    startup.tracking(tracker.where if tracker is not None and tracker.enabled else None)
    flag = StopFlag()
    flag.old_handlers = {s: signal.signal(s, flag) for s in (signal.SIGTERM, signal.SIGINT)}
    flag.deadline = _stop_deadline(run)
    run.clock.start_attempt(open(run.folder.journal_path(), "a") if run.main else None, startup.elapsed())
    run.last_saved = run.last_eval = run.start_step
    if run.opts.max_steps is not None:
        run.steps.end_step = min(run.steps.end_step, run.start_step + int(run.opts.max_steps))
    run.batches = Prefetcher(
        lambda step: read_step(run.data, step, run.world, run.steps.accum, run.steps.micro, run.rank, run.pin),
        run.start_step,
        run.steps.end_step,
        run.cfg.train.prefetch_batches,
    )
    return flag


def _stop_deadline(run: Attempt) -> StopDeadline | None:
    """With other ranks a stop is bounded (StopDeadline); its line names the checkpoint that stands."""
    if run.world == 1 or threading.current_thread() is not threading.main_thread():
        return None

    def line(seconds: float) -> str:
        sealed = [p.name for p in run.checkpointer.candidates() if (p / MARKER).exists()]
        return (
            f"stopped by signal, but the stop did not finish within {STOP_TIMEOUT_KEY} = {seconds:g} s (a rank "
            f"is gone or hung): exiting; the newest checkpoint, {sealed[0] if sealed else 'none'}, is what "
            f"`runner launch {run.folder.path}` resumes"
        )

    return StopDeadline(run.cfg.train.checkpoint.stop_timeout_seconds, line)


def _end_attempt(run: Attempt, flag: StopFlag) -> None:
    assert run.batches is not None
    run.batches.close()
    try:
        run.checkpointer.writes.wait()  # the last checkpoint sealed (its error raised), in the attempt's wall
    finally:
        if flag.deadline is not None:  # the stop's bound holds until the last write is sealed
            flag.deadline.close()
        for sig, handler in flag.old_handlers.items():
            signal.signal(sig, handler)
        run.clock.end_attempt()  # the attempt's whole wall, for the next resume (a kill loses only the tail)


def _stop_nonfinite(run: Attempt, step: int, s: _Step) -> None:
    run.optimizer.zero_grad(set_to_none=True)
    candidates = run.checkpointer.candidates()
    run.say(
        f"non-finite loss at step {step + 1} (loss={s.loss}, grad_norm={s.grad_norm}); stopped, "
        f"step not committed; last good checkpoint: {candidates[0].name if candidates else 'none'}"
    )


def _commit(run: Attempt, step: int, s: _Step) -> int:
    """The optimizer step and the ledger's commit, the invariants checked, the step record handed to
    the callbacks. Returns the committed step count."""
    if run.staging is not None:  # on the device: after the last checkpoint's copies, no host wait
        run.staging.before_optimizer_step()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.ledger.commit(s.global_pairs, s.useful)
    figures = run.experts.commit(run.acc) if run.experts is not None else {}
    committed = step + 1
    if run.routing is not None and run.experts is not None and run.experts.last_step is not None:
        figures |= run.routing.commit(committed, run.experts.last_step.sum(axis=1))  # the bias update
    step_seconds = run.clock.end_step()  # the device's clock: the optimizer's kernels done
    # SPEC: invariants 1-5 hold after every committed step; a violation is a bug, never data.
    mix = run.cfg.mixture.domains
    ratios = {d: mix[d].target_ratio for d in run.data.domains}
    caps = {d: mix[d].max_repetition_ratio for d in run.data.domains}
    broken = run.ledger.check_invariants(run.steps.global_batch, run.steps.seq_len, committed, ratios, caps)
    if broken:
        raise RuntimeError(f"token accounting broke at step {committed}: " + "; ".join(broken))
    counters = run.ledger.counters()
    if run.experts is not None:  # SPEC: per layer and domain, routed = exposure x k
        broken = run.experts.load.broken_invariant({d: counters[d]["exposure"] for d in run.data.domains})
        if broken:
            raise RuntimeError(f"expert load broke at step {committed}: " + "; ".join(broken[:4]))
    for source in run.opts.step_figures:  # a new per-step figure: one source there (Options.step_figures)
        figures |= source(run, committed)
    record = _metrics_record(run, committed, s, step_seconds, counters, figures)
    for cb in run.callbacks:
        cb.on_step(record, counters, run.ledger.realized_ratios())
    return committed


def _checkpoint_or_stop(run: Attempt, committed: int, flag: StopFlag) -> int:
    """Save when the checkpointer's interval is due, stop (saving) on a signal, fail on a shard that
    differs from its pin. Minutes-based intervals differ per rank's clock: rank 0 decides for all."""
    due = Decisions.agreed(
        run.acc,
        checkpoint=run.main and run.checkpointer.due(committed),
        stop=flag.signum is not None,
        data_failed=run.data.verification_failed(run.say, wait=False),
    )
    if due.data_failed:
        run.data.raise_failure()
    if due.stop:
        _save(run, committed, wait_for_data=False)
        run.say(
            f"stopped by signal at step {committed}; checkpoint saved, resume with `runner launch {run.folder.path}`"
        )
        return EXIT_PREEMPTED
    if due.checkpoint and committed < run.steps.end_step:
        _save(run, committed)
    return EXIT_OK


def _finish(run: Attempt, exit_code: int) -> None:
    """The attempt's summary: run.json status and totals, ledger.json, and the callbacks' on_end."""
    committed = run.last_saved
    if exit_code == EXIT_NONFINITE:
        committed = _rollback_to_last_checkpoint(run)
    counters = run.ledger.counters()
    clock = run.clock
    wall_seconds, device_wall_seconds = clock.wall_seconds(), clock.device_wall_seconds()
    useful_total = int(counters["total"]["useful"])
    finished = exit_code == EXIT_OK and run.last_saved == run.steps.natural_end
    status = {EXIT_NONFINITE: "failed", EXIT_PREEMPTED: "preempted"}.get(
        exit_code, "finished" if finished else "preempted"
    )
    summary = {
        "committed_steps": committed,
        "wall_seconds": wall_seconds,
        "step_seconds_total": clock.step_seconds_total,
        "device_wall_seconds": device_wall_seconds,
        "device_step_seconds_total": clock.device_step_seconds_total,
        "exposure_tokens": int(counters["total"]["exposure"]),
        "useful_tokens": useful_total,
        "processed_tokens": int(counters["total"]["processed"]),
        "lost_tokens": int(counters["total"]["lost"]),
    }
    if useful_total and clock.step_seconds_total:
        summary |= hardware.run_efficiency(
            run.flops.flops_per_token,
            run.flops.hfu_flops_per_token or None,
            counters["total"]["processed"],
            useful_total,
            clock.device_step_seconds_total,
            device_wall_seconds,
            run.flops.peak_tflops,
            run.cfg.hardware.price_per_device_hour_usd,
        ).to_dict()
    system = None
    if run.system is not None:
        system = close_and_summarize(run.system, run.acc.wait_for_everyone, run.main)
    if system is not None and system["device_busy"] is not None:
        summary["device_busy"] = system["device_busy"]
    if run.main:
        for record in run.records:  # ledger.json, run.json (runner.training.records)
            record.at_end(run, committed, status, summary, system)
    ratios = run.ledger.realized_ratios()
    for cb in run.callbacks:
        cb.on_end(summary, counters, ratios)


def _rollback_to_last_checkpoint(run: Attempt) -> int:
    """After a non-finite stop the run's lineage is its last good checkpoint (what a relaunch resumes
    from): steps committed in memory after it are discarded, so their exposure becomes lost work.
    The ledger is reset to that checkpoint's, keeping every processed token. Returns its step."""

    spent = {d: int(c["processed"]) for d, c in run.ledger.counters().items() if d != "total"}
    ledger = TokenLedger(run.data.samples, run.steps.seq_len)
    ckpt = run.checkpointer.latest_valid(report=run.say)
    state = ckpt.ledger_state() if ckpt is not None else None
    if state is not None:
        ledger.load_state_dict(state)
    if run.experts is not None:  # the expert load rolls back with the ledger (zero without a checkpoint)
        run.experts.load_state_dict(state, str(run.folder.path))
    ledger.catch_up_processed(spent)
    run.ledger = ledger
    return ckpt.step if ckpt is not None else 0
