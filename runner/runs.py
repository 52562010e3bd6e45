"""Run folders: creating one, owning it, reading back what it trained and recorded, refusing a
different experiment, and extending a finished run as a new segment.

Owns the lifecycle records of a run folder (experiment.yaml, fingerprint.txt, run.json segments,
manifest copies, ledger.json), its lock (RunLock: one writing process at a time) and the one way
to read them back: the saved experiment through the schema, the manifest copies, the devices held,
the MFU convention and the times a run recorded (runner.reports.tables and runner.reports.audit
read a run through these). Never trains, tracks or builds a report.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import threading
from pathlib import Path

import numpy as np

from runner.config.fingerprint import canonical_meaning, diff_keys
from runner.config.load import Experiment, experiment_from_dict, find_project_root, to_yaml
from runner.config.rules import check_targets, devices, global_batch_tokens, max_duration_tokens
from runner.config.schema import ExperimentSchema
from runner.data.manifest import load_experiment_manifests, plan_experiment_mixture
from runner.errors import Problems, RunnerError, display_path
from runner.fsio import atomic_write_json, read_json, read_jsonl, read_yaml, repair_jsonl_tail
from runner.planning.flops import Convention
from runner.training.ledger import TokenLedger


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _segment(index: int, start_step: int, exp: Experiment) -> dict:
    """run.json's record of one segment: the budget and fingerprint the run trains under from `start_step`."""
    return {
        "index": index,
        "start_step": start_step,
        "max_duration_tokens": max_duration_tokens(exp.config),
        "exposure_tokens": exp.config.train.exposure_tokens,
        "fingerprint": exp.fingerprint,
        "started_at": _now(),
    }


# ---- the lock: one process owns a run folder -----------------------------------------------------

