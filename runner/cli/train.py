"""CLI for training: `runner launch`, `runner smoke`, `runner sync`.

Owns: choosing the run folder (its records are runner.runs.folder's), the accelerate set-up, the MLflow
run's start/finish, the terminal summary, and the smoke test's kill-and-resume comparison. The loop
is runner.training.loop's; never trains or counts tokens here. Verbs import what they call when
they run (runner.cli's rule: `runner --help` stays fast).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import EXIT_DISCREPANCY, EXIT_NONFINITE, EXIT_OK, RunnerError, display_path
from runner.fsio import read_json, read_jsonl

if TYPE_CHECKING:
    from runner.config.load import Experiment
    from runner.config.schema import ExperimentSchema
    from runner.runs.folder import RunFolder
    from runner.training.tracking import Tracker


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="train an experiment, or resume/extend a run folder")
    p.add_argument("target", help="experiments/NAME.yaml, or an existing run folder to resume")
    p.add_argument(
        "--run-dir",
        default=None,
        help="run folder (default runs/<experiment>/<timestamp>); resumed when it holds a run",
    )
    p.add_argument("--run-name", default=None, help="run id / MLflow run name (default: a timestamp)")
    p.add_argument(
        "--extend-to",
        type=_tokens,
        default=None,
        metavar="TOKENS",
        help="raise max_duration and exposure of a finished run to TOKENS (a new segment)",
    )
    p.add_argument("--max-steps", type=int, default=None, help="stop after N steps in this attempt (tests)")
    p.add_argument("--no-tracking", action="store_true", help="do not log to MLflow (smoke, bench)")
    p.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)  # fault injection
    # fault injection under torchrun, RESTART:RANK:STEP:MODE (repeatable): where the agent's restart count
    # (TORCHELASTIC_RESTART_COUNT: failures, not rejoins) is RESTART, global rank RANK, mid-step STEP, MODE kill
    # (SIGKILL itself) | hang (gone with its connections open, as a lost node's: a child holds them until the
    # agent exits) | gone (its agent killed too)
    p.add_argument("--fault", action="append", default=[], help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_launch)

    s = subparsers.add_parser(
        "smoke",
        help="a few steps of an experiment: NaN check, kill+resume "
        "identity, measured tokens/s, MFU and the full run's re-estimated time and cost",
    )
    s.add_argument("experiment", help="experiments/NAME.yaml to smoke-test")
    s.add_argument("--steps", type=int, default=20, help="steps of each smoke run (at least 4; default 20)")
    s.add_argument("--out", default=None, help="folder for the smoke runs (default runs/<exp>/smoke-<ts>)")
    s.set_defaults(func=cmd_smoke)

    y = subparsers.add_parser("sync", help="send a run's pending MLflow journal")
    y.add_argument("run_dir", help="the run folder whose journal/mlflow-pending.jsonl to send")
    y.add_argument(
        "--tracking-uri",
        default=None,
        metavar="URI",
        help="send to this MLflow server (one that moved) and record it in run.json; "
        "default: $MLFLOW_TRACKING_URI, else the URI in run.json",
    )
    y.set_defaults(func=cmd_sync)


def _tokens(text: str) -> int:
    value = float(text.replace("_", ""))
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole number of tokens: {text}")
    return int(value)


def _timestamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


# ---- launch -------------------------------------------------------------------------------------


def make_accelerator(cfg: ExperimentSchema):
    from accelerate import Accelerator

    from runner.training.accelerator import accelerate_mixed_precision, ddp_kwargs_handlers, fsdp_plugin, sharding_mode

    acc = Accelerator(
        cpu=cfg.hardware.accelerator == "cpu",
        mixed_precision=accelerate_mixed_precision(cfg.hardware),
        fsdp_plugin=fsdp_plugin(cfg.hardware),  # FSDP2 under accelerate launch: fp32 gradient reduction
        kwargs_handlers=ddp_kwargs_handlers(),
    )
    sharding_mode(cfg.hardware, acc)  # a recipe/accelerate mismatch fails here, before any folder is written
    return acc


def _resolve(args) -> tuple[Experiment, Path | None, bool]:
    """(experiment, run folder or None for a new default one, whether the folder holds a run)."""
    from runner.planning.resources import load_experiment
    from runner.runs.folder import check_same_experiment, is_run_dir
    from runner.training.launch import checked_experiment_of_run

    target = Path(args.target)
    if target.is_dir():
        if not is_run_dir(target):
            raise RunnerError("not a run folder (no run.json / experiment.yaml)", file=str(target))
        if args.run_dir and Path(args.run_dir).resolve() != target.resolve():
            raise RunnerError("give either a run folder or --run-dir, not two different folders", file=str(target))
        return checked_experiment_of_run(target), target, True
    exp = load_experiment(target)
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is not None and is_run_dir(run_dir):
        check_same_experiment(exp, run_dir)
        return exp, run_dir, True
    return exp, run_dir, False


def _tracker_of(folder: RunFolder, tracking_uri: str | None, **kwargs) -> Tracker:
    """The Tracker continuing the MLflow run recorded in run.json, recording it there when the URI
    it tracks to is not the one recorded (a first launch, or a server that moved). URIs are recorded
    absolute; a SQLite store that run.json says holds the run but is gone is refused, not recreated."""
    from runner.training.tracking import Tracker, check_run_store

    saved = folder.record().mlflow
    tracker = Tracker(
        folder.path,
        tracking_uri=tracking_uri or saved.get("tracking_uri"),
        run_id=saved.get("run_id"),
        experiment_id=saved.get("experiment_id"),
        on_run_id=lambda info: folder.update(mlflow=info),
        **kwargs,
    )
    check_run_store(tracker.tracking_uri, tracker.run_id, folder.run_json)
    if tracker.tracking_uri != saved.get("tracking_uri"):
        folder.update(mlflow=tracker.info())
    return tracker


def _check_recorded_store(run_dir: Path) -> None:
    from runner.runs.folder import RunFolder
    from runner.training.tracking import absolute_uri, check_run_store

    saved = RunFolder(run_dir).record().mlflow
    if saved.get("tracking_uri"):
        check_run_store(absolute_uri(saved["tracking_uri"]), saved.get("run_id"), run_dir / "run.json")


def _make_tracker(run_dir: Path, main: bool) -> Tracker:
    from runner.runs.folder import RunFolder

    return _tracker_of(RunFolder(run_dir, writer=main), None, enabled=main, report=lambda m: print(m, file=sys.stderr))


def _tags(exp: Experiment, run_dir: Path) -> dict:
    from runner.training.tracking import git_commit

    cfg = exp.config
    tags = {
        "fingerprint": exp.fingerprint,
        "run_dir": str(run_dir.resolve()),
        "tokenizer.sha256": cfg.tokenizer.sha256,
        "git_commit": git_commit(exp.project_root) or "none",
    }
    tags.update({f"recipe.{k}": v for k, v in cfg.recipes.items()})
    tags.update({f"manifest.{d}.sha256": pin.sha256 for d, pin in cfg.data.manifests.items()})
    return tags


def _error_file(args) -> str:
    target = Path(args.target)
    return display_path(target / "experiment.yaml" if target.is_dir() else target)


def cmd_launch(args) -> int:
    try:
        with contextlib.ExitStack() as held:  # the run folder's lock, released on any way out
            return _launch(args, held)
    except RunnerError as e:
        if e.file or str(e).startswith(f"{_error_file(args)}: "):  # Problems' lines name their file already
            raise
        # `file: dotted.key: message`: a launch error without a file is about the experiment.
        raise type(e)(e.detail, file=_error_file(args), key=e.key) from e


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _finished_line(run_dir: Path) -> str | None:
    """The no-op line for a finished run relaunched without --extend-to, else None."""
    from runner.runs.folder import RunFolder

    info = RunFolder(run_dir).record()
    if info.status != "finished":
        return None
    return (
        f"run {run_dir}: already finished at step {int(info.committed_steps)} "
        f"(exposure {int(info.exposure_tokens or 0):,} tokens); extend it with --extend-to TOKENS"
    )


def check_world(cfg: ExperimentSchema, world: int) -> str | None:
    """Refuse a global batch that does not split over `world` processes; the warning line when the
    processes held differ from the recipe's plan (None when they agree)."""
    from runner.config.rules import devices, grad_accum

    grad_accum(cfg, world)
    planned = devices(cfg)
    if world == planned:
        return None
    return (
        f"warning: running on {world} devices (world size) but the hardware recipe plans {planned} "
        f"(devices_per_node x nodes); MFU, goodput MFU and cost count the {world} held"
    )


