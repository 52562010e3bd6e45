"""End-to-end trainer behaviour on a tiny CPU model: what a user relies on from `runner launch`."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trainfixtures import env, launch, make_project

from runner.fsio import read_jsonl
from runner.training.schedule import lr_at

STEPS = 8


def counters(run: Path) -> dict:
    return json.loads((run / "ledger.json").read_text())["counters"]


@pytest.mark.slow
def test_launch_writes_run_folder_and_mlflow(tmp_path):
    tmp, run = tmp_path, tmp_path / "runs" / "ref"
    launch(tmp, make_project(tmp, steps=STEPS, checkpoint_every=4, keep_last=2), "--run-dir", run)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["committed_steps"] == STEPS
    assert info["conventions"]["flops_formula"] == "6N+attn" and info["conventions"]["peak_source"] == "test figure"
    rows = read_jsonl(run / "metrics" / "train.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["tokens_processed"] == 8 * 16 and r["mfu"] > 0 for r in rows)
    evals = read_jsonl(run / "metrics" / "eval.jsonl")
    assert {(r["step"], r["domain"]) for r in evals} == {(s, d) for s in range(4, STEPS + 1, 4) for d in ("a", "b")}
    assert all(r["bpb"] > 0 and r["loss_nats"] > 0 for r in evals)
    c = counters(run)
    assert c["total"]["exposure"] == STEPS * 8 * 16 == c["total"]["processed"]
    db = sqlite3.connect(tmp / "mlflow.db")
    run_id = info["mlflow"]["run_id"]
    keys = {k for (k,) in db.execute("select distinct key from metrics where run_uuid=?", (run_id,))}
    assert {
        "loss",
        "lr",
        "step/mfu",  # a step's figure (the run's own MFU is run.mfu)
        "step/goodput_mfu",
        "tokens.total.exposure",
        "val_loss.a",
        "val_bpb.b",
        "realized_ratio.a",
    } <= keys
    losses = db.execute(
        "select step, count(*) from metrics where run_uuid=? and key='loss' group by step", (run_id,)
    ).fetchall()
    assert losses == [(s, 1) for s in range(1, STEPS + 1)]
    params = dict(db.execute("select key, value from params where run_uuid=?", (run_id,)).fetchall())
    assert params["train.seq_len"] == "16" and params["model.hidden_size"] == "32"
    tags = dict(db.execute("select key, value from tags where run_uuid=?", (run_id,)).fetchall())
    assert tags["fingerprint"] == info["fingerprint"] and tags["mfu.flops_formula"] == "6N+attn"
    assert "hfu" not in info and "hfu" not in keys  # no activation checkpointing: nothing is recomputed


@pytest.mark.slow
def test_activation_checkpointing_reports_hfu_besides_mfu(tmp_path):
    import pandas as pd
    import yaml

    from runner.reports.audit.run import audit

    exp = make_project(tmp_path, steps=4, checkpoint_every=4)
    model = tmp_path / "recipes" / "model" / "m.yaml"
    model.write_text(yaml.safe_dump({**yaml.safe_load(model.read_text()), "activation_checkpointing": True}))
    run = tmp_path / "runs" / "ac"
    proc = launch(tmp_path, exp, "--run-dir", run)
    assert "HFU " in proc.stdout and "(recomputed forward counted)" in proc.stdout
    info = json.loads((run / "run.json").read_text())
    assert info["conventions"]["recompute_counted"] is False and info["conventions_hfu"]["recompute_counted"] is True
    ratio = info["hfu_flops_per_token"] / info["flops_per_token"]
    assert ratio == pytest.approx(8 / 6)  # the forward runs twice: 8N (+ its attention) where the model needs 6N
    assert info["hfu"] == pytest.approx(info["mfu"] * ratio)
    assert all(r["hfu"] == pytest.approx(r["mfu"] * ratio) for r in read_jsonl(run / "metrics" / "train.jsonl"))
    summary = pd.read_parquet(run / "report" / "run_summary.parquet").iloc[0]
    assert summary["hfu"] == pytest.approx(info["hfu"]) and summary["recompute_counted"] == False  # noqa: E712
    result = audit(run)
    # Verified but for the test recipe's stated CPU peak, which is not a datasheet figure.
    assert result.unverified() == ["peak is a figure the audit can verify"], result.render()
    assert next(c for c in result.checks if c.name == "hfu recomputed").status == "PASS"
    db = sqlite3.connect(tmp_path / "mlflow.db")
    tags = dict(db.execute("select key, value from tags where run_uuid=?", (info["mlflow"]["run_id"],)).fetchall())
    assert tags["hfu.recompute_counted"] == "True" and tags["mfu.recompute_counted"] == "False"


@pytest.mark.slow
def test_fingerprint_mismatch_refuses_resume_naming_keys(tmp_path):
    exp = make_project(tmp_path, steps=4)
    run = tmp_path / "runs" / "f"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 2, "--no-tracking")
    text = exp.read_text().replace("seed: 7", "seed: 8")
    exp.write_text(text)
    proc = launch(tmp_path, exp, "--run-dir", run, check=False)
    assert proc.returncode == 2
    assert "differing keys: seed" in proc.stderr and "refusing to resume" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_nonfinite_loss_stops_with_exit_4_keeping_last_good_checkpoint(tmp_path):
    exp = make_project(tmp_path, steps=6, lr=1e30, checkpoint_every=1)
    run = tmp_path / "runs" / "n"
    proc = launch(tmp_path, exp, "--run-dir", run, "--no-tracking", check=False)
    assert proc.returncode == 4
    assert "non-finite loss at step" in proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed"
    steps = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    c = counters(run)
    assert c["total"]["exposure"] == info["committed_steps"] * 8 * 16  # the non-finite step is not committed
    assert steps and steps[-1] == f"step-{info['committed_steps']:07d}"


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sigterm_saves_checkpoint_and_exits_3(tmp_path):
    exp = make_project(tmp_path, steps=400, checkpoint_every=1000)
    run = tmp_path / "runs" / "p"
    p = subprocess.Popen(
        [sys.executable, "-m", "runner", "launch", str(exp), "--run-dir", str(run), "--no-tracking"],
        cwd=tmp_path,
        env=env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + SUBPROCESS_TIMEOUT_S
    while time.time() < deadline and not (run / "metrics" / "train.jsonl").exists():
        time.sleep(0.2)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert p.returncode == 3, err
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "preempted" and (run / "checkpoints" / f"step-{info['committed_steps']:07d}").exists()


@pytest.mark.slow
def test_extend_finished_run_records_segment(tmp_path):
    exp = make_project(tmp_path, steps=4, checkpoint_every=2)
    run = tmp_path / "runs" / "x"
    launch(tmp_path, exp, "--run-dir", run, "--no-tracking")
    launch(tmp_path, run, "--extend-to", 6 * 8 * 16, "--no-tracking")
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["committed_steps"] == 6
    assert [s["start_step"] for s in info["segments"]] == [0, 4]
    assert info["segments"][1]["max_duration_tokens"] == 6 * 8 * 16
    assert info["segments"][0]["fingerprint"] != info["segments"][1]["fingerprint"]
    assert counters(run)["total"]["exposure"] == 6 * 8 * 16


def test_schedules_follow_max_duration():
    class O:
        lr, min_lr_ratio, decay_fraction = 1.0, 0.1, 0.2
        schedule = "cosine"

    assert lr_at(0, O, 100, 10) == pytest.approx(0.1)
    assert lr_at(9, O, 100, 10) == pytest.approx(1.0)
    assert lr_at(99, O, 100, 10) == pytest.approx(0.1, abs=1e-3)
    O.schedule = "wsd"
    assert lr_at(79, O, 100, 10) == 1.0 and lr_at(99, O, 100, 10) == pytest.approx(0.1)
    O.schedule = "constant"
    assert lr_at(99, O, 100, 10) == 1.0


def _snapshot(run: Path) -> dict:
    files = [run / "run.json", run / "ledger.json", *sorted((run / "report").rglob("*"))]
    return {str(p): p.read_bytes() for p in files if p.is_file()}


@pytest.mark.slow
def test_relaunching_a_finished_run_is_a_no_op(tmp_path):
    exp = make_project(tmp_path, steps=4, checkpoint_every=2)
    run = tmp_path / "runs" / "x" / "done"
    launch(tmp_path, exp, "--run-dir", run)
    before = _snapshot(run)
    db = tmp_path / "mlflow.db"
    count = sqlite3.connect(db).execute("select count(*) from metrics").fetchone()[0]
    proc = launch(tmp_path, "runs/x/done")
    assert proc.stdout.strip() == (
        "run runs/x/done: already finished at step 4 (exposure 512 tokens); extend it with --extend-to TOKENS"
    )
    assert _snapshot(run) == before
    assert sqlite3.connect(db).execute("select count(*) from metrics").fetchone()[0] == count
    # ... and says so before importing what training needs (a relaunch loop, a requeued job, the README)
    probe = "import sys; from runner.cli import main; main(['launch', 'runs/x/done']); print(sorted({'torch', 'accelerate', 'transformers', 'mlflow'} & set(sys.modules)))"
    out = (
        subprocess.run(
            [sys.executable, "-c", probe],
            cwd=tmp_path,
            env=env(tmp_path),
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )
    assert out == [proc.stdout.strip(), "[]"]
    # A bad --extend-to names the run's experiment file and the key it is about.
    bad = launch(tmp_path, "runs/x/done", "--extend-to", 100, "--no-tracking", check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: runs/x/done/experiment.yaml: train.exposure_tokens: --extend-to 100")


@pytest.mark.slow
def test_edited_run_folder_experiment_is_refused_naming_keys(tmp_path):
    exp = make_project(tmp_path, steps=6, checkpoint_every=2, keep_last=3, eval_every=2)
    run = tmp_path / "runs" / "e"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 4, "--no-tracking")
    # The attempt's end is journaled after its last evaluation: a resume counts at least that long.
    stamp = max(r["wall_seconds"] for r in read_jsonl(run / "metrics" / "eval.jsonl"))
    assert max(e["wall_seconds"] for e in read_jsonl(run / "journal" / "processed.jsonl")) >= stamp
    saved = (run / "experiment.yaml").read_text()
    assert "lr: 0.003" in saved
    (run / "experiment.yaml").write_text(saved.replace("lr: 0.003", "lr: 0.001"))
    proc = launch(tmp_path, "runs/e", "--no-tracking", check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: runs/e/experiment.yaml: ")
    assert "differing keys: optim.lr" in lines[0] and "refusing to resume" in lines[0]
    assert not (run / "checkpoints" / "step-0000006").exists()
    # Operational keys (checkpoint cadence, retention) may be edited: the fingerprint is the same.
    (run / "experiment.yaml").write_text(saved.replace("keep_last: 3", "keep_last: 1"))
    launch(tmp_path, "runs/e", "--no-tracking")
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-0000006"]
    stamps = [(r["wall_seconds"], r["device_wall_seconds"]) for r in read_jsonl(run / "metrics" / "eval.jsonl")]
    assert stamps == sorted(stamps) and all(
        a <= b for a, b in zip(stamps[-1], (info["wall_seconds"], info["device_wall_seconds"]))
    )


@pytest.mark.slow
def test_infeasible_mixture_error_names_the_experiment_file(tmp_path):
    make_project(tmp_path, steps=4000)
    proc = launch(tmp_path, "experiments/t.yaml", "--no-tracking", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: experiments/t.yaml: mixture.domains."), proc.stderr
    assert not (tmp_path / "runs").exists()


def test_world_size_must_split_the_global_batch_and_differing_devices_warn(tmp_path):
    from runner.config.load import load_experiment
    from runner.errors import RunnerError
    from runner.training.launch import check_world

    cfg = load_experiment(make_project(tmp_path, global_batch=8, micro=4)).config
    assert check_world(cfg, 1) is None  # the recipe plans 1 device
    warning = check_world(cfg, 2)
    assert "2 devices" in warning and "plans 1" in warning and "MFU" in warning and "cost" in warning
    with pytest.raises(RunnerError) as e:
        check_world(cfg, 4)  # 8 sequences != 4 micro x 4 processes
    assert e.value.key == "train.micro_batch_sequences"


def test_smoke_times_in_a_fitting_unit_and_every_argument_has_help():
    import argparse

    from runner.cli.train import format_hours, register

    assert format_hours(0.5) == "30.0 min" and format_hours(1.99) == "119.4 min"
    assert format_hours(5) == "5.00 h" and format_hours(72) == "3.0 days"
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    for name in ("launch", "smoke", "sync"):
        for action in sub.choices[name]._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"runner {name} {action.dest} has no help"


@pytest.mark.slow
def test_hard_stop_leaves_run_resumable_and_removing_it_continues_the_same_schedule(tmp_path):
    exp = make_project(tmp_path, steps=8, checkpoint_every=4, train_extra={"hard_stop_tokens": 4 * 8 * 16})
    run = tmp_path / "runs" / "h"
    launch(tmp_path, exp, "--run-dir", run, "--no-tracking")
    info = json.loads((run / "run.json").read_text())
    # A hard stop is not the end of the budget: the run must not claim to be finished.
    assert info["status"] == "preempted" and info["committed_steps"] == 4
    assert (run / "report" / "report.md").exists()  # the end the user chose is reported
    yaml_path = run / "experiment.yaml"
    yaml_path.write_text(yaml_path.read_text().replace(f"hard_stop_tokens: {4 * 8 * 16}", "hard_stop_tokens: null"))
    launch(tmp_path, run, "--no-tracking")
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["committed_steps"] == 8
    assert counters(run)["total"]["exposure"] == 8 * 8 * 16 == counters(run)["total"]["processed"]

    class O:
        lr, min_lr_ratio, schedule = 3e-3, 0.1, "cosine"

    rows = read_jsonl(run / "metrics" / "train.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    # The hard stop never changed the schedule: every step's lr is the 8-step cosine's.
    assert [r["lr"] for r in rows] == pytest.approx([lr_at(s, O, 8, 2) for s in range(8)], rel=1e-12)


@pytest.mark.slow
def test_nonfinite_stop_rolls_the_ledger_back_to_the_last_checkpoint(tmp_path):
    # lr 1e30 makes step 2's gradients non-finite; step 1 was committed in memory but never saved.
    exp = make_project(tmp_path, steps=8, lr=1e30, checkpoint_every=4)
    run = tmp_path / "runs" / "n4"
    proc = launch(tmp_path, exp, "--run-dir", run, "--no-tracking", check=False)
    assert proc.returncode == 4, proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and info["committed_steps"] == 0
    assert not list((run / "checkpoints").glob("step-*"))
    c = counters(run)["total"]
    journal = read_jsonl(run / "journal" / "processed.jsonl")
    spent = sum(sum(e["processed"].values()) for e in journal)
    assert c["exposure"] == c["useful"] == c["unique"] == 0
    assert c["processed"] == spent == 2 * 8 * 16 and c["lost"] == spent
    assert info["exposure_tokens"] == 0 and info["lost_tokens"] == spent


def test_each_segment_keeps_the_schedule_it_was_trained_under():
    from runner.training.schedule import segment_schedule_steps

    segments = [
        {"index": 0, "start_step": 0, "max_duration_tokens": 4 * 128},
        {"index": 1, "start_step": 4, "max_duration_tokens": 10 * 128},
    ]
    assert [segment_schedule_steps(segments, s, 128, 99) for s in (0, 3, 4, 9)] == [4, 4, 10, 10]
    assert segment_schedule_steps([], 5, 128, 99) == 99


@pytest.mark.slow
def test_extension_after_fallback_to_a_pre_extension_checkpoint_replays_old_lrs(tmp_path):
    exp = make_project(tmp_path, steps=4, checkpoint_every=2, keep_last=5)
    run = tmp_path / "runs" / "xf"
    launch(tmp_path, exp, "--run-dir", run, "--no-tracking")
    first = {r["step"]: r["lr"] for r in read_jsonl(run / "metrics" / "train.jsonl")}
    launch(tmp_path, run, "--extend-to", 6 * 8 * 16, "--no-tracking", "--max-steps", 1)
    # Lose the two newest checkpoints: the resume falls back to step 2, inside segment 0.
    for name in ("step-0000005", "step-0000004"):
        (run / "checkpoints" / name / "COMPLETE").unlink()
    launch(tmp_path, run, "--no-tracking")
    rows = read_jsonl(run / "metrics" / "train.jsonl")
    replayed = [r for r in rows[len(first) + 1 :] if r["step"] <= 4]
    assert [r["step"] for r in replayed] == [3, 4]
    assert [r["lr"] for r in replayed] == [first[3], first[4]]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and counters(run)["total"]["exposure"] == 6 * 8 * 16
