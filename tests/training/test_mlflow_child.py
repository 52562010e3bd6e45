"""MLflow in a process of its own (runner.training.mlflow_child): what it stores equals what the
launch's own process stores (the reference), a dead one loses nothing, a stop does not end it, and a
launch records where MLflow ran and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import TEST_TIMEOUT_S
from trackingfixtures import metric_rows
from trainfixtures import launch, make_project

from runner.training import mlflow_child
from runner.training.mlflow_child import MlflowChild
from runner.training.tracking import Tracker


def _record(t: Tracker, artifact: Path) -> None:
    """One run's worth of entries: the start, params, tags, 1,200 metric rows (two requests), an
    artifact, the end."""
    t.start("exp", "r", params={"lr": "0.1", "name": "x"}, tags={"fingerprint": "abc"}, artifacts=[artifact])
    for step in range(1, 401):
        t.log_metrics({"loss": 10.0 / step, "tokens": step * 2048.0, "nan": float("nan")}, step=step, timestamp_ms=step)
    t.log_tags({"segment.1.end": "400"})
    assert t.finish()


def _stored(db: Path, run_id: str) -> dict:
    with sqlite3.connect(db) as c:
        return {
            "params": sorted(c.execute("select key, value from params where run_uuid=?", (run_id,)).fetchall()),
            "tags": sorted(
                (k, v)
                for k, v in c.execute("select key, value from tags where run_uuid=?", (run_id,))
                if k.startswith(("fingerprint", "segment"))
            ),
            "status": c.execute("select status from runs where run_uuid=?", (run_id,)).fetchone(),
            "metrics": [(k, s, None if v != v else v) for k, s, v in metric_rows(db, run_id)],
        }


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_its_own_process_stores_what_the_launchs_process_stores(tmp_path, store):
    artifact = tmp_path / "experiment.yaml"
    artifact.write_text("name: x\n")
    runs = {}
    for name, child in (("here", None), ("child", MlflowChild.start())):
        db = tmp_path / name / "mlflow.db"
        t = Tracker(tmp_path / name, tracking_uri=store(db), report=lambda m: None, child=child)
        _record(t, artifact)
        assert t.where == ("its own process" if child is not None else "the launch's process")
        runs[name] = _stored(db, t.run_id)
        files = list((db.parent / "mlartifacts").rglob("experiment.yaml"))
        assert len(files) == 1 and files[0].read_text() == "name: x\n"  # the artifact beside the store
        if child is not None:
            assert child.pid is None  # finish ended the process
    assert runs["child"] == runs["here"]
    assert len(runs["here"]["metrics"]) == 1200 and runs["here"]["status"] == ("FINISHED",)


@pytest.mark.slow  # ~6 s: a server process killed and started again
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_killed_mlflow_process_loses_nothing_and_is_started_again(tmp_path, store):
    db = tmp_path / "mlflow.db"
    said: list[str] = []
    child = MlflowChild.start()
    t = Tracker(tmp_path, tracking_uri=store(db), report=said.append, child=child)
    t.start("exp", "r", params=None, tags={})
    t.log_metrics({"loss": 1.0}, step=1)
    assert t.flush()
    first = child.pid
    os.kill(first, signal.SIGKILL)  # killed between requests: the next request starts another
    os.waitpid(first, 0)
    t.log_metrics({"loss": 0.5}, step=2)
    assert t.flush() and child.started == 2 and child.pid != first
    # one that ends during a request (it reads the request and exits without an answer)
    serving = child._proc
    child._proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    MlflowChild._reap(serving)
    t.log_metrics({"loss": 0.25}, step=3)
    assert not t.flush()  # that request failed: kept, journaled
    assert "ended during log_batch" in (t.last_error or "") and any("unavailable" in m for m in said)
    assert t.flush()  # the next try starts another process and sends what is pending, once
    assert child.started == 3
    assert metric_rows(db, t.run_id) == [("loss", 1, 1.0), ("loss", 2, 0.5), ("loss", 3, 0.25)]
    assert t.finish()


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_stop_signal_does_not_end_it_and_its_stdin_closing_does(tmp_path, store):
    uri = store(tmp_path / "mlflow.db")
    child = MlflowChild.start()
    assert child.call(uri, "experiment_id", ["none"], print) is None  # started and serving
    os.kill(child.pid, signal.SIGINT)  # Ctrl-C reaches the launch's whole process group
    os.kill(child.pid, signal.SIGTERM)  # so does a scheduler's stop: the launch's last entries still go
    assert child.call(uri, "experiment_id", ["none"], print) is None
    with pytest.raises(RuntimeError, match="not an MLflow call") as e:  # nothing but MlflowOps' calls
        child._proc.stdin.write(json.dumps({"id": 0, "uri": uri, "op": "__init__", "args": []}) + "\n")
        child._proc.stdin.flush()
        reply = json.loads(child._proc.stdout.readline())
        raise mlflow_child._remote_error(reply["type"], reply["error"])
    assert type(e.value).__name__ == "ValueError"
    proc = child._proc
    child.close()
    assert proc.returncode == 0 and child.pid is None


def test_which_launches_start_it(monkeypatch):
    monkeypatch.delenv(mlflow_child.ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert mlflow_child.wanted(True) and not mlflow_child.wanted(False)  # --no-tracking: none
    monkeypatch.setenv("RANK", "1")
    assert not mlflow_child.wanted(True)  # torchrun's other ranks never track
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(mlflow_child.ENV, "0")
    assert not mlflow_child.wanted(True)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("process", ["1", "0"])
def test_a_launch_records_where_mlflow_ran_and_leaves_no_process(tmp_path, monkeypatch, process):
    started: list[MlflowChild] = []
    real = MlflowChild.start.__func__

    def start(cls):
        child = real(cls)
        started.append(child)
        return child

    monkeypatch.setattr(MlflowChild, "start", classmethod(start))
    exp = make_project(tmp_path, steps=2, checkpoint_every=2, eval_every=2)
    run = tmp_path / "runs" / "r"
    launch(tmp_path, exp, "--run-dir", run, RUNNER_MLFLOW_PROCESS=process)
    info = json.loads((run / "run.json").read_text())
    where = "its own process" if process == "1" else "the launch's process"
    assert info["t_startup"]["attempts"][-1]["mlflow"] == where  # what ran is what is recorded
    assert f"MLflow in {where}" in (run / "report" / "report.md").read_text()
    assert len(started) == (1 if process == "1" else 0)
    for child in started:
        assert child.pid is None and child.started == 1  # ended with the launch, never restarted
    db = tmp_path / "mlflow.db"
    rows = metric_rows(db, info["mlflow"]["run_id"])
    assert "loss" in {k for k, _, _ in rows}