@contextlib.contextmanager
def _owning(run_dir: Path, acc, command: str = "runner launch"):
    """Rank 0 holds the run folder's lock (runner.runs.lock.RunLock) for the whole launch; every rank
    learns whether it got it, so a refused launch stops everywhere before anything is written."""
    from accelerate.utils import broadcast_object_list

    from runner.runs.lock import RunLock

    lock = None
    refused: list[tuple[str, str | None] | None] = [None]
    if acc.is_main_process:
        try:
            lock = RunLock(run_dir, command).__enter__()
        except RunnerError as e:
            refused = [(e.detail, e.file)]
    if acc.num_processes > 1:
        broadcast_object_list(refused)
    if refused[0] is not None:
        raise RunnerError(refused[0][0], file=refused[0][1])
    if acc.num_processes > 1:
        _check_same_folder(run_dir, lock.held() if lock is not None else None)
    try:
        for line in lock.warnings if lock is not None else []:
            print(line, file=sys.stderr)
        yield
    finally:
        if lock is not None:
            lock.release()


def _check_same_folder(run_dir: Path, held: dict | None) -> None:
    """Every rank must see the run folder rank 0 locked (shared storage): each reads the lock's
    record there and compares it with rank 0's. A node with its own copy (or none) would resume from
    another checkpoint or write beside the run; all ranks refuse with the same line, before training."""
    import torch.distributed as dist

    from runner.runs.lock import lock_records

    mine: list = [held]
    dist.broadcast_object_list(mine, src=0)
    sees = bool(mine[0]) and mine[0] in lock_records(run_dir)
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (sees, os.environ.get("GROUP_RANK", "0")))
    blind = [f"rank {r} (node {node})" for r, (ok, node) in enumerate(views) if not ok]
    if blind:
        raise RunnerError(
            f"ranks see different run folders: the folder rank 0 locked is not the one {', '.join(blind)} sees; "
            "the run folder must be on storage every node shares (same path from the launch directory)",
            file=str(run_dir),
        )


