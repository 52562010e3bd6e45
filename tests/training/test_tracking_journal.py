"""MLflow tracking that survives a dead server: journaled first, nothing lost, nothing sent twice, and
MLflow's latest values the ledger's."""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from timeouts import TEST_TIMEOUT_S
from trackingfixtures import free_port, metric_rows, pending
from trainfixtures import make_project, step_record

from runner.fsio import read_jsonl
from runner.training.tracking import Tracker, flatten


def test_flatten_gives_dotted_string_params():
    assert flatten({"a": {"b": 1, "c": [0.9, 0.95]}, "d": None}) == {"a.b": "1", "a.c": "[0.9, 0.95]", "d": "None"}


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


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_entries_sent_from_an_earlier_process_journal_are_told_in_a_tag(tmp_path, store):
    """What `runner sync` (or a later start) sends from an earlier process's journal reached MLflow after
    the process that made it had ended: only the run folder vouched for it in between, so a forger who
    kept the server away rewrote it first. Each such process says what it sent in its own
    `runner.replayed.<id>` tag (the audit reads it); a tracker delivering its own entries says nothing."""
    from mlflow.tracking import MlflowClient

    from runner.training.tracking import REPLAYED_TAG

    live_uri = store(tmp_path / "live.db")  # (each call makes the store afresh)
    live = Tracker(tmp_path / "live", tracking_uri=live_uri, report=lambda m: None)
    live.start("exp", "r", params={"lr": "0.1"}, tags={})
    live.log_metrics({"loss": 1.0}, step=1)
    assert live.finish()
    tags = MlflowClient(tracking_uri=live_uri).get_run(live.run_id).data.tags
    assert not [k for k in tags if k.startswith(REPLAYED_TAG)]

    dead = f"http://127.0.0.1:{free_port()}"
    t = Tracker(tmp_path / "run", tracking_uri=dead, report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={"fingerprint": "f"})
    for step in (1, 2, 3):
        t.log_metrics({"loss": float(step), "val_loss.code": 2.0}, step=step)
    t.log_tags({"evidence.format": "runner-evidence/1"})
    assert not t.finish()
    uri = store(tmp_path / "m.db")
    later = Tracker(tmp_path / "run", tracking_uri=uri, report=lambda m: None)
    assert later.sync() == (8, 0)
    told = {
        k: json.loads(v)
        for k, v in MlflowClient(tracking_uri=uri).get_run(later.run_id).data.tags.items()
        if k.startswith(REPLAYED_TAG + ".")
    }
    assert len(told) == 1, told
    (what,) = told.values()
    assert what["by"] == "runner sync" and what["metric_rows"] == 6 and what["steps"] == [1, 3]
    assert what["kinds"] == {"start": 1, "params": 1, "tags": 2, "metrics": 3, "status": 1}
    assert (what["evidence_tags"], what["other_tags"]) == (1, 1)


@pytest.mark.parametrize("via", ["flag", "env"])
def test_sync_sends_to_a_moved_server_and_records_it(tmp_path, monkeypatch, capsys, via, store):
    import argparse

    from runner.cli.train import cmd_sync

    dead = f"http://127.0.0.1:{free_port()}"
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


@pytest.mark.parametrize(
    "change, says",
    [
        ({"seq": "x"}, "seq 'x' is not a whole number >= 0"),  # int('x'): a traceback in sync and in launch
        ({"step": "x"}, "step or timestamp_ms not a whole number >= 0"),  # pending for ever: int() at every retry
        ({"kind": "metric"}, "kind 'metric' is not one of ack, start"),  # sent as nothing, acknowledged
        ({"metrics": {"loss": [1]}}, "metrics not a mapping of names to numbers"),  # as "step-text"
        ([1, 2], "a list, not a mapping"),  # line.get: AttributeError
    ],
    ids=["seq-text", "step-text", "unknown-kind", "metric-list", "not-a-mapping"],
)
def test_a_journal_entry_the_runner_does_not_write_is_one_line_and_nothing_is_sent(
    tmp_path, monkeypatch, capsys, store, change, says
):
    """A pending journal whose metrics entry was edited: `runner sync` (and the next launch, which loads it
    first) stopped on a traceback, retried for ever an entry it cannot send, or, for an unknown kind,
    acknowledged the entry as sent and dropped it. One line naming the journal and the entry; nothing is
    sent and the journal is as it was."""
    from runner.cli import main

    dead = f"http://127.0.0.1:{free_port()}"
    run = tmp_path / "run"
    t = Tracker(run, tracking_uri=dead, report=lambda m: None)
    t.start("exp", "r", params={"lr": "0.1"}, tags={})
    t.log_metrics({"loss": 1.0}, step=1)
    t.close()
    (run / "experiment.yaml").write_text("name: t\n")
    (run / "run.json").write_text(json.dumps({"run_id": "r", "mlflow": t.info()}))
    journal = run / "journal" / "mlflow-pending.jsonl"
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert lines[-1]["kind"] == "metrics"
    lines[-1] = change if isinstance(change, list) else {**lines[-1], **change}
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = journal.read_bytes()
    uri = store(tmp_path / "m.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    capsys.readouterr()
    assert main(["sync", str(run), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {journal}: {says}"), err
    assert "an entry this runner does not write" in err[0] and "nothing was sent" in err[0]
    assert journal.read_bytes() == before
    with sqlite3.connect(tmp_path / "m.db") as db:
        assert db.execute("select count(*) from runs").fetchone() == (0,)


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
