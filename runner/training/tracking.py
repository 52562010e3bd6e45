"""MLflow tracking of a run that survives a dead or flaky tracking server and a SIGKILL.

Owns: the tracking URI (default, made absolute, never an empty store created in place of one a run
says holds it), the one MLflow run per experiment run (its id lives in run.json so resumes
continue it), params/tags/metrics/artifacts, and the pending journal
`journal/mlflow-pending.jsonl`.

Delivery is asynchronous and loses nothing. The training thread appends every entry to the pending
journal first (flushed to the OS: a SIGKILL of the process keeps it) and hands it to a background
thread, which sends entries in journal order, merged into few requests, at most every
DELIVER_EVERY_SECONDS. Only after MLflow confirmed a request does the thread append an `ack` line
for it; once everything is acknowledged the journal is truncated. At the next start, entries after
the last `ack` are sent again. An entry is a fixed (key, step, timestamp, value) row: re-sending one
that reached MLflow just before a kill stores nothing new (the row is MLflow's primary key), so no
observation is stored twice. A step redone after a restart is a new observation (new timestamp);
MLflow keeps one row per attempt that committed the step, and its latest row is the newest attempt's.

Entries a process sends from an earlier process's journal (`runner sync`, or the next launch of the
run after a kill or a dead server) reached MLflow after the process that made them had ended: only
the run folder, which anyone can rewrite, vouched for them in between. Each such process says so in
one MLflow tag of its own, `REPLAYED_TAG.<id>` (what it sent: kinds, metric rows and their steps, tag
keys, the run itself), which `runner audit` reads (runner.reports.audit.tracked).

Never raises into the training loop because the server is unreachable, never blocks a step on the
network, and never changes a logged param. Only the main process tracks: other ranks hold a
disabled tracker.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from runner.config.load import repo_root
from runner.errors import RunnerError
from runner.fsio import atomic_write, read_jsonl
from runner.runs.recorded import number, whole

PENDING = Path("journal") / "mlflow-pending.jsonl"
RETRY_AFTER_SECONDS = 10.0  # after a failed send, wait this long before trying again
# Entries wait up to this long to share one request: MLflow's SQLite write costs ~13 ms per request
# whatever its size, so a run of fast steps pays it once a second, not once a step.
DELIVER_EVERY_SECONDS = 1.0
HTTP_TIMEOUT_SECONDS = 30.0  # one MLflow request (unless MLFLOW_HTTP_REQUEST_TIMEOUT says otherwise)
CLOSE_WAIT_SECONDS = 2 * HTTP_TIMEOUT_SECONDS  # the most `close` waits for a request in flight
# Before its first step a launch waits this long, at most, for MLflow's start (its import, a new
# store's tables, the run: seconds of Python that, in the background, would slow the first steps).
START_WAIT_SECONDS = HTTP_TIMEOUT_SECONDS
_BATCH = 100  # MLflow's per-request limit for params and tags
_METRICS_PER_REQUEST = 1000  # MLflow's per-request limit for metrics
REPLAYED_TAG = "runner.replayed"  #: + ".<id>": entries one process sent from an earlier process's journal


def default_tracking_uri() -> str:
    return absolute_uri(os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}")


def sqlite_path(uri: str | None) -> Path | None:
    """The database file of a `sqlite:///` URI (relative as written), else None."""
    if not uri or not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def absolute_uri(uri: str) -> str:
    """`uri` with a relative SQLite file or local folder made absolute against the current folder:
    recorded in run.json, it must name the same store from wherever the run is resumed."""
    path = sqlite_path(uri)
    if path is not None and not path.is_absolute():
        rest = uri[len("sqlite:///") :]
        query = rest[len(str(rest).split("?", 1)[0]) :]
        return f"sqlite:///{path.resolve()}{query}"
    if "://" not in uri and not uri.startswith("file:") and not Path(uri).is_absolute():
        return str(Path(uri).resolve())  # a bare folder: MLflow's file store
    return uri


def missing_store(uri: str | None) -> str | None:
    """Why opening `uri` would create a store rather than read one (a SQLite file or local folder
    that does not exist, or a relative path, whose meaning depends on the current folder); None when
    it names an existing local store or a server. MLflow creates a missing store on first contact."""
    if not uri:
        return "no tracking URI"
    path = sqlite_path(uri)
    if path is None and "://" not in uri:
        path = Path(uri[len("file:") :] if uri.startswith("file:") else uri)
    elif path is None and uri.startswith("file://"):
        path = Path(uri[len("file://") :])
    if path is None:
        return None
    if not path.is_absolute():
        return f"relative store path {path} (relative to which folder is unknown)"
    if not path.exists():
        return f"no MLflow store at {path} on this machine"
    return None


def check_run_store(uri: str, run_id: str | None, run_json: Path) -> None:
    """Refuse to track a run whose MLflow run exists somewhere into a store that does not exist:
    MLflow would create an empty one and the run's history would silently split in two."""
    path = sqlite_path(uri)
    if not run_id or path is None or path.exists():
        return
    raise RunnerError(
        f"MLflow run {run_id} of this run is in a store at {path}, which does not exist (moved or "
        f"deleted?); refusing to create an empty one: restore it, or send to the store that holds the "
        f"run with `runner sync {run_json.parent} --tracking-uri URI` (recorded for later resumes)",
        file=str(run_json),
        key="mlflow.tracking_uri",
    )