def _launch(args, held: contextlib.ExitStack) -> int:
    """`runner launch` on every rank, in the order its refusals must come: the target and world
    checked, the folder chosen and locked, records written, MLflow started, the loop run, the report
    and summary written. Each step may refuse before the next writes anything."""
    exp, run_dir, existing = _resolve(args)
    if existing and args.extend_to is None:
        assert run_dir is not None  # a run folder found is a folder named
        line = _finished_line(run_dir)
        if line is not None:  # nothing to do: touch nothing (no peak re-measure, report, MLflow, torch import)
            if _is_rank0():
                print(line)
            return EXIT_OK
    from runner.training.launch import extend_run
    from runner.training.loop import Options, train

    if existing and run_dir is not None and not args.no_tracking:  # before anything is written: a lost store is refused
        _check_recorded_store(run_dir)
    if args.extend_to is not None:
        if not existing or run_dir is None:
            raise RunnerError("--extend-to needs an existing run folder", key="--extend-to")
        exp = extend_run(run_dir, args.extend_to, write=False)  # validate on every rank before any write
    acc = make_accelerator(exp.config)
    main = acc.is_main_process
    warning = check_world(exp.config, acc.num_processes)  # before any folder is written
    if warning and main:
        print(warning, file=sys.stderr)
    run_dir = _claim_folder(args, exp, run_dir, existing, acc, held)
    tracker = None if args.no_tracking else _start_tracking(args, exp, run_dir, existing, main)
    kill, fault = _fault(args.fault, acc.process_index) if args.fault else (args.kill_at_step, None)
    opts = Options(max_steps=args.max_steps, report=lambda m: print(m, file=sys.stderr), kill_at_step=kill, fault=fault)
    try:
        code = train(exp, run_dir, acc, tracker, opts)
    except BaseException:
        if tracker is not None:  # what the delivery thread still holds reaches MLflow, or stays journaled
            tracker.flush()
            tracker.close()
        raise
    if main:
        _close_run(exp, run_dir, tracker)
    acc.wait_for_everyone()
    acc.end_training()
    return code