LOCK_FILE = "lock"  #: flock(2)ed for the life of the owner; holds its record (host, pid, command, since)
OWNER_FILE = "lock.owner"  #: the lock-file method, where fcntl locks are unavailable (created O_EXCL)
#: errors of flock(2) on storage that has no working locks (NFS without lockd, some FUSE/Lustre mounts)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class RunLock:
    """Exclusive ownership of a run folder by one process: `runner launch` (its rank 0 under
    torchrun/accelerate), `runner sync` and `runner report`, the verbs that write into it.

    The method is flock(2) on `<run>/lock`: the kernel drops it when the owner exits in any way,
    SIGKILL included, so a crashed launch never blocks the next. Where the storage has no working
    fcntl locks (flock fails) or `RUNNER_LOCK=file` says its locks are not shared between hosts, the
    method is a lock file created exclusively, `<run>/lock.owner`, naming host and pid: one left by a
    dead process of this host is taken over; one from another host is named, for the user to remove
    once that process is gone. A second owner is refused with a RunnerError naming the holder."""

    def __init__(self, run_dir: Path, command: str = "runner launch"):
        self.run_dir = Path(run_dir)
        self.command = command
        self._fd: int | None = None
        self._owner: Path | None = None
        self.warnings: list[str] = []  # things the owner should print (a lock taken over)

    def record(self) -> dict:
        argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": f"{self.command} ({argv})",
            "since": _now(),
        }

    def __enter__(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if os.environ.get("RUNNER_LOCK", "fcntl") == "file":
            self._take_owner_file()
        else:
            self._take_flock()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def held(self) -> dict:
        """The record this owner wrote (host, pid, since): what every rank must read in the folder."""
        if self._fd is not None:
            return _read_fd(self._fd)
        return self._read(self._owner) if self._owner is not None else {}

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                _write_record(self._fd, dict(_read_fd(self._fd), released_at=_now()))
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        if self._owner is not None:
            if self._read(self._owner).get("pid") == os.getpid():
                with contextlib.suppress(OSError):
                    self._owner.unlink()
            self._owner = None

    def _take_flock(self) -> None:
        path = self.run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use(self._read(path), path) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_FLOCK:
                raise
            self._take_owner_file()  # no fcntl locks on this storage
            return
        before = _read_fd(fd)  # through this descriptor: on NFS, closing another one would drop the lock
        if before.get("host") not in (None, socket.gethostname()) and "released_at" not in before:
            self.warnings.append(
                f"warning: {display_path(self.run_dir)}: the previous owner, {_holder(before)}, never released it "
                "(killed?); if it is still running there, this storage does not share fcntl locks between hosts: "
                "stop this launch and use RUNNER_LOCK=file"
            )
        _write_record(fd, self.record())
        self._fd = fd

    def _take_owner_file(self) -> None:
        owner = self.run_dir / OWNER_FILE
        for _attempt in range(3):
            try:
                fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                held = self._read(owner)
                if held.get("host") != socket.gethostname() or _alive(held.get("pid")):
                    raise self._in_use(held, owner) from None
                grave = owner.with_name(f"{OWNER_FILE}.stale-{os.getpid()}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(owner, grave)  # atomic: of two launches taking it over, one moves it
                    if self._read(grave) != held:  # moved a fresh owner's file: give it back
                        os.rename(grave, owner)
                        raise self._in_use(self._read(owner), owner) from None
                    grave.unlink()
                    self.warnings.append(f"note: took over {display_path(owner)} from {_holder(held)}, which is gone")
                continue
            try:
                _write_record(fd, self.record())
            finally:
                os.close(fd)
            self._owner = owner
            return
        raise RunnerError("another process keeps taking the lock over; retry", file=str(owner))

    def _in_use(self, held: dict, path: Path) -> RunnerError:
        how = (
            f"; if no runner process runs there any more, remove {display_path(path)}"
            if path.name == OWNER_FILE and held.get("host") != socket.gethostname()
            else ""
        )
        return RunnerError(
            f"in use by {_holder(held)}: one process writes a run folder at a time; wait for it to end, "
            f"or stop it{how}",
            file=str(self.run_dir),
        )

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            data = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def lock_holder(run_dir: Path) -> dict | None:
    """The record of the process that holds a run folder now (a launch, sync or report writing it), or
    None. Read only: the lock is never taken. A record released, or left by a dead process of this
    host, holds nothing; one of another host (or not written yet) is asked of flock(2) itself, a shared
    lock tried and dropped at once."""
    run_dir = Path(run_dir)
    owner = RunLock._read(run_dir / OWNER_FILE)
    if owner and (owner.get("host") != socket.gethostname() or _alive(owner.get("pid"))):
        return owner
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None  # never locked
    try:
        record = _read_fd(fd)
        if "released_at" in record:
            return None
        if record.get("host") == socket.gethostname():
            return record if _alive(record.get("pid")) else None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return record
        except OSError:
            return None  # no fcntl locks on this storage: the lock-file method was read above
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holder_text(record: dict) -> str:
    """`runner launch (...), pid P on host H since T`: who holds a run folder, in words."""
    return _holder(record)


def lock_records(run_dir: Path) -> list[dict]:
    """The owners' records as a reader sees them in `run_dir` (either method's file; none: [])."""
    return [RunLock._read(Path(run_dir) / name) for name in (LOCK_FILE, OWNER_FILE) if (Path(run_dir) / name).exists()]


def _holder(record: dict) -> str:
    if not record.get("pid"):
        return "another process (its record is not readable yet)"
    return f"{record.get('command', 'a runner process')}, pid {record['pid']} on host {record.get('host')} since {record.get('since')}"


def _read_fd(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_record(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


# ---- run folders --------------------------------------------------------------------------------


# run.json is updated read-modify-write by the training thread and by MLflow's delivery thread
# (which records the MLflow run id when it creates the run): one update at a time per process.
_RUN_JSON_LOCK = threading.Lock()


class RunFolder:
    """run.json and the journal of one run folder (DESIGN.md layout). Only rank 0 writes."""

    def __init__(self, path: Path, writer: bool = True):
        self.path = Path(path)
        self.writer = writer

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    def read(self) -> dict:
        return read_json(self.run_json)

    def update(self, **fields) -> dict:
        with _RUN_JSON_LOCK:
            info = self.read()
            info.update(fields)
            if self.writer:
                atomic_write_json(self.run_json, info)
        return info

    @contextlib.contextmanager
    def failed_on_error(self):
        """Around one attempt: any exception out of it leaves run.json `status: failed` with the
        error's first line (an interrupt: `preempted`), never `running`; a full disk becomes one
        RunnerError line, since what was written before it (checkpoints, journal) stays usable."""
        if self.writer and self.run_json.exists() and "error" in (info := self.read()):
            info.pop("error")  # an earlier attempt's: this one starts clean
            atomic_write_json(self.run_json, info)
        try:
            yield
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                self._mark("failed", e)
                raise
            err = RunnerError(
                f"{e.strerror}; the checkpoints written before it are intact: free some space and resume "
                f"with `runner launch {self.path}`",
                file=e.filename or str(self.path),
            )
            self._mark("failed", err)
            raise err from None
        except KeyboardInterrupt as e:
            self._mark("preempted", e)
            raise
        except Exception as e:
            self._mark("failed", e)
            raise

    def _mark(self, status: str, error: BaseException) -> None:
        if not self.writer or not self.run_json.exists():
            return
        line = (str(error).splitlines() or [""])[0]
        try:
            self.update(status=status, error=f"{type(error).__name__}: {line}" if line else type(error).__name__)
        except (OSError, RunnerError):
            return  # the disk that failed the run may refuse this too; the error itself still surfaces

    def journal_path(self) -> Path:
        return self.path / "journal" / "processed.jsonl"

    def journal_entries(self) -> list[dict]:
        # A line torn by a kill mid-write is skipped; repair_journal drops it before appending.
        return read_jsonl(self.journal_path(), skip_torn=True)

    def repair_journal(self) -> None:
        if self.writer:
            repair_jsonl_tail(self.journal_path())


def write_ledger_json(run_dir: Path, ledger: TokenLedger) -> None:
    """ledger.json: counters, repetition histogram and realized ratios (plain JSON for report/audit)."""

    def plain(x):
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (np.integer,)):
            return int(x)
        if isinstance(x, (np.floating,)):
            return float(x)
        return x

    atomic_write_json(
        Path(run_dir) / "ledger.json",
        {
            "counters": plain(ledger.counters()),
            "histogram": plain(ledger.histogram()),
            "realized_ratios": plain(ledger.realized_ratios()),
        },
    )


def is_run_dir(path: Path) -> bool:
    """A run folder `runner launch` can resume: run.json and the experiment it trains."""
    return (Path(path) / "run.json").exists() and (Path(path) / "experiment.yaml").exists()


def is_reportable_run(path: Path) -> bool:
    """A run folder a report can be built from: run.json and the ledger.json of its counters."""
    return (Path(path) / "run.json").exists() and (Path(path) / "ledger.json").exists()


def load_saved_experiment(path: Path, project_root: Path | None = None) -> Experiment:
    """A saved resolved experiment.yaml (a run's or a report's copy), typed by the schema."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise RunnerError("expected a mapping (the resolved experiment config)", file=str(path))
    return experiment_from_dict(data, project_root=project_root, path=Path(path))


def experiment_of_run(run_dir: Path) -> Experiment:
    """The resolved experiment a run folder trains (its own copy, not the file in experiments/)."""
    info = read_json(run_dir / "run.json")
    root = Path(info.get("project_root") or find_project_root(Path.cwd()))
    exp = load_saved_experiment(run_dir / "experiment.yaml", project_root=root)
    # Operational keys of a run's copy may be edited between attempts; quality targets are checked again.
    problems = Problems()
    check_targets(exp.config, run_dir / "experiment.yaml", problems)
    problems.raise_if_any()
    return exp


def checked_experiment_of_run(run_dir: Path) -> Experiment:
    """The run folder's experiment, refused when its experiment.yaml was edited into another run.

    The file must resolve to the fingerprint of the run's current segment; operational keys
    (hard stop, checkpoint cadence, log interval) may change. The differing keys are found against
    the resolved config saved in the newest valid checkpoint."""
    from runner.training.checkpoint import Checkpointer  # noqa: PLC0415  (torch: off the report's and audit's path)

    exp = experiment_of_run(run_dir)
    info = read_json(run_dir / "run.json")
    segments = info.get("segments") or []
    recorded = segments[-1].get("fingerprint") if segments else info.get("fingerprint")
    if not recorded or recorded == exp.fingerprint:
        return exp
    ckpt = Checkpointer(run_dir, 0, 0, 1).latest_valid(report=lambda m: None)
    saved = ckpt.state.get("config") if ckpt is not None else None
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


def check_same_experiment(exp: Experiment, run_dir: Path) -> None:
    """Refuse to resume a run folder with a different experiment, naming the differing keys."""
    saved = experiment_of_run(run_dir)
    if saved.fingerprint == exp.fingerprint:
        return
    keys = diff_keys(canonical_meaning(saved.config), canonical_meaning(exp.config))
    raise RunnerError(
        f"{exp.path} resolves to fingerprint {exp.fingerprint[:12]}, the run has "
        f"{saved.fingerprint[:12]}; differing keys: {', '.join(keys) or '(none)'}; refusing to resume",
        file=str(run_dir),
    )


def check_mixture_feasible(exp: Experiment) -> None:
    """Before a folder is written: every pin present and matching, each pool made with the pinned
    tokenizer, and a mixture the budget and repetition caps allow."""
    manifests, _ = load_experiment_manifests(exp)
    plan_experiment_mixture(exp, manifests)


def create_run_folder(exp: Experiment, run_dir: Path, run_id: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("checkpoints", "journal", "metrics", "manifests"):
        (run_dir / sub).mkdir(exist_ok=True)
    (run_dir / "experiment.yaml").write_text(to_yaml(exp.config))
    (run_dir / "fingerprint.txt").write_text(exp.fingerprint + "\n")
    for d, pin in exp.config.data.manifests.items():
        shutil.copy2(exp.resolve_path(pin.path), run_dir / "manifests" / f"{d}.json")
    atomic_write_json(
        run_dir / "run.json",
        {
            "run_id": run_id,
            "experiment": exp.config.name,
            "fingerprint": exp.fingerprint,
            "experiment_file": str(exp.path) if exp.path else None,
            "project_root": str(exp.project_root),
            "mlflow": {"tracking_uri": None, "experiment_id": None, "run_id": None},
            "segments": [_segment(0, 0, exp)],
            "status": "created",
            "committed_steps": 0,
            "conventions": None,
            "created_at": _now(),
        },
    )


def extend_run(run_dir: Path, tokens: int, write: bool) -> Experiment:
    """A finished run's experiment with exposure and max_duration raised to `tokens` (a new segment)."""
    exp = checked_experiment_of_run(run_dir)
    info = read_json(run_dir / "run.json")
    cfg = exp.config
    step_tokens = global_batch_tokens(cfg)
    if info.get("status") != "finished":
        raise RunnerError(
            f"run status is {info.get('status')!r}; only a finished run is extended (resume it first)",
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
        segments = info.get("segments", [])
        segments.append(_segment(len(segments), int(info.get("committed_steps", 0)), new))
        info.update(segments=segments, fingerprint=new.fingerprint, status="running")
        atomic_write_json(run_dir / "run.json", info)
    return new


# ---- reading what a run recorded ----------------------------------------------------------------


def read_manifest_copies(folder: Path, domains: list[str]) -> dict[str, dict]:
    """The manifest JSON of each domain from `folder/<domain>.json` (a run's or a report's copies;
    shards not needed)."""
    out = {}
    for d in domains:
        out[d] = read_json(folder / f"{d}.json")
        if not isinstance(out[d], dict) or "pool_tokens" not in out[d]:
            raise RunnerError("pool_tokens: missing", file=str(folder / f"{d}.json"))
    return out


def devices_held(run: dict, cfg: ExperimentSchema) -> int:
    """Devices the run held: run.json `devices` (the trainer's world size), else
    conventions.devices_counted, else the hardware recipe (runs recorded before either existed).

    The recipe is only a last resort because a launcher (torchrun --nproc-per-node) can start more
    processes than the recipe names, and MFU and cost are over what was held.
    """
    if run.get("devices") is not None:
        return int(run["devices"])
    recorded = (run.get("conventions") or {}).get("devices_counted")
    if recorded is not None:
        return int(recorded)
    return devices(cfg)


def conventions_of(run: dict, cfg: ExperimentSchema) -> dict:
    """The MFU convention record: run.json's `conventions`, peak fields defaulting to the hardware
    recipe and devices_counted to the devices held."""
    recorded = dict(run.get("conventions") or {})
    conv = Convention.from_dict(recorded).to_dict()
    hw = cfg.hardware
    conv["peak_tflops"] = recorded.get("peak_tflops", hw.peak_tflops)
    conv["peak_dtype"] = recorded.get("peak_dtype", hw.peak_dtype)
    conv["peak_source"] = recorded.get("peak_source", hw.peak_source)
    conv["devices_counted"] = int(recorded.get("devices_counted", devices_held(run, cfg)))
    conv["time_basis"] = recorded.get("time_basis", "step")
    if conv["time_basis"] == "step":  # runs before issue 28 read step time when the host had queued it
        conv["step_clock"] = recorded.get("step_clock", "host")
    if conv["peak_tflops"] is None:
        raise RunnerError(
            "no peak_tflops recorded in run.json conventions or hardware recipe", key="conventions.peak_tflops"
        )
    return conv


def device_seconds(
    run: dict, cfg: ExperimentSchema, wall_seconds: float, step_seconds_total: float
) -> tuple[float, float]:
    """(device_wall_seconds, device_step_seconds): time x devices held, summed over attempts.

    run.json's figures when recorded (the trainer sums each attempt with its own world size),
    else the seconds x the devices held (runs recorded before; one world size throughout)."""
    held = devices_held(run, cfg)
    wall = run.get("device_wall_seconds")
    step = run.get("device_step_seconds_total")
    return (
        float(wall) if wall is not None else wall_seconds * held,
        float(step) if step is not None else step_seconds_total * held,
    )


def run_times(run: dict, train_rows: list[dict]) -> tuple[float, float]:
    """(wall_seconds, step_seconds_total): run.json's totals when recorded, else from train.jsonl.

    A train.jsonl row's step_seconds is taken to stand for each step since the previous row
    (log_interval_steps > 1 logs one row per interval).
    """
    wall = run.get("wall_seconds")
    step_total = run.get("step_seconds_total")
    if train_rows and (wall is None or step_total is None):
        rows = sorted(train_rows, key=lambda r: r["step"])
        prev, summed = 0, 0.0
        for r in rows:
            span = max(int(r["step"]) - prev, 1)
            summed += float(r["step_seconds"]) * span
            prev = int(r["step"])
        wall = wall if wall is not None else max(float(r["wall_seconds"]) for r in rows)
        step_total = step_total if step_total is not None else summed
    if wall is None or step_total is None:
        raise RunnerError("no wall_seconds/step_seconds_total and no metrics/train.jsonl rows", file="run.json")
    return float(wall), float(step_total)