def store_lacks_run(uri: str, run_id: str) -> str | None:
    """Why the MLflow store at `uri` does not hold run `run_id` (None when it does): no SQLite file
    there (never created), the server unreachable, or no such run in it. Fails fast on a dead server."""
    path = sqlite_path(uri)
    if (path is not None and not path.is_file()) or uri == "sqlite:///":
        return f"no MLflow store at {path or uri}"
    fail_fast_env()
    from mlflow.tracking import MlflowClient  # noqa: PLC0415  (mlflow: seconds to import, first use only)

    try:
        MlflowClient(tracking_uri=uri).get_run(run_id)
    except Exception as err:  # mlflow raises its own, requests' and SQLAlchemy's errors
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return None


def _half_made(path: Path) -> bool:
    """True for an SQLite file that MLflow began to create but did not finish (a kill while its tables
    were made: MLflow's migrations are not one transaction) and that holds no run; MLflow itself
    would fail on it forever ("table ... already exists")."""
    from mlflow.store.db.utils import Base  # noqa: PLC0415  (mlflow: as in Tracker.client)

    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
            runs = con.execute("select count(*) from runs").fetchone()[0] if "runs" in tables else 0
        finally:
            con.close()
    except sqlite3.Error:
        return False  # not a database MLflow could have begun: leave it, MLflow's error names it
    return not set(Base.metadata.tables) <= tables and runs == 0