def _fault(faults: list[str], rank: int):
    """--fault's step and action for this rank at its agent's restart count (None, None: none)."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for spec in faults:
        at_restart, at_rank, step, mode = spec.split(":")
        if (int(at_restart), int(at_rank)) == (restarts, rank):
            return int(step), functools.partial(_inject, mode)
    return None, None


def _inject(mode: str) -> None:
    agent = os.getppid()
    if mode == "gone":
        os.kill(agent, signal.SIGKILL)
    elif mode == "hang" and os.fork() == 0:  # the child holds this process's sockets, silent, until the agent exits
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # not the agent's output pipes: whoever reads them sees the end when the agent ends
            os.dup2(devnull, fd)
        while _running(agent):
            time.sleep(0.2)
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie its parent has yet to reap: Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _claim_folder(args, exp: Experiment, run_dir: Path | None, existing: bool, acc, held: contextlib.ExitStack) -> Path:
    """The run folder chosen (ranks agree on one), locked for this launch, and its records written (rank 0):
    created, extended, or given the experiment's new operational keys. Every rank returns after rank 0 wrote."""
    from accelerate.utils import broadcast_object_list

    from runner.config.load import to_yaml
    from runner.data.manifest import launch_warnings
    from runner.runs.folder import create_run_folder, is_run_dir
    from runner.training.launch import check_mixture_feasible, extend_run

    main = acc.is_main_process
    if run_dir is None:
        name = args.run_name or _timestamp()
        chosen = [str(Path("runs") / exp.config.name / name)]
        if acc.num_processes > 1:
            broadcast_object_list(chosen)  # ranks must agree on one timestamped folder
        run_dir = Path(chosen[0])
    if main and not existing:
        check_mixture_feasible(exp)  # before the lock: a refused experiment writes nothing
    held.enter_context(_owning(run_dir, acc))
    if main:
        if args.extend_to is not None:
            extend_run(run_dir, args.extend_to, write=True)
        elif not existing:
            if is_run_dir(run_dir):
                raise RunnerError(
                    "became a run while this launch started (another launch); launch again to resume it",
                    file=str(run_dir),
                )
            create_run_folder(exp, run_dir, args.run_name or run_dir.name)
        elif args.target != str(run_dir):
            # Same fingerprint, maybe other operational keys (checkpoint interval, hard stop): use them.
            (run_dir / "experiment.yaml").write_text(to_yaml(exp.config))
        for line in launch_warnings(exp):  # after the refusals: a launch that will not run warns of nothing
            print(f"warning: {line}", file=sys.stderr)
    acc.wait_for_everyone()
    return run_dir


def _start_tracking(args, exp: Experiment, run_dir: Path, existing: bool, main: bool) -> Tracker:
    """The MLflow run started or resumed: params and the experiment.yaml artifact on the first start only,
    the new segment's tags after an --extend-to."""
    from runner.runs.folder import RunFolder
    from runner.training.tracking import flatten

    tracker = _make_tracker(run_dir, main)
    first_start = not existing
    tracker.start(
        exp.config.name,
        RunFolder(run_dir).read()["run_id"],
        params=flatten(exp.to_container()) if first_start else None,
        tags=_tags(exp, run_dir),
        artifacts=[run_dir / "experiment.yaml"] if first_start else [],
    )
    if args.extend_to is not None:
        seg = RunFolder(run_dir).record().segments[-1]
        tracker.log_tags({f"segment.{seg['index']}.{k}": v for k, v in seg.items() if k != "index"})
    return tracker


