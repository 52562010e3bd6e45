"""A real `mlflow server` killed mid-run, and a trainer SIGKILLed mid-run: every metric of every step
exactly once (per attempt)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trackingfixtures import free_port, metric_rows, pending
from trainfixtures import env, make_project

from runner.fsio import read_jsonl


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
        # the tracking server alone: MLflow 3's job runner (a process and seven huey consumers, each
        # importing mlflow: tens of CPU seconds per start) serves nothing a run sends
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    import urllib.request

    deadline = time.time() + SUBPROCESS_TIMEOUT_S
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p
        except OSError:
            time.sleep(0.5)
    _stop(p)  # the whole group: uvicorn and the job runner outlive a killed `mlflow server`
    raise AssertionError("mlflow server did not start")


def _stop(p: subprocess.Popen) -> None:
    import signal

    os.killpg(p.pid, signal.SIGKILL)  # the server's own process group (gunicorn/uvicorn workers)
    p.wait()


@pytest.mark.longest
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_real_server_killed_mid_run_every_metric_exactly_once(tmp_path):
    port = free_port()
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
    while p.poll() is None and not (train_log.exists() and len(read_jsonl(train_log, skip_torn=True)) > 20):
        time.sleep(0.2)
    _stop(server)
    time.sleep(3)
    server = _server(tmp_path, port)
    out, err = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    try:
        assert p.returncode == 0, err
        assert "unavailable" in err
        synced = subprocess.run(
            [sys.executable, "-m", "runner", "sync", str(run)],
            cwd=tmp_path,
            env=e,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert synced.returncode == 0, synced.stdout + synced.stderr + err[-3000:]
        info = json.loads((run / "run.json").read_text())
        rows = metric_rows(tmp_path / "server.db", info["mlflow"]["run_id"])
        loss_steps = [s for k, s, _ in rows if k == "loss"]
        assert loss_steps == list(range(1, 301))  # every step once: nothing lost, nothing twice
        assert len(rows) == len(set((k, s) for k, s, _ in rows))
        assert not read_jsonl(run / "journal" / "mlflow-pending.jsonl")
    finally:
        _stop(server)


STEP_KEYS = ("loss", "lr", "grad_norm", "tokens.total.exposure", "tokens.a.processed", "realized_ratio.b")


@pytest.mark.longest
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_trainer_sigkilled_mid_run_every_metric_of_every_step_once_per_attempt(tmp_path):
    """SIGKILL the trainer while metrics are journaled but not yet in MLflow (a real server), resume.

    What "once" means: MLflow stores (key, step, timestamp, value) rows. An entry sent again after
    the kill (it may have reached MLflow before its `ack`) is the same row and must not be stored
    twice. A step the resume redoes (after the checkpoint, before the kill) is a new observation:
    one row per attempt that committed it, the newest latest. Every step has every key."""
    port = free_port()
    server = _server(tmp_path, port)
    steps, checkpoint = 120, 40
    exp = make_project(tmp_path, steps=steps, checkpoint_every=checkpoint, eval_every=1000)
    run = tmp_path / "runs" / "k"
    e = env(tmp_path, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}")
    cmd = [sys.executable, "-m", "runner", "launch", str(exp), "--run-dir", str(run)]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    train_log = run / "metrics" / "train.jsonl"
    deadline = time.time() + SUBPROCESS_TIMEOUT_S
    try:
        # Past the step-40 checkpoint, at a moment entries wait in the journal for the next request.
        while p.poll() is None and time.time() < deadline:
            rows = read_jsonl(train_log, skip_torn=True)
            if len(rows) > checkpoint + 15 and len([x for x in pending(run) if x["kind"] == "metrics"]) >= 2:
                break
            time.sleep(0.01)
        p.kill()
        p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        assert p.returncode == -9, "the trainer ended before it was killed"
        first = [r["step"] for r in read_jsonl(train_log, skip_torn=True)]
        killed_after = max(first)
        assert checkpoint < killed_after < steps
        assert [x for x in pending(run) if x["kind"] == "metrics"], "nothing was waiting to be sent at the kill"
        resumed = subprocess.run(
            [sys.executable, "-m", "runner", "launch", str(run)],
            cwd=tmp_path,
            env=e,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resuming from step-{checkpoint:07d}" in resumed.stderr
        info = json.loads((run / "run.json").read_text())
        with sqlite3.connect(tmp_path / "server.db") as c:
            rows = c.execute(
                "select key, step, timestamp, value from metrics where run_uuid=?", (info["mlflow"]["run_id"],)
            ).fetchall()
        by_key_step: dict[tuple, list] = {}
        for key, step, ts, value in rows:
            by_key_step.setdefault((key, step), []).append((ts, value))
        for key in STEP_KEYS:
            assert {s for k, s in by_key_step if k == key} == set(range(1, steps + 1)), key
            for step in range(1, steps + 1):
                observed = by_key_step[(key, step)]
                assert len({ts for ts, _ in observed}) == len(observed), (key, step, observed)  # no row twice
                # Attempt 1 committed 1..killed_after (its tracker may not have journaled the very
                # last one); attempt 2 redid checkpoint+1..steps.
                expected = {1} if step <= checkpoint or step > killed_after else {2}
                if step == killed_after:
                    expected = {1, 2}
                assert len(observed) in expected, (key, step, observed)
                if key in ("loss", "tokens.total.exposure"):  # the resume is bit-identical
                    assert len({v for _, v in observed}) == 1, (key, step, observed)
        from mlflow.tracking import MlflowClient

        latest = MlflowClient(f"http://127.0.0.1:{port}").get_run(info["mlflow"]["run_id"]).data.metrics
        ledger = json.loads((run / "ledger.json").read_text())["counters"]
        for d, counts in ledger.items():
            for name in ("processed", "exposure", "useful", "unique", "lost"):
                assert latest[f"tokens.{d}.{name}"] == counts[name], (d, name)
        assert read_jsonl(run / "journal" / "mlflow-pending.jsonl") == []
    finally:
        if p.poll() is None:
            p.kill()
        _stop(server)
