"""MLflow tracking of a run that survives a dead or flaky tracking server.

Owns: the tracking URI default, the one MLflow run per experiment run (its id lives in run.json
so resumes continue it), params/tags/metrics/artifacts, and the pending journal
`journal/mlflow-pending.jsonl` of what could not be sent. Every metric carries an explicit step
and timestamp, so re-sending a journal entry is idempotent in MLflow's store. Never raises into
the training loop because the server is unreachable, and never changes a logged param.
Only the main process tracks: other ranks hold a disabled tracker.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runner.fsio import atomic_write, read_jsonl

PENDING = Path("journal") / "mlflow-pending.jsonl"
RETRY_AFTER_SECONDS = 10.0  # after a failed send, queue without trying, so a hung server costs one timeout
_BATCH = 100  # MLflow's per-request limit for params and tags (metrics allow 1000)


def repo_root(start: Path | None = None) -> Path:
    """The enclosing git checkout of `start` (default cwd), else `start` itself."""
    start = Path(start or Path.cwd()).resolve()
    for p in (start, *start.parents):
        if (p / ".git").exists():
            return p
    return start


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def _fail_fast_env() -> None:
    # A dead server must cost seconds, not MLflow's default minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
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


class Tracker:
    """One MLflow run per experiment run; what cannot be sent goes to the pending journal."""

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
    ):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.run_id, self.experiment_id = run_id, experiment_id
        self.on_run_id = on_run_id or (lambda info: None)
        self.report = report
        self.pending_path = self.run_dir / PENDING
        self._client: Any = None  # an MlflowClient once first used
        self._retry_at = 0.0
        self._warned = False
        self._syncing = False
        self.last_error: str | None = None

    # ---- connection ---------------------------------------------------------------------------

    @property
    def client(self):
        if self._client is None:
            _fail_fast_env()
            from mlflow.tracking import MlflowClient  # noqa: PLC0415  (mlflow: seconds to import, first use only)

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def info(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id, "run_id": self.run_id}

    def _ensure_run(self, experiment_name: str, run_name: str) -> None:
        if self.run_id:
            return
        exp = self.client.get_experiment_by_name(experiment_name)
        if exp is None:
            location = None
            if self.tracking_uri.startswith("sqlite:///"):
                # Keep artifacts next to the store, whatever the cwd of later runs.
                location = (
                    (Path(self.tracking_uri[len("sqlite:///") :]).parent / "mlartifacts" / experiment_name)
                    .resolve()
                    .as_uri()
                )
            self.experiment_id = self.client.create_experiment(experiment_name, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id
        run = self.client.create_run(self.experiment_id, run_name=run_name)
        self.run_id = run.info.run_id
        self.on_run_id(self.info())

    # ---- pending journal ----------------------------------------------------------------------

    def _queue(self, entry: dict) -> None:
        self.pending_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.pending_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _read_pending(self) -> list[dict]:
        # A line torn by a kill mid-write is skipped; its data is re-sent by the next step's entry.
        return read_jsonl(self.pending_path, skip_torn=True)

    def _send(self, entry: dict) -> None:
        from mlflow.entities import Metric, Param, RunTag  # noqa: PLC0415  (mlflow: as above)

        kind = entry["kind"]
        if kind == "start":
            self._ensure_run(entry["experiment_name"], entry["run_name"])
            return
        if kind == "metrics":
            self._log_batch(
                "metrics",
                [
                    Metric(k, float(v), int(entry["timestamp_ms"]), int(entry["step"]))
                    for k, v in entry["metrics"].items()
                ],
                1000,
            )
        elif kind == "params":
            self._log_batch("params", [Param(k, v) for k, v in entry["params"].items()], _BATCH)
        elif kind == "tags":
            self._log_batch("tags", [RunTag(k, str(v)) for k, v in entry["tags"].items()], _BATCH)
        elif kind == "artifacts":
            path = Path(entry["path"])
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), entry.get("artifact_path"))
            elif path.exists():
                self.client.log_artifact(self.run_id, str(path), entry.get("artifact_path"))
        elif kind == "status":
            self.client.set_terminated(self.run_id, entry["status"])

    def _log_batch(self, kind: str, items: list, limit: int) -> None:
        for i in range(0, len(items), limit):
            self.client.log_batch(self.run_id, **{kind: items[i : i + limit]}, synchronous=True)

    def _deliver(self, entries: list[dict]) -> bool:
        """Send `entries` (after any pending ones); on failure everything unsent is journaled."""
        if not self.enabled:
            return True
        pending = self._read_pending()
        queue = pending + entries
        if time.monotonic() < self._retry_at:
            for e in entries:
                self._queue(e)
            return False
        sent = 0
        try:
            for entry in queue:
                if entry["kind"] != "start" and not self.run_id:
                    raise RuntimeError("no MLflow run yet")
                self._send(entry)
                sent += 1
        except Exception as e:  # any transport or server failure: keep training, keep the data
            self._retry_at = time.monotonic() + RETRY_AFTER_SECONDS
            self.last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if not self._warned and not self._syncing:  # a sync reports its own outcome; it journals nothing new
                self.report(f"mlflow: {self.tracking_uri} unavailable ({self.last_error}); journaling to {PENDING}")
                self._warned = True
            self._rewrite_pending(queue[sent:])
            return False
        if pending:
            self._rewrite_pending([])
            if self._warned:
                self.report(f"mlflow: reconnected, flushed {len(pending)} pending entries")
        self._warned = False
        return True

    def _rewrite_pending(self, entries: list[dict]) -> None:
        self.pending_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.pending_path, "".join(json.dumps(e) + "\n" for e in _dedupe(entries)).encode())

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
        entries: list[dict[str, Any]] = [{"kind": "start", "experiment_name": experiment_name, "run_name": run_name}]
        if params:
            entries.append({"kind": "params", "params": params})
        entries.append({"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}})
        entries += [{"kind": "artifacts", "path": str(p), "artifact_path": "config"} for p in artifacts]
        if self.run_id:
            entries = entries[1:]
        self._deliver(entries)

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> None:
        if not self.enabled or not metrics:
            return
        entry = {
            "kind": "metrics",
            "step": int(step),
            "timestamp_ms": int(timestamp_ms or time.time() * 1000),
            "metrics": {k: float(v) for k, v in metrics.items()},
        }
        self._deliver([entry])

    def log_tags(self, tags: dict[str, str]) -> None:
        if self.enabled and tags:
            self._deliver([{"kind": "tags", "tags": {k: str(v) for k, v in tags.items()}}])

    def log_artifacts(self, path: Path, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._deliver([{"kind": "artifacts", "path": str(path), "artifact_path": artifact_path}])

    def finish(self, status: str = "FINISHED") -> bool:
        """Flush everything and close the MLflow run; False when something is still pending."""
        if not self.enabled:
            return True
        self._retry_at = 0.0
        return self._deliver([{"kind": "status", "status": status}])

    def sync(self) -> tuple[int, int]:
        """Send the pending journal now (for `runner sync`): (entries sent, entries still pending).
        The reason of a failure is in `last_error`."""
        self._retry_at = 0.0
        before = len(_dedupe(self._read_pending()))
        self._syncing = True
        try:
            self._deliver([])
        finally:
            self._syncing = False
        left = len(self._read_pending())
        return max(before - left, 0), left


def _dedupe(entries: list[dict]) -> list[dict]:
    """Merge metric entries by (key, step), keeping the latest value; other entries as they are."""
    out: list[dict] = []
    seen: set[tuple[str, int]] = set()
    for e in reversed(entries):
        if e["kind"] == "metrics":
            fresh = {k: v for k, v in e["metrics"].items() if (k, e["step"]) not in seen}
            seen.update((k, e["step"]) for k in fresh)
            if fresh:
                out.append(dict(e, metrics=fresh))
        elif e["kind"] == "start" and any(o["kind"] == "start" for o in out):
            continue
        else:
            out.append(e)
    return list(reversed(out))