def _close_run(exp: Experiment, run_dir: Path, tracker: Tracker | None) -> None:
    """Rank 0 after the loop: the report when the run ended as the user chose (finished, or at its hard
    stop), the MLflow run's end, the summary, and the export the experiment asks for at its end."""
    from runner.config.rules import global_batch_tokens
    from runner.runs.folder import RunFolder

    info = RunFolder(run_dir).record()
    status = info.status
    hard_stop = exp.config.train.hard_stop_tokens
    at_hard_stop = hard_stop is not None and info.committed_steps * global_batch_tokens(exp.config) == hard_stop
    if status == "finished" or at_hard_stop:  # the run's end as the user chose it: report it
        if tracker is not None:  # the MLflow run id reaches run.json (delivery is asynchronous) before the copy
            tracker.flush()
        _write_report(run_dir, tracker)
    if tracker is not None:
        done = tracker.finish({"finished": "FINISHED", "failed": "FAILED"}.get(str(status), "KILLED"))
        if not done:
            print(f"mlflow: some data is still pending; send it with `runner sync {run_dir}`", file=sys.stderr)
    print(f"run {run_dir}: {status}")
    _print_summary(run_dir)
    if status == "finished" and exp.config.export.at_end:
        _export_at_end(run_dir, exp)


def _print_summary(run_dir: Path) -> None:
    """What a user wants on the terminal after a run: the counters, losses, speed and where things are."""
    from runner.runs.folder import RunFolder

    info = RunFolder(run_dir).record()
    ledger_path = run_dir / "ledger.json"
    if ledger_path.exists():
        total = read_json(ledger_path)["counters"]["total"]
        print(
            "  tokens: " + "  ".join(f"{k} {total[k]:,}" for k in ("processed", "exposure", "useful", "unique", "lost"))
        )
    last = {row["domain"]: row for row in read_jsonl(run_dir / "metrics" / "eval.jsonl")}
    if last:
        print(
            "  validation loss nats / bpb: "
            + "  ".join(f"{d} {r['loss_nats']:.3f} / {r['bpb']:.3f}" for d, r in sorted(last.items()))
        )
    conv = info.conventions or {}
    if info.mfu is not None:
        hfu = f"HFU {info.hfu:.1%} (recomputed forward counted); " if info.hfu is not None else ""
        # the peak's source in a few words (`theoretical: 1 cores x 2.596 GHz x 64 fp32 FLOP/cycle`): its
        # whole derivation is report.md's convention table, not a 150-character terminal sentence
        source = str(conv.get("peak_source")).split(" (", 1)[0]
        print(
            f"  MFU {info.mfu:.1%} ({conv.get('flops_formula')}, params {conv.get('params_counted')}, "
            f"{conv.get('time_basis')} time, peak {conv.get('peak_tflops'):.4g} TFLOP/s {conv.get('peak_dtype')}: "
            f"{source}); goodput MFU {info.goodput_mfu or 0:.1%}; {hfu}"
            f"${info.cost_per_billion_useful_tokens or 0:,.2f} per billion useful tokens"
        )
    if (run_dir / "report" / "targets.parquet").exists():
        from runner.reports.targets import summary_lines

        for line in summary_lines(run_dir / "report"):
            print(f"  target {line}")
    if (run_dir / "report" / "report.md").exists():
        print(f"  report: {run_dir / 'report' / 'report.md'}  (check it: runner audit {run_dir})")
    ml = info.mlflow
    if ml.get("run_id"):
        print(
            f"  mlflow: run {ml['run_id']} in {ml.get('tracking_uri')}  (browse: mlflow ui --backend-store-uri {ml.get('tracking_uri')})"
        )


def _export_at_end(run_dir: Path, exp: Experiment) -> None:
    """`export.at_end`: the finished run's final checkpoint exported and verified; a refusal is said
    and leaves the run as it finished (its exit status is the training's)."""
    from runner.export.export import export_at_end

    try:
        done = export_at_end(run_dir, exp, say=lambda line: print(line, file=sys.stderr))
    except RunnerError as e:
        print(f"export: not written ({e})", file=sys.stderr)
        return
    if done is not None:
        print(
            f"  export: {display_path(done.out)} ({done.dtype}, verified; card {display_path(done.out / 'README.md')})"
        )


