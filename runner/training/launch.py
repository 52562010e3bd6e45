"""`runner launch` below the command line: the target resolved (an experiment, or a run folder to
resume or extend), the world checked, the run folder chosen, locked and written, MLflow started or
continued, fault injection armed, and the loop run; also what a launch refuses of an edited run folder
and how a finished run is extended as a new segment.

The run folder's format (run.json, segments, the lock) is runner.runs'; the loop is runner.training.loop's.
The CLI (runner.cli.train) parses the arguments into a `Request` and, after the loop, writes the report,
ends the MLflow run and prints the summary (reports and export sit above training). Torch, accelerate
and the loop are imported only when a launch will train: a finished run's no-op relaunch stays quick.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import itertools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.config.fingerprint import canonical_meaning, diff_keys
from runner.config.load import Experiment, experiment_from_dict, to_yaml
from runner.config.rules import devices, global_batch_tokens, grad_accum
from runner.config.schema import ExperimentSchema
from runner.data.manifest import launch_warnings, load_experiment_manifests, plan_experiment_mixture
from runner.errors import EXIT_OK, RunnerError
from runner.fsio import some_names
from runner.planning.hardware import check_device_matches, detect_device
from runner.planning.resources import load_experiment
from runner.runs.folder import (
    RUN_FOLDER_ENTRIES,
    RunFolder,
    check_same_experiment,
    create_run_folder,
    experiment_of_run,
    is_run_dir,
    not_a_run_dir,
    segment_record,
)
from runner.runs.lock import RunLock, lock_records
from runner.training import mlflow_child, startup
from runner.training.mlflow_child import MlflowChild
from runner.training.tracking import Tracker, absolute_uri, check_run_store, flatten, git_commit

if TYPE_CHECKING:
    from accelerate import Accelerator

Say = Callable[[str], None]


@dataclass(frozen=True)
class Request:
    """What `runner launch` was asked (runner.cli.train parses it)."""

    target: str  #: experiments/NAME.yaml, or a run folder to resume
    run_dir: str | None = None  #: the run folder (default runs/<experiment>/<timestamp>)
    run_name: str | None = None  #: run id / MLflow run name (default: the folder's name)
    extend_to: int | None = None  #: a finished run's new budget in tokens (a new segment)
    max_steps: int | None = None  #: stop after this many steps in this attempt
    tracking: bool = True  #: log to MLflow
    kill_at_step: int | None = None  #: fault injection: SIGKILL itself mid-step
    faults: tuple[str, ...] = ()  #: fault injection under torchrun, RESTART:RANK:STEP:MODE


@dataclass
class Launched:
    """What a launch leaves the CLI to close: the loop's exit code, the run and, when it trained, the
    accelerator and the MLflow tracker; `done` is the no-op line of a finished run relaunched."""

    code: int
    exp: Experiment
    run_dir: Path
    acc: Accelerator | None = None
    tracker: Tracker | None = None
    done: str | None = None


def timestamp() -> str:
    """A default run name: the local time to the second."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def launch(req: Request, held: contextlib.ExitStack, say: Say) -> Launched:
    """`runner launch` on every rank, in the order its refusals must come: the target and world
    checked, the folder chosen and locked (held until `held` closes), records written, MLflow
    started, the loop run. Each step may refuse before the next writes anything. A finished run
    relaunched without `extend_to` is a no-op that touches nothing (no torch import, peak re-measure,
    report or MLflow): its `Launched.done` is the line to print."""
    startup.begin_launch()  # process start to here: the interpreter and the CLI
    exp, run_dir, existing = resolve(req)
    startup.mark("config")
    if existing and req.extend_to is None:
        assert run_dir is not None  # a run folder found is a folder named
        line = _finished_line(run_dir)
        if line is not None:
            return Launched(EXIT_OK, exp, run_dir, done=line)
    # MLflow's process starts before torch is imported: MLflow's own import runs beside it
    child = mlflow_child.prestart(req.tracking)
    if child is not None:
        held.callback(child.close)  # a launch refused before tracking starts leaves no process behind
    from runner.training import loop, threads  # noqa: PLC0415 - torch, off a finished run's no-op relaunch

    startup.mark("imports")
    if existing and run_dir is not None and req.tracking:  # before anything is written: a lost store is refused
        _check_recorded_store(run_dir)
    if req.extend_to is not None:
        if not existing or run_dir is None:
            raise RunnerError("--extend-to needs an existing run folder", key="--extend-to")
        exp = extend_run(run_dir, req.extend_to, write=False)  # validate on every rank before any write
    acc = make_accelerator(exp.config)
    main = acc.is_main_process
    warning = check_world(exp.config, acc.num_processes)  # before any folder is written
    threads.check_threads(exp.config.hardware.threads, str(exp.path))
    if warning and main:
        say(warning)
    run_dir = _claim_folder(req, exp, run_dir, existing, acc, held, say)
    if child is not None and not main:
        child.close()
        child = None
    tracker = _start_tracking(req, exp, run_dir, existing, main, say, child) if req.tracking else None
    kill, fault = _fault(req.faults, acc.process_index) if req.faults else (req.kill_at_step, None)
    opts = loop.Options(max_steps=req.max_steps, report=say, kill_at_step=kill, fault=fault)
    startup.mark("accelerator_and_folder")
    try:
        code = loop.train(exp, run_dir, acc, tracker, opts)
    except BaseException:
        if tracker is not None:  # what the delivery thread still holds reaches MLflow, or stays journaled
            tracker.flush()
            tracker.close()
        raise
    return Launched(code, exp, run_dir, acc=acc, tracker=tracker)


