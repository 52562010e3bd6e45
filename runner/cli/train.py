"""CLI for training: `runner launch`, `runner smoke`, `runner sync`.

Owns: parsing `runner launch` into a request (the launch itself, from the target to the loop, is
runner.training.launch's), what follows a launch on rank 0 (the report, the MLflow run's end, the
terminal summary, the export at the end), and the smoke test's kill-and-resume comparison. Never
trains or counts tokens here. Verbs import what they call when
they run (runner.cli's rule: `runner --help` stays fast).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runner.cli.argtypes import positive_int
from runner.errors import EXIT_DISCREPANCY, EXIT_NONFINITE, EXIT_OK, RunnerError, display_path
from runner.fsio import read_json, read_jsonl, some_names

if TYPE_CHECKING:
    from runner.config.load import Experiment
    from runner.training.tracking import Tracker


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="train an experiment, or resume/extend a run folder")
    p.add_argument("target", help="experiments/NAME.yaml, or an existing run folder to resume")
    p.add_argument(
        "--run-dir",
        default=None,
        help="run folder (default runs/<experiment>/<timestamp>); resumed when it holds a run",
    )
    p.add_argument("--run-name", type=_run_name, default=None, help="run id / MLflow run name (default: a timestamp)")
    p.add_argument(
        "--extend-to",
        type=_tokens,
        default=None,
        metavar="TOKENS",
        help="raise max_duration and exposure of a finished run to TOKENS (a new segment; 614400, 614.4K, 26B)",
    )
    p.add_argument("--max-steps", type=positive_int, default=None, help="stop after N steps in this attempt (tests)")
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


def _run_name(text: str) -> str:
    from runner.runs.runjson import RUN_NAME

    if not RUN_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"a run name is one folder name: letters, digits, '_', '.', '-', starting with a letter or digit, "
            f"at most 128 characters: {text!r}"
        )
    return text


def _tokens(text: str) -> int:
    """`614400`, `614_400`, `6.144e5`, `614.4K`, `26B` -> a positive whole number of tokens (exact: decimal)."""
    from runner.planning.token_counts import token_count

    value = token_count(text)
    if value is None or not 0 < value <= 2**63 - 1 or value != value.to_integral_value():  # int64: torch, numpy
        raise argparse.ArgumentTypeError(
            f"not a positive whole number of tokens up to 2**63 - 1 (like 614400, 614_400, 6.144e5, 614.4K or 26B): {text!r}"
        )
    return int(value)


# ---- launch -------------------------------------------------------------------------------------


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


def _launch(args, held: contextlib.ExitStack) -> int:
    """`runner launch`: the request parsed, the launch run (runner.training.launch), then on rank 0 the
    report, the MLflow run's end and the summary."""
    from runner.training.launch import Request, launch

    request = Request(
        target=args.target,
        run_dir=args.run_dir,
        run_name=args.run_name,
        extend_to=args.extend_to,
        max_steps=args.max_steps,
        tracking=not args.no_tracking,
        kill_at_step=args.kill_at_step,
        faults=tuple(args.fault),
    )
    launched = launch(request, held, say=lambda m: print(m, file=sys.stderr))
    if launched.done is not None:
        if _is_rank0():
            print(launched.done)
        return EXIT_OK
    assert launched.acc is not None  # a launch that trained
    if launched.acc.is_main_process:
        _close_run(launched.exp, launched.run_dir, launched.tracker)
    launched.acc.wait_for_everyone()
    launched.acc.end_training()
    return launched.code


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
    from runner.runs.recorded import EVAL_FIELDS, checked_rows

    info = RunFolder(run_dir).record()
    ledger_path = run_dir / "ledger.json"
    if ledger_path.exists():
        total = read_json(ledger_path)["counters"]["total"]
        print(
            "  tokens: " + "  ".join(f"{k} {total[k]:,}" for k in ("processed", "exposure", "useful", "unique", "lost"))
        )
    evals = run_dir / "metrics" / "eval.jsonl"
    try:
        rows = checked_rows(read_jsonl(evals), EVAL_FIELDS, evals, required=("domain", "loss_nats", "bpb"))
    except RunnerError:  # a row of another shape: the report's line above said which (`report: not written`)
        rows = []
    last = {row["domain"]: row for row in rows}
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


def _check_moved_store(folder, uri: str) -> None:
    """`sync --tracking-uri URI` records URI in run.json for every later resume, sync and audit: refused,
    with run.json unchanged, unless that store holds the run's MLflow run (any URI was recorded, an
    unreachable server or a store that never held the run included)."""
    from runner.training.tracking import absolute_uri, store_lacks_run

    saved = folder.record().mlflow
    uri = absolute_uri(uri)
    if not saved.get("run_id") or uri == saved.get("tracking_uri"):
        return
    why = store_lacks_run(uri, saved["run_id"])
    if why:
        raise RunnerError(
            f"MLflow run {saved['run_id']} is not in {uri} ({why}): --tracking-uri names the store that holds "
            f"the run (a server or database it moved to); run.json keeps {saved.get('tracking_uri')}",
            key="--tracking-uri",
        )