def _write_report(run_dir: Path, tracker: Tracker | None) -> None:
    from runner.reports.audit.evidence import record_evidence, write_report_with_evidence

    try:
        out, evidence = write_report_with_evidence(run_dir)
        record_evidence(
            run_dir, tracker, evidence
        )  # table/config/checkpoint hashes as MLflow tags: what the audit trusts
    except RunnerError as e:
        print(f"report: not written ({e})", file=sys.stderr)
        return
    if tracker is not None:
        tracker.log_artifacts(Path(out), "report")


def cmd_sync(args) -> int:
    from runner.runs.folder import RunFolder, is_run_dir
    from runner.runs.lock import RunLock

    run_dir = Path(args.run_dir)
    if not is_run_dir(run_dir):
        raise RunnerError("not a run folder (no run.json / experiment.yaml)", file=str(run_dir))
    # A server that moved is recorded in run.json: later resumes and syncs go there.
    with RunLock(run_dir, "runner sync"):  # a launch sending the same journal would send it twice
        tracker = _tracker_of(
            RunFolder(run_dir), args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"), report=lambda m: None
        )
        sent, left = tracker.sync()
    line = f"{run_dir}: sent {sent} pending MLflow entries to {tracker.tracking_uri}; "
    if not left:
        print(line + "none left")
        return EXIT_OK
    print(
        line + f"{left} still pending in {run_dir / 'journal' / 'mlflow-pending.jsonl'} ({tracker.last_error}); "
        f"retry with `runner sync {run_dir}` (or --tracking-uri URI)"
    )
    return EXIT_DISCREPANCY


# ---- smoke --------------------------------------------------------------------------------------


def format_hours(hours: float) -> str:
    """A wall time in a unit that fits: minutes under 2 h, hours under 48 h, else days."""
    hours = float(hours)
    if hours < 2:
        return f"{hours * 60:.1f} min"
    if hours < 48:
        return f"{hours:.2f} h"
    return f"{hours / 24:.1f} days"


def _launch_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "runner", "launch", str(run_dir), "--no-tracking", *extra]


def cmd_smoke(args) -> int:
    """`runner smoke`: one short run killed and resumed against one uninterrupted, compared bit for bit on
    a CPU and within a stated tolerance on a GPU (runner.runs.resume_identity)."""
    from runner.planning.resources import load_experiment

    full = load_experiment(args.experiment)
    cfg = full.config
    steps = max(4, args.steps)
    out = Path(args.out) if args.out else Path("runs") / cfg.name / f"smoke-{_timestamp()}"
    ref, res = _smoke_folders(full, steps, out)
    print(f"smoke: {steps} steps of {cfg.name} x2 in {out}")
    rc = subprocess.run(_launch_cmd(ref)).returncode
    if rc != EXIT_OK:
        print(f"smoke: FAILED: reference run exited {rc}" + (" (non-finite loss)" if rc == EXIT_NONFINITE else ""))
        return rc or EXIT_DISCREPANCY
    kill_at = steps // 2 + 1  # one step past the forced checkpoint at steps // 2
    killed = subprocess.run(_launch_cmd(res, "--kill-at-step", str(kill_at))).returncode
    rc = subprocess.run(_launch_cmd(res)).returncode
    problems = []
    if killed != -signal.SIGKILL:
        problems.append(f"fault injection did not kill the run (exit {killed})")
    if rc != EXIT_OK:
        problems.append(f"resumed run exited {rc}")
    identity, differences = _smoke_differences(ref, res, steps, str(cfg.hardware.accelerator))
    problems += differences
    rows = read_jsonl(ref / "metrics" / "train.jsonl")
    steady = rows[2:] or rows
    tps = statistics.median(r["tokens_per_second"] for r in steady)
    mfu = statistics.median(r["mfu"] for r in steady)
    lost = read_json(res / "ledger.json")["counters"]["total"]["lost"]
    print(f"smoke: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, all finite")
    print(f"smoke: kill at step {kill_at} + resume: weights {identity.describe()}, lost tokens {lost}")
    print(f"smoke: measured {tps:,.0f} tokens/s, MFU {mfu:.2%} (median of steps 3..{steps})")
    _print_smoke_plan(full, ref)
    for p in problems:
        print(f"smoke: FAILED: {p}")
    return EXIT_DISCREPANCY if problems else EXIT_OK


