"""Run folders: creating one, its run.json and journal, and refusing a different experiment.

Owns the lifecycle records of a run folder (experiment.yaml, fingerprint.txt, run.json segments,
manifest copies, ledger.json) and the one way to write them. Reading back what a run recorded
(devices held, MFU convention, times) is runner.runs.recorded; the lock is runner.runs.lock.
Never trains, tracks or builds a report.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import shutil
import threading
from pathlib import Path

from runner.config.fingerprint import canonical_meaning, diff_keys
from runner.config.load import Experiment, find_project_root, load_saved_experiment, to_yaml
from runner.config.rules import check_targets, max_duration_tokens
from runner.errors import Problems, RunnerError
from runner.fsio import atomic_write_json, read_json, read_jsonl, repair_jsonl_tail
from runner.runs.recorded import JOURNAL_FIELDS, checked_rows
from runner.runs.runjson import RunJson, check_fields


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def segment_record(index: int, start_step: int, exp: Experiment) -> dict:
    """run.json's record of one segment: the budget and fingerprint the run trains under from `start_step`."""
    return {
        "index": index,
        "start_step": start_step,
        "max_duration_tokens": max_duration_tokens(exp.config),
        "exposure_tokens": exp.config.train.exposure_tokens,
        "fingerprint": exp.fingerprint,
        "started_at": _now(),
    }


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

    def record(self) -> RunJson:
        """run.json, typed (runner.runs.runjson: older formats' defaults filled in)."""
        return RunJson.from_dict(self.read(), file=str(self.run_json))

    def update(self, **fields) -> dict:
        """The one writer of run.json: `fields` (each one RunJson names) merged into what it holds."""
        check_fields(fields, str(self.run_json))
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
        """The processed-work journal's lines, each of the shape the clock writes (a line of another shape
        was a traceback in the resume's replay, or a wall of 1e308 s carried into the run's cost). A line
        torn by a kill mid-write is skipped; repair_journal drops it before appending."""
        return checked_rows(read_jsonl(self.journal_path(), skip_torn=True), JOURNAL_FIELDS, self.journal_path())

    def repair_journal(self) -> None:
        if self.writer:
            repair_jsonl_tail(self.journal_path())


#: the first table of every report folder (runner.reports.tables), never at the top of a run folder
REPORT_MARK = "run_summary.parquet"


def is_report_copy(path: Path) -> bool:
    """A report folder (a run's report/ or a published copy): it holds run.json and experiment.yaml as
    copies, so it looks like a run folder, but is never one to resume, extend, sync or lock."""
    return (Path(path) / REPORT_MARK).exists()


def is_run_dir(path: Path) -> bool:
    """A run folder `runner launch` can resume: run.json and the experiment it trains, and no report's
    tables (`runner launch reports/X/Y --extend-to N` wrote a segment, a lock and fingerprint.txt into a
    published report, then failed)."""
    path = Path(path)
    return (path / "run.json").exists() and (path / "experiment.yaml").exists() and not is_report_copy(path)


def not_a_run_dir(path: Path, why: str = "not a run folder (no run.json / experiment.yaml)") -> RunnerError:
    """The one line for a folder that is not a run folder: `why`, or what a report folder is."""
    if is_report_copy(path):
        return RunnerError(
            "a report folder (its run.json and experiment.yaml are copies), not a run folder: give the run "
            "folder it reports on (runs/<experiment>/<run_id>)",
            file=str(path),
        )
    return RunnerError(why, file=str(path))


def is_reportable_run(path: Path) -> bool:
    """A run folder a report can be built from: run.json and the ledger.json of its counters."""
    return (Path(path) / "run.json").exists() and (Path(path) / "ledger.json").exists()


def experiment_of_run(run_dir: Path) -> Experiment:
    """The resolved experiment a run folder trains (its own copy, not the file in experiments/)."""
    info = RunFolder(run_dir).record()
    root = Path(info.project_root or find_project_root(Path.cwd()))
    exp = load_saved_experiment(run_dir / "experiment.yaml", project_root=root)
    # Operational keys of a run's copy may be edited between attempts; quality targets are checked again.
    problems = Problems()
    check_targets(exp.config, run_dir / "experiment.yaml", problems)
    problems.raise_if_any()
    return exp


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


#: what a run folder holds (create_run_folder, the lock and its owner file, the ledger, the report)
RUN_FOLDER_ENTRIES = frozenset(
    ("checkpoints", "journal", "metrics", "manifests", "experiment.yaml", "fingerprint.txt", "run.json", "lock")
    + ("lock.owner", "ledger.json", "report", "downstream")
)


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
            "segments": [segment_record(0, 0, exp)],
            "status": "created",
            "committed_steps": 0,
            "conventions": None,
            "created_at": _now(),
        },
    )