def _nothing_to_sync(folder) -> bool:
    """A run with no MLflow run and an empty journal (a --no-tracking launch): a sync would send nothing,
    yet record its URI in run.json as the store every later tracked resume goes to."""
    from runner.training.tracking import PENDING

    pending = folder.path / PENDING
    return not folder.record().mlflow.get("run_id") and (not pending.is_file() or not pending.read_bytes().strip())


def cmd_sync(args) -> int:
    from runner.runs.folder import RunFolder, is_run_dir, not_a_run_dir
    from runner.runs.lock import RunLock
    from runner.training.launch import tracker_of

    run_dir = Path(args.run_dir)
    if not is_run_dir(run_dir):
        raise not_a_run_dir(run_dir)
    folder = RunFolder(run_dir)
    # A server that moved is recorded in run.json: later resumes and syncs go there, so it must hold the run.
    with RunLock(run_dir, "runner sync"):  # a launch sending the same journal would send it twice
        if _nothing_to_sync(folder):
            print(
                f"{run_dir}: nothing to send: no MLflow run and no pending entries (launched with --no-tracking?); "
                "run.json unchanged"
            )
            return EXIT_OK
        if args.tracking_uri:
            _check_moved_store(folder, args.tracking_uri)
        tracker = tracker_of(folder, args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"), report=lambda m: None)
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
    from runner.data.manifest import load_experiment_manifests
    from runner.planning.resources import load_experiment
    from runner.training.launch import check_device, new_timestamped_folder

    full = load_experiment(args.experiment)
    manifests, _ = load_experiment_manifests(full)  # what each launch refuses, before the smoke's folders
    try:
        check_device(full.config)
    except RunnerError as e:
        raise RunnerError(e.detail, file=str(full.path), key=e.key) from None
    steps = max(4, args.steps)
    with contextlib.ExitStack() as held:  # the smoke's folder, locked until its three launches are done
        out = Path(args.out) if args.out else new_timestamped_folder(Path("runs") / full.config.name, held, "smoke-")
        ref, res = _smoke_folders(full, steps, out, manifests, held)
        return _smoke(full, steps, out, ref, res)


def _smoke(full: Experiment, steps: int, out: Path, ref: Path, res: Path) -> int:
    """The smoke's three launches (uninterrupted; killed; resumed) and its verdict."""
    cfg = full.config
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


def _check_smoke_out(out: Path) -> None:
    """--out is emptied of an earlier smoke's reference/ and resumed/ runs: anything else there (a
    folder of real runs, `--out runs/cpu-tiny`) is refused, before anything is removed. Its lock file
    (an earlier smoke's, or the one a smoke in progress holds) is the smoke's own."""
    from runner.runs.lock import LOCK_FILE, OWNER_FILE

    if not out.exists():
        return
    if not out.is_dir():
        raise RunnerError("exists and is not a folder: give a new folder for the two smoke runs", key="--out")
    other = sorted(
        p.name
        for p in out.iterdir()
        if not (p.is_dir() if p.name in ("reference", "resumed") else p.name in (LOCK_FILE, OWNER_FILE) and p.is_file())
    )
    if other:
        raise RunnerError(
            f"{out} holds {some_names(other)}: smoke empties its --out of "
            "an earlier smoke's reference/ and resumed/ runs only; give a new folder",
            key="--out",
        )


def _smoke_folders(
    full: Experiment, steps: int, out: Path, manifests: dict, held: contextlib.ExitStack
) -> tuple[Path, Path]:
    """The reference and resumed run folders (emptied first) of `steps` steps of `full`, checkpointed at
    steps // 2 and at the end, evaluated once. `manifests`: `full`'s, loaded and checked against their pins
    (what launch refuses: unpinned, absent, another tokenizer's), so a refused smoke writes nothing. `out`
    is locked in `held` (runner.runs.lock) before anything in it is removed: a second smoke given the same
    folder is refused while this one runs, instead of emptying the runs it is making."""
    from runner.config.load import experiment_from_dict
    from runner.data.manifest import plan_experiment_mixture
    from runner.runs.folder import create_run_folder
    from runner.runs.lock import RunLock

    B, L = full.config.train.global_batch_sequences, full.config.train.seq_len
    small = full.to_container()
    small["train"].update(exposure_tokens=steps * B * L, max_duration_tokens=steps * B * L, hard_stop_tokens=None)
    small["train"]["checkpoint"].update(interval_steps=steps // 2, interval_minutes=0, keep_last=2)
    small["eval"].update(interval_steps=steps)
    exp = experiment_from_dict(small, project_root=full.project_root, path=full.path)
    plan_experiment_mixture(exp, manifests)  # the smoke's budget within the pools and their repetition caps
    ref, res = out / "reference", out / "resumed"
    _check_smoke_out(out)
    held.enter_context(RunLock(out, "runner smoke"))
    for d in (ref, res):
        if d.exists():
            shutil.rmtree(d)
        create_run_folder(exp, d, d.name)
    return ref, res


def _smoke_differences(ref: Path, res: Path, steps: int, accelerator: str):
    """(weight identity, problems): the final weights, the ledger's counters and the expert load of the
    resumed run against the uninterrupted one."""
    from runner.runs.checkpoints import dirname
    from runner.runs.resume_identity import compare_weights

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