def ensure_sqlite_store(path: Path, report: Callable[[str], None] = print) -> None:
    """Make MLflow's SQLite store at `path` so that a kill at any moment leaves either no file or a
    whole store: the tables are made in a temporary file beside it, which is then linked into place
    (atomic; a store another process made meanwhile wins). A half-made store left by an older
    runner (or MLflow itself) that holds no run is moved aside, not deleted, and made again."""
    from mlflow.tracking._tracking_service.utils import _get_store  # noqa: PLC0415  (mlflow: as above)

    if path.exists():
        if not _half_made(path):
            return
        aside = path.with_name(f"{path.name}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(path, aside)
        report(f"mlflow: {path} was half-made (its creation was interrupted) and held no run; moved to {aside.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        store = _get_store(f"sqlite:///{tmp}")  # as MlflowClient would make it: MLflow's tables and migrations
        store.engine.dispose()
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # made by another process meanwhile: that one is the store
        except OSError:  # a file system without hard links: a rename, unless one appeared meanwhile
            if not path.exists():
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fail_fast_env(timeout_seconds: float = HTTP_TIMEOUT_SECONDS) -> None:
    """Before any MLflow request: a dead server must cost seconds, not MLflow's default minutes of
    retries (`runner report RUN_ID` against a refused loopback port took 4 min 10 s). A variable the
    user set wins. Tracking: the delivery thread retries every RETRY_AFTER_SECONDS itself, requests
    leave from that thread, so a slow answer never stalls a step; the timeout is long enough for a
    1,000-metric batch to a busy server and only bounds how long the end of a run waits for a hung one."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(timeout_seconds)))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")


def flatten(d, prefix: str = "") -> dict[str, str]:
    """Nested dict/list as dotted keys with string values (MLflow params)."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, list) and any(isinstance(v, (dict, list)) for v in d):
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = json.dumps(d) if isinstance(d, list) else str(d)
    return out


def git_commit(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


_STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")  # MLflow's run statuses


def _entry_problem(e: Any) -> str | None:
    """What is wrong with a journal line, as `_Journal.append`, `ack` and the Tracker write them; None if
    nothing."""
    if not isinstance(e, dict):
        return f"a {type(e).__name__}, not a mapping"
    kind = e.get("kind")
    if "seq" in e and not whole(e["seq"]):
        return f"seq {e['seq']!r} is not a whole number >= 0"
    if kind == "ack":
        return None if "seq" in e else "an ack without its seq"
    if kind == "start":
        bad = [k for k in ("experiment_name", "run_name") if not isinstance(e.get(k), str) or not e[k]]
        if e.get("token") is not None and not isinstance(e["token"], str):
            bad.append("token")
        return f"{', '.join(bad)} not text" if bad else None
    if kind in ("params", "tags"):
        items = e.get(kind)
        if not isinstance(items, dict) or not all(
            isinstance(v, str | int | float | bool) or v is None for v in items.values()
        ):
            return f"{kind} not a mapping of names to values"
        return None
    if kind == "artifacts":
        if not isinstance(e.get("path"), str) or not isinstance(e.get("artifact_path"), str | None):
            return "path or artifact_path not text"
        return None
    if kind == "status":
        return None if e.get("status") in _STATUSES else f"status {e.get('status')!r} is not one of {_STATUSES}"
    if kind == "metrics":
        if not whole(e.get("step")) or not whole(e.get("timestamp_ms")):
            return "step or timestamp_ms not a whole number >= 0"
        metrics = e.get("metrics")
        if not isinstance(metrics, dict) or not all(map(number, metrics.values())):
            return "metrics not a mapping of names to numbers"
        return None
    return f"kind {kind!r} is not one of ack, start, params, tags, artifacts, status, metrics"


class _Journal:
    """The pending journal: entries numbered by `seq`, `ack` lines for delivered prefixes.

    Not thread-safe on its own: the Tracker holds its lock around every call."""

    def __init__(self, path: Path):
        self.path = path
        self.file: TextIO | None = None
        self.next_seq = 0

    def load(self) -> list[dict]:
        """Entries not yet acknowledged, in order; the file is rewritten to hold just them. An entry this
        runner did not write (another shape, an unknown kind) is a RunnerError naming it: sent as it is it
        was a traceback, a request MLflow refuses at every retry, or, of an unknown kind, dropped unsaid."""
        acked, entries = -1, []
        for line in read_jsonl(self.path, skip_torn=True):  # a line torn by a kill is skipped
            problem = _entry_problem(line)
            if problem:
                text = json.dumps(line, default=str)
                raise RunnerError(
                    f"{problem}: an entry this runner does not write ({text[:120]}{'...' if len(text) > 120 else ''}); "
                    "nothing was sent: restore or remove that line",
                    file=str(self.path),
                )
            if line.get("kind") == "ack":
                acked = max(acked, int(line["seq"]))
            else:
                entries.append(line)
        # Entries without `seq` (a journal of an older runner) were never acknowledged.
        pending = [e for e in entries if int(e.get("seq", acked + 1)) > acked]
        pending = [{**e, "seq": i} for i, e in enumerate(pending)]
        self.next_seq = len(pending)
        if self.path.exists():
            atomic_write(self.path, "".join(json.dumps(e) + "\n" for e in pending).encode())
        return pending

    def append(self, entries: list[dict]) -> list[dict]:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a")
        numbered = []
        for e in entries:
            numbered.append({"seq": self.next_seq, **e})
            self.next_seq += 1
        self.file.write("".join(json.dumps(e) + "\n" for e in numbered))
        self.file.flush()  # in the OS before anyone may send it: a SIGKILL keeps it
        return numbered

    def ack(self, seq: int, everything: bool) -> None:
        """Entries up to `seq` reached MLflow; with `everything`, nothing is pending: truncate."""
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a")
        if everything:
            self.file.truncate(0)  # appends (O_APPEND) continue at the new end
        else:
            self.file.write(json.dumps({"kind": "ack", "seq": seq}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class MlflowOps:
    """The MLflow calls delivery makes, on plain data (names, ids, lists of rows), in the process that
    imports mlflow: the delivery thread's own, or MLflow's process of its own (ChildOps forwards to
    it). Opening one: the fail-fast HTTP settings, a SQLite store made whole (ensure_sqlite_store),
    the client. Rows: params and tags [key, value], metrics [key, value, timestamp_ms, step]."""

    #: what ChildOps may ask MLflow's process to run (runner.training.mlflow_child)
    CALLS = (
        "experiment_id",
        "create_experiment",
        "run_with_token",
        "create_run",
        "log_batch",
        "log_artifacts",
        "set_terminated",
    )

    def __init__(self, tracking_uri: str, report: Callable[[str], None] = print):
        fail_fast_env()
        from mlflow.tracking import MlflowClient  # noqa: PLC0415  (mlflow: seconds to import, first use only)

        path = sqlite_path(tracking_uri)
        if path is not None:
            ensure_sqlite_store(path, report)
        self.client = MlflowClient(tracking_uri=tracking_uri)

    def experiment_id(self, name: str) -> str | None:
        exp = self.client.get_experiment_by_name(name)
        return None if exp is None else str(exp.experiment_id)

    def create_experiment(self, name: str, artifact_location: str | None) -> str:
        return str(self.client.create_experiment(name, artifact_location=artifact_location))

    def run_with_token(self, experiment_id: str, token: str) -> str | None:
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.runner_start_token = '{token}'", max_results=1
        )
        return found[0].info.run_id if found else None

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str] | None) -> str:
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def log_batch(self, run_id: str, kind: str, rows: list[list]) -> None:
        from mlflow.entities import Metric, Param, RunTag  # noqa: PLC0415  (mlflow: as above)

        make = {"params": Param, "tags": RunTag, "metrics": Metric}[kind]
        self.client.log_batch(run_id, **{kind: [make(*row) for row in rows]}, synchronous=True)

    def log_artifacts(self, run_id: str, path: str, artifact_path: str | None) -> None:
        if Path(path).is_dir():
            self.client.log_artifacts(run_id, path, artifact_path)
        elif Path(path).exists():
            self.client.log_artifact(run_id, path, artifact_path)

    def set_terminated(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status)


class MlflowProcess(Protocol):
    """MLflow's process of its own (runner.training.mlflow_child.MlflowChild)."""

    def call(self, uri: str, op: str, args: list, report: Callable[[str], None]) -> Any: ...

    def close(self) -> None: ...


class ChildOps:
    """MlflowOps' calls, each run by MLflow's process of its own (runner.training.mlflow_child) on
    the store at `tracking_uri`; what that process said (a store moved aside) is reported here."""

    def __init__(self, child: MlflowProcess, tracking_uri: str, report: Callable[[str], None]):
        self.child, self.tracking_uri, self.report = child, tracking_uri, report

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in MlflowOps.CALLS:
            raise AttributeError(name)
        return lambda *args: self.child.call(self.tracking_uri, name, list(args), self.report)


class Tracker:
    """One MLflow run per experiment run, delivered from a background thread behind the journal."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool = True,
        tracking_uri: str | None = None,
        run_id: str | None = None,
        experiment_id: str | None = None,
        on_run_id: Callable[[dict], object] | None = None,
        report: Callable[[str], None] = print,
        child: MlflowProcess | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.child = child  #: MLflow's process of its own (runner.training.mlflow_child), else MLflow runs here
        self.enabled = enabled
        self.tracking_uri = absolute_uri(tracking_uri) if tracking_uri else default_tracking_uri()
        self.run_id, self.experiment_id = run_id, experiment_id
        self.on_run_id = on_run_id or (lambda info: None)
        self.report = report
        self.pending_path = self.run_dir / PENDING
        self.last_error: str | None = None
        self._client: MlflowOps | ChildOps | None = None  # once first used
        self._journal = _Journal(self.pending_path)
        self._cond = threading.Condition()
        self._queue: list[dict] | None = None  # journaled, not yet confirmed by MLflow; None: not loaded
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None  # the running thread's own stop flag
        self._sending = threading.Lock()  # one delivery attempt at a time, even past a `close` that timed out
        self._force = False  # send now, whatever the cadence or the retry wait
        self._send_at = 0.0  # monotonic time of the next send (cadence, or retry after a failure)
        self._attempts_started = self._attempts_done = 0
        self._warned = False
        self._quiet = False  # `runner sync` reports its own outcome
        self._inherited = 0  # entries seq < this were journaled by an earlier process (loaded at start)
        self._replayed: dict[str, Any] = {}  # what this process sent of them (REPLAYED_TAG)
        self._replay_told = True  # the tag says all of it
        self._replay_id = uuid.uuid4().hex[:12]

    # ---- connection (background thread) ------------------------------------------------------

    @property
    def client(self) -> MlflowOps | ChildOps:
        """The MLflow operations: in MLflow's process of its own when the tracker has one
        (runner.training.mlflow_child), else here (mlflow imported on first use)."""
        if self._client is None:
            if self.child is not None:
                self._client = ChildOps(self.child, self.tracking_uri, self.report)
            else:
                self._client = MlflowOps(self.tracking_uri, self.report)
        return self._client

    @property
    def where(self) -> str:
        """Where MLflow runs, as run.json's t_startup records it."""
        return "its own process" if self.child is not None else "the launch's process"

    def info(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id, "run_id": self.run_id}

    def _ensure_run(self, entry: dict) -> None:
        if self.run_id:
            return
        name = entry["experiment_name"]
        experiment_id = self.client.experiment_id(name)
        run_id = None
        if experiment_id is None:
            location = None
            path = sqlite_path(self.tracking_uri)
            if path is not None:
                # Keep artifacts next to the store, whatever the cwd of later runs.
                location = (path.parent / "mlartifacts" / name).resolve().as_uri()
            self.experiment_id = self.client.create_experiment(name, location)
        else:
            self.experiment_id = experiment_id
            if entry.get("token"):
                # Created just before a kill, never recorded in run.json: continue it, not a second run.
                run_id = self.client.run_with_token(self.experiment_id, entry["token"])
        if run_id is None:
            tags = {"runner_start_token": entry["token"]} if entry.get("token") else None
            run_id = self.client.create_run(self.experiment_id, entry["run_name"], tags)
        self.run_id = run_id
        self.on_run_id(self.info())

    def _send(self, entry: dict) -> None:
        kind = entry["kind"]
        if kind == "start":
            self._ensure_run(entry)
            return
        if not self.run_id:
            raise RuntimeError("no MLflow run yet")
        if kind == "params":
            self._log_batch("params", [[k, str(v)] for k, v in entry["params"].items()], _BATCH)
        elif kind == "tags":
            self._log_batch("tags", [[k, str(v)] for k, v in entry["tags"].items()], _BATCH)
        elif kind == "artifacts":
            self.client.log_artifacts(self.run_id, entry["path"], entry.get("artifact_path"))
        elif kind == "status":
            self.client.set_terminated(self.run_id, entry["status"])

    def _send_metrics(self, entries: list[dict]) -> None:
        if not self.run_id:
            raise RuntimeError("no MLflow run yet")
        rows = [[k, float(v), int(e["timestamp_ms"]), int(e["step"])] for e in entries for k, v in e["metrics"].items()]
        self._log_batch("metrics", rows, _METRICS_PER_REQUEST)

    def _log_batch(self, kind: str, items: list, limit: int) -> None:
        if not self.run_id:
            raise RuntimeError("no MLflow run yet")
        for i in range(0, len(items), limit):
            self.client.log_batch(self.run_id, kind, items[i : i + limit])

    # ---- delivery (background thread) --------------------------------------------------------

    def _groups(self, batch: list[dict]) -> list[list[dict]]:
        """Consecutive metric entries merged up to one request's worth; every other entry alone."""
        groups: list[list[dict]] = []
        size = 0
        for e in batch:
            n = len(e.get("metrics", ())) if e["kind"] == "metrics" else -1
            last = groups[-1] if groups else None
            if n >= 0 and last and last[0]["kind"] == "metrics" and size + n <= _METRICS_PER_REQUEST:
                last.append(e)
                size += n
            else:
                groups.append([e])
                size = max(n, 0)
        return groups

    def _attempt(self, batch: list[dict]) -> None:
        """Send `batch` (the queue's head) group by group; acknowledge each group MLflow confirmed."""
        error = None
        for group in self._groups(batch):
            try:
                if group[0]["kind"] == "start":  # the run first (the tag needs it); it holds no figure yet
                    self._send(group[0])
                    self._note_replayed(group)
                else:
                    self._note_replayed(group)
                    self._tell_replayed()  # before the entries: a kill in between never leaves them untold
                    if group[0]["kind"] == "metrics":
                        self._send_metrics(group)
                    else:
                        self._send(group[0])
            except Exception as e:  # any transport or server failure: keep training, keep the data
                error = e
                break
            with self._cond:
                while self._queue and self._queue[0]["seq"] <= group[-1]["seq"]:
                    self._queue.pop(0)
                self._journal.ack(group[-1]["seq"], everything=not self._queue)
        if error is None:
            try:
                self._tell_replayed()
            except Exception as e:  # told at the next attempt
                error = e
        with self._cond:
            now = time.monotonic()
            if error is not None:
                self._send_at = now + RETRY_AFTER_SECONDS
                self.last_error = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
                if not self._warned and not self._quiet:
                    self.report(f"mlflow: {self.tracking_uri} unavailable ({self.last_error}); journaling to {PENDING}")
                    self._warned = True
            else:
                self._send_at = now + DELIVER_EVERY_SECONDS
                if self._warned and not self._quiet:
                    self.report("mlflow: reconnected, pending entries sent")
                self._warned = False

    def _tell_replayed(self) -> None:
        """Set this process's REPLAYED_TAG to what it has sent (or is about to send) of an earlier
        process's journal, where the tag does not say it yet."""
        if not self._replay_told and self.run_id:
            self._log_batch("tags", [[f"{REPLAYED_TAG}.{self._replay_id}", json.dumps(self._replayed)]], _BATCH)
            self._replay_told = True

    def _note_replayed(self, group: list[dict]) -> None:
        """Count what `group` (being sent) holds of an earlier process's journal; a group sent again after a
        failure counts again (the tag may over-state what reached MLflow, never under-state it)."""
        old = [e for e in group if int(e["seq"]) < self._inherited]
        if not old:
            return
        r = self._replayed
        r.setdefault("by", "runner sync" if self._quiet else "runner launch (a later start of the run)")
        r.setdefault("at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        for e in old:
            kinds = r.setdefault("kinds", {})
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
            if e["kind"] == "metrics":
                r["metric_rows"] = r.get("metric_rows", 0) + len(e["metrics"])
                step = int(e["step"])
                r["steps"] = [min(step, r["steps"][0]), max(step, r["steps"][1])] if "steps" in r else [step, step]
            elif e["kind"] == "tags":  # the run's end logs its evidence as tags
                evidence = sum(k.startswith("evidence.") for k in e["tags"])
                r["evidence_tags"] = r.get("evidence_tags", 0) + evidence
                r["other_tags"] = r.get("other_tags", 0) + len(e["tags"]) - evidence
        self._replay_told = False

    def _worker(self, stop: threading.Event) -> None:
        while True:
            with self._cond:
                while not stop.is_set() and not (self._queue and (self._force or time.monotonic() >= self._send_at)):
                    self._cond.wait(max(self._send_at - time.monotonic(), 0.01) if self._queue else None)
                if stop.is_set():
                    return
                self._force = False
                self._attempts_started += 1
                attempt = self._attempts_started
            try:
                with self._sending:
                    with self._cond:
                        batch = list(self._queue or [])
                    self._attempt(batch)
            finally:  # whatever happened, a waiting flush must learn that this attempt is over
                with self._cond:
                    self._attempts_done = attempt
                    self._cond.notify_all()

    # ---- the training thread's side ----------------------------------------------------------

    def _load(self) -> list[dict]:
        """Read what an earlier process left unsent (under the lock, once); the queue."""
        if self._queue is None:
            self._queue = self._journal.load()
            self._inherited = len(self._queue)  # numbered 0..n-1 by load; this process's entries follow
        if self._thread is None:
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._worker, args=(self._stop,), name="mlflow-delivery", daemon=True
            )
            self._thread.start()
        return self._queue

    def _submit(self, entries: list[dict]) -> None:
        if not self.enabled or not entries:
            return
        with self._cond:
            queue = self._load()
            queue.extend(self._journal.append(entries))
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Send everything journaled so far now (one try); False if something is still pending.
        With `timeout`, wait at most that many seconds for the try (it goes on in the background).
        The reason of a failure is in `last_error`."""
        if not self.enabled:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._load()
            if not self._queue:
                return True
            want = self._attempts_started + 1  # an attempt that starts after this call sees every entry
            self._force = True
            self._cond.notify_all()
            while self._queue and self._attempts_done < want and self._thread is not None and self._thread.is_alive():
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if left <= 0:
                    break
                self._cond.wait(left)
            return not self._queue

    def close(self) -> None:
        """Stop the delivery thread (after a request in flight) and MLflow's process, close the journal."""
        with self._cond:
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
            if stop is not None:
                stop.set()
            self._cond.notify_all()
        if thread is not None:
            thread.join(CLOSE_WAIT_SECONDS)
        if self.child is not None:  # MLflow's process ends (a later use of this tracker starts another)
            self.child.close()
        with self._cond:
            self._journal.close()

    def pending_entries(self) -> int:
        with self._cond:
            return len(self._queue or [])

    # ---- public API ---------------------------------------------------------------------------

    def start(
        self,
        experiment_name: str,
        run_name: str,
        *,
        params: dict[str, str] | None,
        tags: dict[str, str],
        artifacts: Sequence[Path] = (),
    ) -> None:
        """Create (or continue) the MLflow run; `params=None` on resume: params never change."""
        if not self.enabled:
            return
        entries: list[dict[str, Any]] = []
        if not self.run_id:
            entries.append(
                {"kind": "start", "experiment_name": experiment_name, "run_name": run_name, "token": uuid.uuid4().hex}
            )
        if params:
            entries.append({"kind": "params", "params": params})
        entries.append({"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}})
        entries += [{"kind": "artifacts", "path": str(p), "artifact_path": "config"} for p in artifacts]
        self._submit(entries)

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> None:
        if not self.enabled or not metrics:
            return
        entry = {
            "kind": "metrics",
            "step": int(step),
            "timestamp_ms": int(timestamp_ms or time.time() * 1000),
            "metrics": {k: float(v) for k, v in metrics.items()},
        }
        self._submit([entry])

    def log_tags(self, tags: dict[str, str]) -> None:
        if self.enabled and tags:
            self._submit([{"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}}])

    def log_artifacts(self, path: Path, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._submit([{"kind": "artifacts", "path": str(path), "artifact_path": artifact_path}])

    def finish(self, status: str = "FINISHED") -> bool:
        """Send everything, close the MLflow run and stop delivering; False when something is
        still pending (it stays in the journal for the next start or `runner sync`)."""
        if not self.enabled:
            return True
        self._submit([{"kind": "status", "status": status}])
        done = self.flush()
        self.close()
        return done

    def sync(self) -> tuple[int, int]:
        """Send the pending journal now (for `runner sync`): (entries sent, entries still pending).
        The reason of a failure is in `last_error`."""
        self._quiet = True
        with self._cond:
            before = len(self._load())
        self.flush()
        left = self.pending_entries()
        self.close()
        return before - left, left