def check_device(cfg: ExperimentSchema) -> None:
    """A GPU recipe runs on the device it names (runner.planning.hardware.check_device_matches: its peak
    and memory describe that part); checked before a run folder is written, and again where the loop
    applies the recipe's settings. A CPU recipe runs anywhere (on the CPU)."""
    if cfg.hardware.accelerator != "cpu":
        check_device_matches(cfg.hardware, detect_device())


def make_accelerator(cfg: ExperimentSchema) -> Accelerator:
    """accelerate's Accelerator for the recipe (CPU, mixed precision, FSDP2 plugin, DDP handlers)."""
    from accelerate import Accelerator  # noqa: PLC0415 - torch, off a finished run's no-op relaunch

    from runner.training.accelerator import (  # noqa: PLC0415 - the same
        accelerate_mixed_precision,
        ddp_kwargs_handlers,
        fsdp_plugin,
        sharding_mode,
    )

    acc = Accelerator(
        cpu=cfg.hardware.accelerator == "cpu",
        mixed_precision=accelerate_mixed_precision(cfg.hardware),
        fsdp_plugin=fsdp_plugin(cfg.hardware),  # FSDP2 under accelerate launch: fp32 gradient reduction
        kwargs_handlers=ddp_kwargs_handlers(),
    )
    sharding_mode(cfg.hardware, acc)  # a recipe/accelerate mismatch fails here, before any folder is written
    return acc


def _check_run_name(run_dir: Path, run_name: str | None) -> None:
    """--run-name names a new run: with a run folder to resume it was ignored (the run keeps its id)."""
    recorded = RunFolder(run_dir).record().run_id
    if run_name and run_name != recorded:
        raise RunnerError(
            f"names a new run; {run_dir} is run {recorded}, resumed or extended under that name",
            key="--run-name",
        )


def resolve(req: Request) -> tuple[Experiment, Path | None, bool]:
    """(experiment, run folder or None for a new default one, whether the folder holds a run)."""
    target = Path(req.target)
    if target.is_dir():
        if not is_run_dir(target):
            raise not_a_run_dir(target)
        if req.run_dir and Path(req.run_dir).resolve() != target.resolve():
            raise RunnerError("give either a run folder or --run-dir, not two different folders", file=str(target))
        _check_run_name(target, req.run_name)
        return checked_experiment_of_run(target), target, True
    exp = load_experiment(target)
    run_dir = Path(req.run_dir) if req.run_dir else None
    if run_dir is not None and is_run_dir(run_dir):
        check_same_experiment(exp, run_dir)
        _check_run_name(run_dir, req.run_name)
        return exp, run_dir, True
    if run_dir is not None:
        check_new_run_dir(run_dir)
    elif req.run_name:
        named = Path("runs") / exp.config.name / req.run_name  # where _claim_folder puts it
        if is_run_dir(named):
            status = RunFolder(named).record().status
            raise RunnerError(
                f"already a run ({status}): `runner launch {named}` resumes or extends it; give another "
                "--run-name for a new run",
                file=str(named),
                key="--run-name",
            )
        check_new_run_dir(named, "--run-name")
    return exp, run_dir, False