def _smoke_folders(full: Experiment, steps: int, out: Path) -> tuple[Path, Path]:
    """The reference and resumed run folders (emptied first) of `steps` steps of `full`, checkpointed at
    steps // 2 and at the end, evaluated once."""
    from runner.config.load import experiment_from_dict
    from runner.runs.folder import create_run_folder

    B, L = full.config.train.global_batch_sequences, full.config.train.seq_len
    small = full.to_container()
    small["train"].update(exposure_tokens=steps * B * L, max_duration_tokens=steps * B * L, hard_stop_tokens=None)
    small["train"]["checkpoint"].update(interval_steps=steps // 2, interval_minutes=0, keep_last=2)
    small["eval"].update(interval_steps=steps)
    exp = experiment_from_dict(small, project_root=full.project_root, path=full.path)
    ref, res = out / "reference", out / "resumed"
    for d in (ref, res):
        if d.exists():
            shutil.rmtree(d)
        create_run_folder(exp, d, d.name)
    return ref, res


def _smoke_differences(ref: Path, res: Path, steps: int, accelerator: str):
    """(weight identity, problems): the final weights, the ledger's counters and the expert load of the
    resumed run against the uninterrupted one."""
    from runner.runs.resume_identity import compare_weights
    from runner.training.checkpoint import dirname

    problems = []
    final = dirname(steps)
    a, b = ref / "checkpoints" / final / "model.safetensors", res / "checkpoints" / final / "model.safetensors"
    identity = compare_weights(a, b, accelerator)
    if not identity.ok:
        problems.append(f"weights after kill+resume differ from the uninterrupted run: {identity.describe()}")
    la, lb = (read_json(d / "ledger.json")["counters"] for d in (ref, res))
    for d in la:
        for k in ("exposure", "useful", "unique"):
            if la[d][k] != lb[d][k]:
                problems.append(f"ledger {d}.{k}: {la[d][k]} uninterrupted vs {lb[d][k]} resumed")
    ea, eb = (d / "expert_load.json" for d in (ref, res))  # a mixture of experts' routing, committed steps only
    if ea.exists() and (not eb.exists() or read_json(ea)["routed_tokens"] != read_json(eb)["routed_tokens"]):
        problems.append("expert load after kill+resume differs from the uninterrupted run")
    return identity, problems


def _print_smoke_plan(full: Experiment, ref: Path) -> None:
    """The full run's time and cost at the smoke's measured MFU, then at the recipe's assumed one."""
    from runner.planning.plan import build_plan
    from runner.reports.planning_inputs import read_calibration

    cfg = full.config
    try:
        plan = build_plan(cfg, calibration=read_calibration(ref, cfg), root=full.project_root)
        t = plan["time"]
        # The assumed MFU is the hardware recipe's default_mfu: a guess until a run calibrates it, which
        # on a CPU can be 10x off (20% assumed, 1.65% measured), so the measured line comes first.
        print(
            f"full run ({cfg.train.exposure_tokens:,} tokens): at this smoke's measured MFU {t['measured']['mfu']:.1%}: "
            f"{format_hours(t['measured']['wall_hours'])}, ${t['measured']['cost_usd']:,.2f} "
            f"(`runner plan {display_path(full.path)} --calibrate {ref}` says the same); at the recipe's assumed MFU "
            f"{t['assumed']['mfu']:.0%} (a guess, hardware.default_mfu): {format_hours(t['assumed']['wall_hours'])}, "
            f"${t['assumed']['cost_usd']:,.2f}"
        )
    except RunnerError as e:
        print(f"smoke: no plan comparison ({e})")
