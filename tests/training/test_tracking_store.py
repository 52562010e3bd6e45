"""MLflow stores: made whole or not at all, recorded absolute, never created empty where a run says one
exists, and an audit that creates no file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trackingfixtures import free_port, metric_rows
from trainfixtures import make_project

from runner.training.tracking import Tracker, ensure_sqlite_store


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
    t = Tracker(run, tracking_uri=f"http://127.0.0.1:{free_port()}", report=lambda m: None)
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
    from runner.runs.folder import RunFolder
    from runner.training.launch import tracker_of

    again = tracker_of(RunFolder(run), None, report=lambda m: None)
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


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sync_records_a_moved_store_only_where_it_holds_the_run(tmp_path, monkeypatch, capsys):
    """`sync --tracking-uri URI` records URI for every later resume and audit: a store that does not
    hold the run (an empty database, a dead server, a path never made) was recorded all the same, with
    nothing sent. Refused in one line, run.json unchanged; the database the run moved to is recorded."""
    from runner.cli import main

    db = tmp_path / "mlflow.db"
    t = Tracker(tmp_path / "seed", tracking_uri=f"sqlite:///{db}", report=lambda m: None)
    t.start("exp", "r", params=None, tags={})
    t.log_metrics({"loss": 1.0}, step=1)
    assert t.finish(), t.last_error
    run = tmp_path / "run"
    _fake_run(run, t.info())
    before = (run / "run.json").read_text()
    empty = tmp_path / "empty.db"
    ensure_sqlite_store(empty)  # a whole MLflow store that holds no run
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    capsys.readouterr()
    for uri in (f"sqlite:///{empty}", f"sqlite:///{tmp_path}/never.db", f"http://127.0.0.1:{free_port()}"):
        assert main(["sync", str(run), "--tracking-uri", uri]) == 2, uri
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --tracking-uri: MLflow run {t.run_id} is not in "), err
        assert (run / "run.json").read_text() == before
    assert not (tmp_path / "never.db").exists()
    moved = tmp_path / "moved" / "mlflow.db"
    moved.parent.mkdir()
    shutil.copy2(db, moved)
    assert main(["sync", str(run), "--tracking-uri", f"sqlite:///{moved}"]) == 0
    assert json.loads((run / "run.json").read_text())["mlflow"]["tracking_uri"] == f"sqlite:///{moved}"


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


def test_sync_of_a_run_with_no_mlflow_run_and_nothing_pending_records_nothing(tmp_path, monkeypatch, capsys):
    """`runner sync RUN --tracking-uri X` of a --no-tracking run sent nothing (there is nothing) yet recorded
    X in run.json as the store every later tracked resume of the run goes to (any path, a file included)."""
    from runner.cli import main

    run = tmp_path / "run"
    _fake_run(run, {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment_id": None, "run_id": None})
    (run / "journal").mkdir()
    (run / "journal" / "processed.jsonl").write_text("")  # what a --no-tracking launch leaves
    before = (run / "run.json").read_text()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    for extra in ([], ["--tracking-uri", "somefile"], ["--tracking-uri", "sqlite:///other.db"]):
        capsys.readouterr()
        assert main(["sync", str(run), *extra]) == 0, extra
        assert capsys.readouterr().out == (
            f"{run}: nothing to send: no MLflow run and no pending entries (launched with --no-tracking?); "
            "run.json unchanged\n"
        )
        assert (run / "run.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