def check_new_run_dir(run_dir: Path, flag: str = "--run-dir") -> None:
    """A --run-dir that holds no run yet: new, empty, or what a launch killed while making it left there
    (RUN_FOLDER_ENTRIES). A folder of other files (`--run-dir .`: the project) is refused, before the
    run's files are mixed into it."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise RunnerError("exists and is not a folder: give a new folder for the run", file=str(run_dir))
    other = sorted(
        p.name
        for p in run_dir.iterdir()
        if p.name not in RUN_FOLDER_ENTRIES and not p.name.startswith((".", "lock.owner.stale-"))
    )
    if other:
        raise RunnerError(
            f"holds {some_names(other)} and no run: {flag} names a new or empty folder, or a run folder to resume",
            file=str(run_dir),
            key=flag,
        )


def _finished_line(run_dir: Path) -> str | None:
    """The no-op line for a finished run relaunched without --extend-to, else None."""
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
    grad_accum(cfg, world)
    planned = devices(cfg)
    if world == planned:
        return None
    return (
        f"warning: running on {world} devices (world size) but the hardware recipe plans {planned} "
        f"(devices_per_node x nodes); MFU, goodput MFU and cost count the {world} held"
    )


def checked_experiment_of_run(run_dir: Path) -> Experiment:
    """The run folder's experiment, refused when its experiment.yaml was edited into another run.

    The file must resolve to the fingerprint of the run's current segment; operational keys
    (hard stop, checkpoint cadence, log interval) may change. The differing keys are found against
    the resolved config saved in the newest valid checkpoint."""
    exp = experiment_of_run(run_dir)
    recorded = RunFolder(run_dir).record().current_fingerprint()
    if not recorded or recorded == exp.fingerprint:
        return exp
    # torch, only to name the keys of a refusal: off the path of every launch, report and audit
    from runner.training.checkpoint import Checkpointer  # noqa: PLC0415

    ckpt = Checkpointer.reader(run_dir).latest_valid(report=lambda m: None)
    saved = ckpt.record.config if ckpt is not None else None
    if saved is not None:
        keys = diff_keys(canonical_meaning(saved), canonical_meaning(exp.config))
        what = f"differing keys: {', '.join(keys) or '(none)'}"
    else:
        what = "no checkpoint holds the resolved config to name the differing keys"
    raise RunnerError(
        f"edited: resolves to fingerprint {exp.fingerprint[:12]}, the run's current segment has "
        f"{recorded[:12]}; {what}; refusing to resume (restore the file, or start a new run)",
        file=str(run_dir / "experiment.yaml"),
    )


def check_mixture_feasible(exp: Experiment) -> None:
    """Before a folder is written: every pin present and matching, each pool made with the pinned
    tokenizer, and a mixture the budget and repetition caps allow."""
    manifests, _ = load_experiment_manifests(exp)
    plan_experiment_mixture(exp, manifests)


def extend_run(run_dir: Path, tokens: int, write: bool) -> Experiment:
    """A finished run's experiment with exposure and max_duration raised to `tokens` (a new segment)."""
    exp = checked_experiment_of_run(run_dir)
    folder = RunFolder(run_dir)
    info = folder.record()
    cfg = exp.config
    step_tokens = global_batch_tokens(cfg)
    if info.status != "finished":
        raise RunnerError(
            f"run status is {info.status!r}; only a finished run is extended (resume it first)",
            file=str(run_dir / "run.json"),
            key="status",
        )
    if tokens <= cfg.train.exposure_tokens or tokens % step_tokens:
        raise RunnerError(
            f"--extend-to {tokens} must exceed the current budget {cfg.train.exposure_tokens} "
            f"and be a whole number of global batches ({step_tokens} tokens)",
            key="train.exposure_tokens",
        )
    resolved = exp.to_container()
    resolved["train"]["exposure_tokens"] = tokens
    resolved["train"]["max_duration_tokens"] = tokens
    new = experiment_from_dict(resolved, project_root=exp.project_root, path=exp.path)
    check_mixture_feasible(new)
    if write:
        (run_dir / "experiment.yaml").write_text(to_yaml(new.config))
        (run_dir / "fingerprint.txt").write_text(new.fingerprint + "\n")
        segments = info.segments + [segment_record(len(info.segments), int(info.committed_steps), new)]
        folder.update(segments=segments, fingerprint=new.fingerprint, status="running")
    return new


# ---- the run folder claimed, MLflow started ----------------------------------------------------


def _claim_folder(
    req: Request, exp: Experiment, run_dir: Path | None, existing: bool, acc, held: contextlib.ExitStack, say: Say
) -> Path:
    """The run folder chosen (ranks agree on one), locked for this launch, and its records written (rank 0):
    created, extended, or given the experiment's new operational keys. Every rank returns after rank 0 wrote."""
    from accelerate.utils import broadcast_object_list  # noqa: PLC0415 - torch, off a finished run's no-op relaunch

    main = acc.is_main_process
    if run_dir is None:
        parent = Path("runs") / exp.config.name
        if req.run_name:
            chosen = [str(parent / req.run_name)]
        else:
            chosen = [str(new_timestamped_folder(parent, held)) if main else ""]
        if acc.num_processes > 1:
            broadcast_object_list(chosen)  # ranks must agree on one timestamped folder
        run_dir = Path(chosen[0])
    if main and not existing:
        check_mixture_feasible(exp)  # before the lock: a refused experiment writes nothing
    check_device(exp.config)  # after the experiment's own refusals, before any folder is written
    held.enter_context(_owning(run_dir, acc, say))
    if main:
        if req.extend_to is not None:
            extend_run(run_dir, req.extend_to, write=True)
        elif not existing:
            if is_run_dir(run_dir):
                raise RunnerError(
                    "became a run while this launch started (another launch); launch again to resume it",
                    file=str(run_dir),
                )
            create_run_folder(exp, run_dir, req.run_name or run_dir.name)
        elif req.target != str(run_dir):
            # Same fingerprint, maybe other operational keys (checkpoint interval, hard stop): use them.
            (run_dir / "experiment.yaml").write_text(to_yaml(exp.config))
        for line in launch_warnings(exp):  # after the refusals: a launch that will not run warns of nothing
            say(f"warning: {line}")
    acc.wait_for_everyone()
    return run_dir


