"""MLflow tracking that survives a dead server: nothing lost, nothing sent twice."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainfixtures import env, make_project

from runner.fsio import read_jsonl
from runner.training.tracking import Tracker, flatten


def metric_rows(db: Path, run_id: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute(
            "select key, step, value from metrics where run_uuid=? order by key, step", (run_id,)
        ).fetchall()


def test_flatten_gives_dotted_string_params():
    assert flatten({"a": {"b": 1, "c": [0.9, 0.95]}, "d": None}) == {"a.b": "1", "a.c": "[0.9, 0.95]", "d": "None"}


def test_outage_is_journaled_then_flushed_exactly_once(tmp_path, monkeypatch):
    db = tmp_path / "mlflow.db"
    t = Tracker(tmp_path, tracking_uri=f"sqlite:///{db}", report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={"fingerprint": "abc"})
    t.log_metrics({"loss": 3.0}, step=1)
    real_send = t._send
    down = {"on": True}

    def flaky(entry):
        if down["on"]:
            raise ConnectionError("server down")
        return real_send(entry)

    monkeypatch.setattr(t, "_send", flaky)
    t.log_metrics({"loss": 2.5, "lr": 0.1}, step=2)
    t._retry_at = 0.0
    t.log_metrics({"loss": 2.0}, step=3)
    pending = read_jsonl(tmp_path / "journal" / "mlflow-pending.jsonl")
    assert [e["step"] for e in pending] == [2, 3]
    down["on"] = False
    t._retry_at = 0.0
    t.log_metrics({"loss": 1.5}, step=4)  # the next step that succeeds flushes the journal first
    assert not read_jsonl(tmp_path / "journal" / "mlflow-pending.jsonl")
    # A journal re-sent after a crash between send and truncate must not duplicate anything.
    t._deliver([{"kind": "metrics", "step": 4, "timestamp_ms": 1, "metrics": {"loss": 1.5}}])
    rows = metric_rows(db, t.run_id)
    assert [(k, s) for k, s, _ in rows if k == "loss"].count(("loss", 2)) == 1
    assert sorted({(k, s) for k, s, _ in rows}) == [("loss", 1), ("loss", 2), ("loss", 3), ("loss", 4), ("lr", 2)]


def test_dead_server_fails_fast_and_sync_sends_later(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    t = Tracker(tmp_path, tracking_uri=f"http://127.0.0.1:{port}", report=lambda m: None)
    t0 = time.monotonic()
    t.start("exp", "r", params={"lr": "0.1"}, tags={})
    for step in range(1, 4):
        t.log_metrics({"loss": float(step)}, step=step)
    assert time.monotonic() - t0 < 10
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "journal" / "mlflow-pending.jsonl")]
    assert kinds == ["start", "params", "tags", "metrics", "metrics", "metrics"]
    # The store comes back (here: a local file store stands in for the restarted server).
    t2 = Tracker(tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", report=lambda m: None)
    assert t2.sync() == (6, 0)
    assert [(k, s) for k, s, _ in metric_rows(tmp_path / "m.db", t2.run_id)] == [("loss", 1), ("loss", 2), ("loss", 3)]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _server(tmp: Path, port: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp / 'server.db'}",
            "--default-artifact-root",
            str(tmp / "artifacts"),
            "--workers",
            "1",
        ],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    import urllib.request

    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p
        except OSError:
            time.sleep(0.5)
    p.kill()
    raise AssertionError("mlflow server did not start")


def _stop(p: subprocess.Popen) -> None:
    import os
    import signal

    os.killpg(p.pid, signal.SIGKILL)  # the server's own process group (gunicorn/uvicorn workers)
    p.wait()


@pytest.mark.slow
def test_real_server_killed_mid_run_every_metric_exactly_once(tmp_path):
    port = _free_port()
    server = _server(tmp_path, port)
    exp = make_project(tmp_path, steps=300, checkpoint_every=100, eval_every=100)
    run = tmp_path / "runs" / "s"
    e = env(tmp_path, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}")
    p = subprocess.Popen(
        [sys.executable, "-m", "runner", "launch", str(exp), "--run-dir", str(run)],
        cwd=tmp_path,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    train_log = run / "metrics" / "train.jsonl"
    while p.poll() is None and not (train_log.exists() and len(read_jsonl(train_log)) > 20):
        time.sleep(0.2)
    _stop(server)
    time.sleep(3)
    server = _server(tmp_path, port)
    out, err = p.communicate(timeout=300)
    try:
        assert p.returncode == 0, err
        assert "unavailable" in err
        subprocess.run(
            [sys.executable, "-m", "runner", "sync", str(run)], cwd=tmp_path, env=e, check=True, capture_output=True
        )
        info = json.loads((run / "run.json").read_text())
        rows = metric_rows(tmp_path / "server.db", info["mlflow"]["run_id"])
        loss_steps = [s for k, s, _ in rows if k == "loss"]
        assert loss_steps == list(range(1, 301))  # every step once: nothing lost, nothing twice
        assert len(rows) == len(set((k, s) for k, s, _ in rows))
        assert not read_jsonl(run / "journal" / "mlflow-pending.jsonl")
    finally:
        _stop(server)


@pytest.mark.parametrize("via", ["flag", "env"])
def test_sync_sends_to_a_moved_server_and_records_it(tmp_path, monkeypatch, capsys, via):
    import argparse

    from runner.cli.train import cmd_sync

    dead = f"http://127.0.0.1:{_free_port()}"
    run = tmp_path / "run"
    t = Tracker(run, tracking_uri=dead, report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={})
    t.log_metrics({"loss": 1.0}, step=1)
    (run / "experiment.yaml").write_text("name: t\n")
    (run / "run.json").write_text(json.dumps({"run_id": "r", "mlflow": t.info()}))
    moved = f"sqlite:///{tmp_path / 'moved.db'}"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if via == "env":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", moved)
    assert cmd_sync(argparse.Namespace(run_dir=str(run), tracking_uri=moved if via == "flag" else None)) == 0
    out = capsys.readouterr()
    assert "journaling" not in out.out + out.err
    assert f"sent 4 pending MLflow entries to {moved}; none left" in out.out
    info = json.loads((run / "run.json").read_text())["mlflow"]
    assert info["tracking_uri"] == moved and info["run_id"]
    assert [(k, s) for k, s, _ in metric_rows(tmp_path / "moved.db", info["run_id"])] == [("loss", 1)]
