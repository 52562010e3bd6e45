"""MLflow tracking that survives a dead server: nothing lost, nothing sent twice."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trainfixtures import env, make_project, step_record

from runner.fsio import read_jsonl
from runner.training.tracking import Tracker, flatten


def metric_rows(db: Path, run_id: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute(
            "select key, step, value from metrics where run_uuid=? order by key, step, timestamp", (run_id,)
        ).fetchall()


@pytest.fixture(scope="module")
def template_store(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, made once: creating one (its schema migrations) takes seconds."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("store") / "template.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture()
def store(template_store):
    """`store(path)`: an empty MLflow store at `path` (a copy of the template); returns its URI."""

    def make(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(template_store, path)
        return f"sqlite:///{path}"

    return make


def test_flatten_gives_dotted_string_params():
    assert flatten({"a": {"b": 1, "c": [0.9, 0.95]}, "d": None}) == {"a.b": "1", "a.c": "[0.9, 0.95]", "d": "None"}


def pending(run_dir: Path) -> list[dict]:
    """Entries of the pending journal that no `ack` line covers (what the next start re-sends)."""
    lines = read_jsonl(run_dir / "journal" / "mlflow-pending.jsonl", skip_torn=True)
    acked = max((e["seq"] for e in lines if e["kind"] == "ack"), default=-1)
    return [e for e in lines if e["kind"] != "ack" and e["seq"] > acked]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_metrics_are_journaled_first_and_sent_without_blocking_the_step(tmp_path, monkeypatch, store):
    db = tmp_path / "mlflow.db"
    t = Tracker(tmp_path, tracking_uri=store(db), report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={})
    assert t.flush()
    gate, sending = threading.Event(), threading.Event()
    real = t._send_metrics

    def slow_server(entries):
        sending.set()
        gate.wait(60)
        return real(entries)

    monkeypatch.setattr(t, "_send_metrics", slow_server)
    t0 = time.monotonic()
    t.log_metrics({"loss": 2.0}, step=1)
    assert sending.wait(60)  # the delivery thread holds the request open ...
    t.log_metrics({"loss": 1.5}, step=2)
    assert time.monotonic() - t0 < 5  # ... while the training thread goes on
    assert [e["step"] for e in pending(tmp_path)] == [1, 2]  # both on disk before MLflow has either
    # A bounded flush (a launch's wait for MLflow's start before its first step) gives up in time.
    t1 = time.monotonic()
    assert t.flush(timeout=0.3) is False
    assert time.monotonic() - t1 < 5
    gate.set()
    assert t.flush()
    assert pending(tmp_path) == [] and read_jsonl(tmp_path / "journal" / "mlflow-pending.jsonl") == []
    assert [(k, s) for k, s, _ in metric_rows(db, t.run_id)] == [("loss", 1), ("loss", 2)]
    t.close()


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_outage_is_journaled_then_flushed_exactly_once(tmp_path, monkeypatch, store):
    db = tmp_path / "mlflow.db"
    t = Tracker(tmp_path, tracking_uri=store(db), report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={"fingerprint": "abc"})
    t.log_metrics({"loss": 3.0}, step=1)
    assert t.flush()
    real = t._send_metrics
    down = {"on": True}

    def flaky(entries):
        if down["on"]:
            raise ConnectionError("server down")
        return real(entries)

    monkeypatch.setattr(t, "_send_metrics", flaky)
    t.log_metrics({"loss": 2.5, "lr": 0.1}, step=2)
    t.log_metrics({"loss": 2.0}, step=3)
    assert not t.flush()
    assert t.last_error == "ConnectionError: server down"
    assert [e["step"] for e in pending(tmp_path)] == [2, 3]
    down["on"] = False
    t.log_metrics({"loss": 1.5}, step=4)
    assert t.flush()
    assert pending(tmp_path) == []
    rows = metric_rows(db, t.run_id)
    assert [(k, s) for k, s, _ in rows] == [("loss", 1), ("loss", 2), ("loss", 3), ("loss", 4), ("lr", 2)]
    t.close()


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_resent_entries_are_stored_once_and_a_redone_step_is_a_new_row(tmp_path, store):
    """A kill after MLflow stored a request but before its `ack` reached the journal: the next start
    sends the same (key, step, timestamp, value) rows again, and MLflow stores nothing new. A step
    redone after a restart carries a new timestamp: one more row, the latest at that step."""
    db = tmp_path / "mlflow.db"
    uri = store(db)
    t = Tracker(tmp_path, tracking_uri=uri, report=lambda m: None)
    t.start("exp", "r", params=None, tags={})
    for step in (1, 2):
        t.log_metrics({"loss": 1.0 / step}, step=step, timestamp_ms=1000 + step)
    assert t.flush()
    t.close()
    journal = tmp_path / "journal" / "mlflow-pending.jsonl"
    sent = {"seq": 0, "kind": "metrics", "step": 2, "timestamp_ms": 1002, "metrics": {"loss": 0.5}}
    journal.write_text(json.dumps(sent) + "\n")  # delivered, never acknowledged
    again = Tracker(tmp_path, tracking_uri=uri, run_id=t.run_id, report=lambda m: None)
    assert again.sync() == (1, 0)
    assert metric_rows(db, t.run_id) == [("loss", 1, 1.0), ("loss", 2, 0.5)]
    redo = Tracker(tmp_path, tracking_uri=uri, run_id=t.run_id, report=lambda m: None)
    redo.log_metrics({"loss": 0.5}, step=2, timestamp_ms=2002)
    assert redo.finish()
    assert metric_rows(db, t.run_id) == [("loss", 1, 1.0), ("loss", 2, 0.5), ("loss", 2, 0.5)]
    from mlflow.tracking import MlflowClient

    history = MlflowClient(uri).get_metric_history(t.run_id, "loss")
    assert sorted((m.step, m.timestamp) for m in history) == [(1, 1001), (2, 1002), (2, 2002)]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_run_created_just_before_a_kill_is_continued_not_created_twice(tmp_path, store):
    db = tmp_path / "mlflow.db"
    uri = store(db)
    t = Tracker(tmp_path, tracking_uri=uri, report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={})
    start = dict(pending(tmp_path)[0])
    assert t.flush()
    t.close()
    # The kill came after MLflow created the run, before run.json or the journal learnt of it.
    journal = tmp_path / "journal" / "mlflow-pending.jsonl"
    journal.write_text(json.dumps(start) + "\n")
    again = Tracker(tmp_path, tracking_uri=uri, report=lambda m: None)
    again.log_metrics({"loss": 1.0}, step=1)
    assert again.finish()
    assert again.run_id == t.run_id
    with sqlite3.connect(db) as c:
        assert c.execute("select count(*) from runs").fetchone() == (1,)


def _killed_mid_migration(url: str) -> None:
    """The store a kill during MLflow's migrations leaves: the tables, then every migration up to
    the first later one that makes a table, whose table was made but whose version stamp was not."""
    import sqlalchemy
    from alembic import command
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    config = _get_alembic_config(url)
    history = list(reversed(list(ScriptDirectory.from_config(config).walk_revisions())))
    cut = next(r for r in history[1:] if "op.create_table(" in Path(str(r.path)).read_text())
    engine = sqlalchemy.create_engine(url)
    InitialBase.metadata.create_all(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, cut.revision)
        command.stamp(config, str(cut.down_revision), purge=True)
    engine.dispose()


@pytest.mark.slow
def test_a_store_whose_creation_was_killed_is_moved_aside_and_made_again(tmp_path):
    """MLflow makes its tables, then migrates them, in separate transactions: a kill in between (the
    delivery thread makes the store while the first steps train) left a file MLflow then refused
    forever ("table ... already exists"). It held nothing: moved aside, made again, the run tracked."""
    db = tmp_path / "mlflow.db"
    _killed_mid_migration(f"sqlite:///{db}")
    alone = subprocess.run(  # what MLflow alone makes of it (in another process: MLflow caches engines)
        [sys.executable, "-c", f"import mlflow; mlflow.MlflowClient('sqlite:///{db}').search_experiments()"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert alone.returncode != 0 and "already exists" in alone.stderr
    said: list[str] = []
    t = Tracker(tmp_path / "run", tracking_uri=f"sqlite:///{db}", report=said.append)
    t.start("exp", "r", params=None, tags={})
    t.log_metrics({"loss": 1.0}, step=1)
    assert t.finish(), t.last_error
    assert metric_rows(db, t.run_id) == [("loss", 1, 1.0)]
    aside = [p.name for p in tmp_path.glob("mlflow.db.interrupted-*")]
    assert len(aside) == 1 and said == [
        f"mlflow: {db} was half-made (its creation was interrupted) and held no run; moved to {aside[0]}"
    ]


_MAKE_STORE = "import sys; from pathlib import Path; from runner.training.tracking import ensure_sqlite_store as e; e(Path(sys.argv[1]))"


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_store_is_made_whole_or_not_at_all_whenever_its_maker_is_killed(tmp_path):
    from mlflow.tracking import MlflowClient

    from runner.training.tracking import _half_made

    for i, after in enumerate((0.5, 2.0, 3.5, 5.0)):  # import, tables, migrations, done (machine-dependent)
        db = tmp_path / f"s{i}" / "mlflow.db"
        proc = subprocess.Popen([sys.executable, "-c", _MAKE_STORE, str(db)], stderr=subprocess.DEVNULL)
        try:
            proc.wait(after)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert not db.exists() or not _half_made(db)
        client = MlflowClient(f"sqlite:///{db}")
        client.create_run(client.create_experiment("x"))  # whatever was left, MLflow uses it


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_dead_server_fails_fast_and_sync_sends_later(tmp_path, store):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    t = Tracker(tmp_path, tracking_uri=f"http://127.0.0.1:{port}", report=lambda m: None)
    t0 = time.monotonic()
    t.start("exp", "r", params={"lr": "0.1"}, tags={})
    for step in range(1, 4):
        t.log_metrics({"loss": float(step)}, step=step)
    assert not t.finish("FINISHED")
    assert time.monotonic() - t0 < 30
    kinds = [e["kind"] for e in pending(tmp_path)]
    assert kinds == ["start", "params", "tags", "metrics", "metrics", "metrics", "status"]
    # The store comes back (here: a local file store stands in for the restarted server).
    t2 = Tracker(tmp_path, tracking_uri=store(tmp_path / "m.db"), report=lambda m: None)
    assert t2.sync() == (7, 0)
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
    port = _free_port()
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


@pytest.mark.parametrize("via", ["flag", "env"])
def test_sync_sends_to_a_moved_server_and_records_it(tmp_path, monkeypatch, capsys, via, store):
    import argparse

    from runner.cli.train import cmd_sync

    dead = f"http://127.0.0.1:{_free_port()}"
    run = tmp_path / "run"
    t = Tracker(run, tracking_uri=dead, report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={})
    t.log_metrics({"loss": 1.0}, step=1)
    t.close()  # the process that lost its server ended
    (run / "experiment.yaml").write_text("name: t\n")
    (run / "run.json").write_text(json.dumps({"run_id": "r", "mlflow": t.info()}))
    moved = store(tmp_path / "moved.db")
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


# ---- final numbers (the last committed step is always logged) -----------------------------------


class _Sink:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step, timestamp_ms=None):
        self.logged.append((step, dict(metrics)))


def _counters(exposure: int) -> dict:
    c = {"processed": exposure + 16, "exposure": exposure, "useful": exposure, "unique": exposure, "lost": 16}
    return {"a": c, "total": c}


@pytest.mark.parametrize(
    "steps, committed, logged_at",
    [
        (6, 6, [4, 6]),  # the end of the run (or of an extension, a hard stop, a preemption) is logged
        (8, 8, [4, 8]),  # ... once, when the interval already logged it
        (6, 4, [4, 7]),  # non-finite step 7 rolled back to the step-4 checkpoint: logged at step 7
        (0, 5, [5]),  # nothing committed in this attempt: what it spent is still logged
    ],
)
def test_the_attempts_last_committed_step_is_always_logged(steps, committed, logged_at):
    from runner.training.callbacks import TrackingCallback

    sink = _Sink()
    cb = TrackingCallback(sink, log_interval_steps=4)
    for step in range(1, steps + 1):
        cb.on_step(step_record(step, loss=1.0 / step, lr=0.1), _counters(step * 128), {"a": 1.0})
    summary = {"committed_steps": committed, "exposure_tokens": committed * 128, "mfu": 0.25}
    cb.on_end(summary, _counters(committed * 128), {"a": 1})
    accounting = [(s, m["tokens.total.exposure"]) for s, m in sink.logged if "tokens.total.exposure" in m]
    assert [s for s, _ in accounting] == logged_at
    assert accounting[-1][1] == committed * 128  # the latest row is the ledger's
    # the run's MFU is not a second value of the last step's `mfu`
    assert sink.logged[-1] == (
        committed,
        {"committed_steps": committed, "exposure_tokens": committed * 128, "run.mfu": 0.25},
    )


def _latest_agrees_with_ledger(run: Path) -> None:
    from mlflow.tracking import MlflowClient

    info = json.loads((run / "run.json").read_text())
    latest = MlflowClient(info["mlflow"]["tracking_uri"]).get_run(info["mlflow"]["run_id"]).data.metrics
    ledger = json.loads((run / "ledger.json").read_text())
    for d, counts in ledger["counters"].items():
        for name in ("processed", "exposure", "useful", "unique", "lost"):
            assert latest[f"tokens.{d}.{name}"] == counts[name], (d, name, latest[f"tokens.{d}.{name}"])
    for d, ratio in ledger["realized_ratios"].items():
        assert latest[f"realized_ratio.{d}"] == pytest.approx(ratio, abs=1e-12)
    last = read_jsonl(run / "metrics" / "train.jsonl")[-1]
    assert (latest["loss"], latest["lr"]) == (last["loss"], last["lr"])


@pytest.mark.slow
def test_mlflow_latest_accounting_is_the_ledgers_at_hard_stop_end_and_extension(tmp_path, store):
    from trainfixtures import launch

    # log every 4 steps; the hard stop (6), the end (10) and the extension (13) are no multiple of 4
    exp = make_project(tmp_path, steps=10, checkpoint_every=5, eval_every=5, train_extra={"log_interval_steps": 4})
    store(tmp_path / "mlflow.db")  # where env() points MLflow
    exp.write_text(
        exp.read_text().replace("log_interval_steps: 4", f"log_interval_steps: 4\n  hard_stop_tokens: {6 * 128}")
    )
    run = tmp_path / "runs" / "f"
    proc = launch(tmp_path, exp, "--run-dir", run)
    assert json.loads((run / "run.json").read_text())["committed_steps"] == 6
    _latest_agrees_with_ledger(run)
    # Progress on a log file (stderr is a pipe here): a plain line at the first and at the last step.
    lines = [x for x in proc.stderr.splitlines() if x.startswith("train: step ")]
    assert [x.split(" | ")[0] for x in lines] == ["train: step 1/10 (10.0%)", "train: step 6/10 (60.0%)"]
    assert "exposure 768 tokens" in lines[-1] and " tokens/s | MFU " in lines[-1]
    assert "ETA segment end " in lines[-1] and "hard stop (step 6) 0s" in lines[-1]
    yaml_path = run / "experiment.yaml"
    yaml_path.write_text(yaml_path.read_text().replace(f"hard_stop_tokens: {6 * 128}", "hard_stop_tokens: null"))
    launch(tmp_path, run)
    _latest_agrees_with_ledger(run)
    proc = launch(tmp_path, run, "--extend-to", 13 * 128)
    assert json.loads((run / "run.json").read_text())["committed_steps"] == 13
    _latest_agrees_with_ledger(run)
    assert "train: step 13/13 (100.0%)" in proc.stderr and "hard stop" not in proc.stderr


@pytest.mark.slow
def test_mlflow_latest_accounting_after_a_nonfinite_stop_is_the_rolled_back_ledgers(tmp_path, store):
    from trainfixtures import launch

    # lr 1e30: step 2 is non-finite; step 1 was committed and logged, never saved: rolled back to 0.
    exp = make_project(tmp_path, steps=8, lr=1e30, checkpoint_every=4)
    run = tmp_path / "runs" / "n"
    store(tmp_path / "mlflow.db")  # where env() points MLflow
    assert launch(tmp_path, exp, "--run-dir", run, check=False).returncode == 4
    ledger = json.loads((run / "ledger.json").read_text())["counters"]["total"]
    assert ledger["exposure"] == 0 and ledger["lost"] == ledger["processed"] > 0
    from mlflow.tracking import MlflowClient

    info = json.loads((run / "run.json").read_text())
    latest = MlflowClient(info["mlflow"]["tracking_uri"]).get_run(info["mlflow"]["run_id"]).data.metrics
    assert {k: latest[f"tokens.total.{k}"] for k in ("exposure", "processed", "lost")} == {
        k: ledger[k] for k in ("exposure", "processed", "lost")
    }


# ---- stores and paths ---------------------------------------------------------------------------


def _fake_run(run: Path, mlflow: dict) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "experiment.yaml").write_text("name: t\n")
    (run / "run.json").write_text(json.dumps({"run_id": "r", "mlflow": mlflow}))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_relative_store_given_to_sync_is_recorded_absolute(tmp_path, monkeypatch, capsys, store):
    import argparse

    from runner.cli.train import cmd_sync

    run = tmp_path / "run"
    t = Tracker(run, tracking_uri=f"http://127.0.0.1:{_free_port()}", report=lambda m: None)
    t.start("exp", "r", params=None, tags={})
    t.log_metrics({"loss": 1.0}, step=1)
    t.close()
    _fake_run(run, t.info())
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(here)
    store(here / "mlflow.db")
    assert cmd_sync(argparse.Namespace(run_dir=str(run), tracking_uri="sqlite:///mlflow.db")) == 0
    recorded = json.loads((run / "run.json").read_text())["mlflow"]
    assert recorded["tracking_uri"] == f"sqlite:///{here / 'mlflow.db'}" and recorded["run_id"]
    # Later, from another folder: the same store, not a new empty one there.
    monkeypatch.chdir(elsewhere)
    Tracker(run, report=lambda m: None).close()
    from runner.cli.train import _tracker_of
    from runner.training.runfolder import RunFolder

    again = _tracker_of(RunFolder(run), None, report=lambda m: None)
    again.log_metrics({"loss": 0.5}, step=2)
    assert again.finish()
    assert list(elsewhere.iterdir()) == []
    assert [(k, s) for k, s, _ in metric_rows(here / "mlflow.db", recorded["run_id"])] == [("loss", 1), ("loss", 2)]


@pytest.mark.parametrize("uri", ["sqlite:///{tmp}/gone/mlflow.db", "sqlite:///mlflow.db"])
def test_a_store_the_run_says_exists_is_not_created_empty(tmp_path, monkeypatch, uri):
    from runner.cli import main

    run = tmp_path / "run"
    _fake_run(run, {"tracking_uri": uri.format(tmp=tmp_path), "experiment_id": "1", "run_id": "0" * 32})
    before = (run / "run.json").read_text()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["sync", str(run)]) == 2
    assert main(["sync", str(run), "--tracking-uri", "sqlite:///other.db"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (run / "run.json").read_text() == before


def test_the_refusal_names_run_json_and_the_key(tmp_path, monkeypatch, capsys):
    from runner.cli import main

    run = tmp_path / "run"
    _fake_run(run, {"tracking_uri": f"sqlite:///{tmp_path}/gone.db", "experiment_id": "1", "run_id": "0" * 32})
    monkeypatch.chdir(tmp_path)
    assert main(["sync", "run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run/run.json: mlflow.tracking_uri: MLflow run 000")
    assert f"a store at {tmp_path}/gone.db, which does not exist" in err[0]


@pytest.mark.slow
def test_resume_refuses_a_lost_store_before_writing_anything(tmp_path, store):
    from trainfixtures import launch

    exp = make_project(tmp_path, steps=4, checkpoint_every=2)
    run = tmp_path / "runs" / "s"
    store(tmp_path / "mlflow.db")  # where env() points MLflow
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 2)
    (tmp_path / "mlflow.db").unlink()
    listing = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    before = (run / "run.json").read_text()
    proc = launch(tmp_path, run, check=False)
    assert proc.returncode == 2 and "mlflow.tracking_uri" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == listing
    assert (run / "run.json").read_text() == before


@pytest.fixture(scope="module")
def report_folder(tmp_path_factory) -> Path:
    from runfixtures import make_run

    from runner.reports.tables import write_report

    return write_report(make_run(tmp_path_factory.mktemp("made")))


@pytest.mark.parametrize("uri", ["sqlite:///{tmp}/gone/mlflow.db", "sqlite:///mlflow.db", "{tmp}/gone-mlruns"])
def test_audit_of_a_report_folder_creates_no_file(report_folder, tmp_path, monkeypatch, capsys, uri):
    from runner.cli import main

    report = tmp_path / "report"
    shutil.copytree(report_folder, report)
    info = json.loads((report / "run.json").read_text())
    info["mlflow"] = {"tracking_uri": uri.format(tmp=tmp_path), "experiment_id": "1", "run_id": "0" * 32}
    (report / "run.json").write_text(json.dumps(info))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def listing():
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))

    before = listing()
    from runner.errors import EXIT_UNVERIFIED

    # Nothing disagrees, but the MLflow checks cannot run: UNVERIFIED, saying why, and nothing created.
    assert main(["audit", str(report)]) == EXIT_UNVERIFIED
    out = capsys.readouterr().out
    assert "MLflow run reachable" in out and ("no MLflow store at" in out or "relative store path" in out), out
    assert listing() == before