def new_timestamped_folder(parent: Path, held: contextlib.ExitStack, prefix: str = "") -> Path:
    """A default run folder, made here so that no other launch can take it: `runs/EXP/<time>`, or
    `<time>-2`, `-3` ... when a launch of the same experiment made that one in the same second (the
    second of two launches started together was refused: the folder was in use). A launch refused
    before it writes its run leaves no empty folder behind (nor the `runs/EXP` and `runs/` it made).
    `prefix`: `smoke-` for `runner smoke`'s default folder of its two runs."""
    made = [d for d in (parent, parent.parent) if not d.exists()]  # runs/EXP, runs/
    stamp = prefix + timestamp()
    for n in itertools.count(1):
        folder = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # `runs` a file, a read-only project
            raise RunnerError(f"cannot create the run folder: {e.strerror}", file=str(folder)) from None
        try:
            folder.mkdir()
        except FileExistsError:  # another launch's (or anything else of that name): the next name
            continue
        except OSError as e:
            raise RunnerError(f"cannot create the run folder: {e.strerror}", file=str(folder)) from None
        held.callback(_remove_if_empty, [folder, *made])
        return folder
    raise AssertionError("unreachable")


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):  # not empty: the run is there
            folder.rmdir()


@contextlib.contextmanager
def _owning(run_dir: Path, acc, say: Say, command: str = "runner launch"):
    """Rank 0 holds the run folder's lock (runner.runs.lock.RunLock) for the whole launch; every rank
    learns whether it got it, so a refused launch stops everywhere before anything is written."""
    from accelerate.utils import broadcast_object_list  # noqa: PLC0415 - torch, off a finished run's no-op relaunch

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
            say(line)
        yield
    finally:
        if lock is not None:
            lock.release()


def _check_same_folder(run_dir: Path, held: dict | None) -> None:
    """Every rank must see the run folder rank 0 locked (shared storage): each reads the lock's
    record there and compares it with rank 0's. A node with its own copy (or none) would resume from
    another checkpoint or write beside the run; all ranks refuse with the same line, before training."""
    import torch.distributed as dist  # noqa: PLC0415 - torch, off a finished run's no-op relaunch

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


def tracker_of(folder: RunFolder, tracking_uri: str | None, **kwargs) -> Tracker:
    """The Tracker continuing the MLflow run recorded in run.json, recording it there when the URI
    it tracks to is not the one recorded (a first launch, or a server that moved). URIs are recorded
    absolute; a SQLite store that run.json says holds the run but is gone is refused, not recreated."""
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
    saved = RunFolder(run_dir).record().mlflow
    if saved.get("tracking_uri"):
        check_run_store(absolute_uri(saved["tracking_uri"]), saved.get("run_id"), run_dir / "run.json")


def _make_tracker(run_dir: Path, main: bool, say: Say, child: MlflowChild | None = None) -> Tracker:
    return tracker_of(RunFolder(run_dir, writer=main), None, enabled=main, report=say, child=child)


def _tags(exp: Experiment, run_dir: Path) -> dict:
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


def _start_tracking(
    req: Request, exp: Experiment, run_dir: Path, existing: bool, main: bool, say: Say, child: MlflowChild | None
) -> Tracker:
    """The MLflow run started or resumed: params and the experiment.yaml artifact on the first start only,
    the new segment's tags after an --extend-to; MLflow runs in `child` when there is one."""
    tracker = _make_tracker(run_dir, main, say, child)
    first_start = not existing
    tracker.start(
        exp.config.name,
        RunFolder(run_dir).read()["run_id"],
        params=flatten(exp.to_container()) if first_start else None,
        tags=_tags(exp, run_dir),
        artifacts=[run_dir / "experiment.yaml"] if first_start else [],
    )
    if req.extend_to is not None:
        seg = RunFolder(run_dir).record().segments[-1]
        tracker.log_tags({f"segment.{seg['index']}.{k}": v for k, v in seg.items() if k != "index"})
    return tracker


# ---- fault injection ------------------------------------------------------------------------


def _fault(faults: tuple[str, ...], rank: int):
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
