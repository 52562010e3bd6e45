"""`runner report` and `runner publish`: files a reader and an auditor rely on."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from runfixtures import GLOBAL_BATCH, SEQ_LEN, STEPS, make_run, run_commands
from timeouts import SUBPROCESS_TIMEOUT_S
from trainfixtures import env

from runner.cli.report import register
from runner.errors import EXIT_UNVERIFIED, RunnerError
from runner.reports.audit.evidence import write_report_with_evidence
from runner.reports.publish import audit_reports, publish
from runner.reports.tables import PLOTS, TABLES, build_tables


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("report"))
    write_report_with_evidence(run)
    return run


def _cli(argv):
    return run_commands(register, argv)


def test_tables_hold_the_ledger_counts(run_dir):
    t = build_tables(run_dir)
    s = t["run_summary"].iloc[0]
    assert s["exposure_tokens"] == STEPS * GLOBAL_BATCH * SEQ_LEN
    # One step of 8 sequences was processed twice (the fixture's crash): that is the lost work.
    assert s["lost_tokens"] == GLOBAL_BATCH * SEQ_LEN
    assert s["processed_tokens"] == s["exposure_tokens"] + s["lost_tokens"]
    assert list(t["accounting"]["domain"]) == ["code", "math", "web"]
    assert t["accounting"].set_index("domain").loc["math", "epochs"] == pytest.approx(12 / 9)
    assert s["flops_formula"] == "6N+attn" and s["peak_tflops"] == 989.4


def test_report_folder_has_tables_plots_and_audit_inputs(run_dir):
    out = run_dir / "report"
    for name in TABLES:
        parquet = pd.read_parquet(out / f"{name}.parquet")
        csv = pd.read_csv(out / f"{name}.csv")
        assert list(parquet.columns) == list(csv.columns) and len(parquet) == len(csv)
    for png in PLOTS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "experiment.yaml").read_text() == (run_dir / "experiment.yaml").read_text()
    for d in ("code", "math", "web"):
        assert (out / "manifests" / f"{d}.json").exists()
    md = (out / "report.md").read_text()
    fp = (run_dir / "fingerprint.txt").read_text().strip()
    sha = json.loads((run_dir / "manifests" / "web.json").read_text())["manifest_sha256"]
    for needle in (
        fp,
        sha,
        "flops_formula",
        "peak_source",
        "time_basis",
        "`unique`",
        "`lost`",
        "per billion useful tokens",
        "loss_by_domain.png",
    ):
        assert needle in md, needle


def test_resumed_run_keeps_the_redone_rows_once(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    train = (run / "metrics" / "train.jsonl").read_text().splitlines()
    evals = (run / "metrics" / "eval.jsonl").read_text().splitlines()
    (run / "metrics" / "train.jsonl").write_text("\n".join(train[:4] + train[2:]) + "\n")
    (run / "metrics" / "eval.jsonl").write_text("\n".join(evals + evals[:3]) + "\n")
    t = build_tables(run)
    assert list(t["throughput"]["step"]) == list(range(1, STEPS + 1))
    assert len(t["validation"]) == len(evals)


def test_missing_inputs_are_runner_errors(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "ledger.json").unlink()
    with pytest.raises(RunnerError, match="ledger.json: missing"):
        build_tables(run)
    with pytest.raises(RunnerError, match="not an MLflow run id"):
        _cli(["report", str(tmp_path / "nowhere")])
    with pytest.raises(RunnerError, match="ledger.json: missing"):
        _cli(["report", str(run)])
    with pytest.raises(RunnerError) as e:  # a folder of runs, not a run
        _cli(["report", str(tmp_path)])
    assert str(e.value) == f"{tmp_path}: not a run folder (no run.json): give runs/NAME/RUN_ID or an MLflow run id"


def test_a_run_stopped_before_its_first_step_is_one_line_not_an_mfu_error(run_dir, tmp_path):
    """A launch preempted during its start-up leaves a run folder with no step: report and audit say so
    and how to resume, instead of 'mfu needs positive seconds'."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "metrics" / "train.jsonl").unlink()
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, "status": "preempted"}))
    shutil.rmtree(run / "report", ignore_errors=True)  # such a run never wrote one
    says = f"{run}: no step trained yet (status 'preempted'): nothing to report; `runner launch {run}` resumes it"
    for verb in ("report", "audit"):
        with pytest.raises(RunnerError) as e:
            _cli([verb, str(run)])
        assert str(e.value) == says, verb


def test_report_command_rebuilds(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    shutil.rmtree(run / "report")
    assert _cli(["report", str(run)]) == 0
    assert (run / "report" / "report.md").exists()


def test_publish_copies_audited_report_and_indexes_it(run_dir, tmp_path):
    reports = tmp_path / "reports"
    assert _cli(["publish", str(run_dir), "--reports-dir", str(reports)]) == 0
    dest = reports / "fixture" / run_dir.name
    assert (dest / "report.md").exists() and (dest / "manifests" / "web.json").exists()
    index = (reports / "README.md").read_text()
    assert run_dir.name in index and "6N+attn" in index and "code 4.700" in index
    # The fabricated run has no MLflow run: consistent, never PASS.
    assert all(r.consistent and r.verdict == "UNVERIFIED" for r in audit_reports(reports))
    assert _cli(["audit-reports", "--reports-dir", str(reports)]) == EXIT_UNVERIFIED


@pytest.mark.slow
def test_publish_refuses_failing_audit_and_large_files(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    summary = pd.read_parquet(run / "report" / "run_summary.parquet")
    summary["peak_tflops"] = 2 * 989.4
    summary.to_parquet(run / "report" / "run_summary.parquet", index=False)
    reports = tmp_path / "reports"
    dest, result = publish(run, reports)
    assert dest is None and result.verdict == "FAIL" and not (reports / "fixture").exists()

    write_report_with_evidence(run)
    (run / "report" / "big.bin").write_bytes(b"\0" * (2 * 1024 * 1024 + 1))
    with pytest.raises(RunnerError, match="big.bin"):
        publish(run, reports)

    (run / "report" / "big.bin").unlink()
    publish(run, reports)
    published = reports / "fixture" / run_dir.name  # the run id from run.json
    summary = pd.read_parquet(published / "accounting.parquet")
    summary["unique_tokens"] += SEQ_LEN
    summary.to_parquet(published / "accounting.parquet", index=False)
    assert _cli(["audit-reports", "--reports-dir", str(reports)]) == 1


def test_devices_come_from_run_json_then_conventions_then_recipe(tmp_path):
    run = make_run(tmp_path, recipe_devices=1)
    info = json.loads((run / "run.json").read_text())
    assert build_tables(run)["run_summary"].iloc[0]["devices"] == 2  # run.json `devices`
    del info["devices"]  # a run recorded before run.json had `devices`
    (run / "run.json").write_text(json.dumps(info))
    assert build_tables(run)["run_summary"].iloc[0]["devices"] == 2  # conventions.devices_counted
    del info["conventions"]["devices_counted"]
    (run / "run.json").write_text(json.dumps(info))
    s = build_tables(run)["run_summary"].iloc[0]
    assert s["devices"] == 1 and s["devices_counted"] == 1  # the recipe, for the oldest runs


def test_audit_reports_takes_the_folder_as_a_positional(run_dir, tmp_path, capsys):
    reports = tmp_path / "reports"
    publish(run_dir, reports)
    assert _cli(["audit-reports", str(reports)]) == EXIT_UNVERIFIED
    assert "1 published reports: 0 PASS, 1 UNVERIFIED, 0 FAIL" in capsys.readouterr().out
    assert _cli(["audit-reports", str(reports), "--reports-dir", str(reports)]) == EXIT_UNVERIFIED
    with pytest.raises(RunnerError, match="two different folders"):
        _cli(["audit-reports", str(reports), "--reports-dir", str(tmp_path / "other")])
    assert _cli(["audit-reports", str(tmp_path / "empty")]) == 0  # nothing published: nothing fails


def test_an_index_that_is_not_what_the_published_reports_render_fails(run_dir, tmp_path, capsys):
    """reports/README.md, the page a reader opens first ("every row passed runner audit"), was never
    audited: a row's MFU edited to 59.4% passed audit-reports. It is rendered again from the published
    reports: an edit, a row left out (a hand merge of two publishes) or no index at all FAILs naming the
    line; `--write-index` writes it again, and refuses a folder whose README.md is not an index."""
    from runner.reports.publish import index_results

    reports = tmp_path / "reports"
    publish(run_dir, reports)
    index = reports / "README.md"
    clean = index.read_text()
    assert index_results(reports) == []
    mfu = next(cell for cell in clean.splitlines()[-1].split(" | ") if "6N+attn" in cell)
    forged = clean.replace(mfu, "59.4%" + mfu[mfu.index(" (") :])
    for text, says in (
        (forged, "| 59.4% (6N+attn"),
        (clean.rsplit("\n", 2)[0] + "\n", "line 7 reads (none)"),  # the run's row left out
    ):
        index.write_text(text)
        (result,) = index_results(reports)
        assert result.failed() == ["index = the published reports"] and says in result.render(), result.render()
        assert _cli(["audit-reports", str(reports)]) == 1
        assert "line 7 reads" in capsys.readouterr().out
    index.unlink()
    assert "no README.md beside the published reports" in index_results(reports)[0].render()
    assert _cli(["audit-reports", str(reports), "--write-index"]) == EXIT_UNVERIFIED  # the report: no MLflow
    assert index.read_text() == clean and index_results(reports) == []
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# My project\n")
    for folder, says in ((project, "not a published-runs index"), (tmp_path / "none", "no such folder")):
        with pytest.raises(RunnerError, match=says):
            _cli(["audit-reports", str(folder), "--write-index"])
    assert (project / "README.md").read_text() == "# My project\n"


def test_audit_reports_imports_no_torch_where_no_model_card_is_published(run_dir, tmp_path):
    """A clone's reports/ holds no models/: the card checker (torch, transformers: about half of the
    verb's seconds) is not imported; the reports are audited all the same. With a card published, the
    card checks run (tests/export/test_export.py)."""
    reports = tmp_path / "reports"
    publish(run_dir, reports)
    (reports / "models").mkdir()  # an empty models/ folder: no card to check either
    probe = (
        "import sys\nfrom runner.cli import main\nprint('exit', main(['audit-reports', sys.argv[1]]))\n"
        "print(sorted({'torch', 'transformers', 'accelerate'} & {m.split('.')[0] for m in sys.modules}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(reports)],
        cwd=tmp_path,
        env=env(tmp_path),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    out = proc.stdout.strip().splitlines()
    assert "1 published reports: 0 PASS, 1 UNVERIFIED, 0 FAIL" in out, proc.stdout + proc.stderr
    assert out[-2:] == [f"exit {EXIT_UNVERIFIED}", "[]"], proc.stdout + proc.stderr


def test_every_argument_of_every_verb_has_help():
    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    assert set(sub.choices) == {"report", "audit", "audit-claims", "publish", "audit-reports"}
    for verb, parser in sub.choices.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{verb} {action.dest}"


@pytest.mark.slow
def test_report_from_an_mlflow_run_id_renders_the_logged_report(run_dir, tmp_path, monkeypatch, capsys):
    # A run logs its report/ folder as MLflow artifacts (not the ledger): `runner report RUN_ID`
    # must rebuild report.md and the plots from those tables, not ask for ledger.json.
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    exp_id = client.create_experiment("report", artifact_location=(tmp_path / "artifacts").as_uri())
    ml_run = client.create_run(exp_id).info.run_id
    client.log_artifacts(ml_run, str(run_dir / "report"), artifact_path="report")
    dest = tmp_path / "fetched"
    assert _cli(["report", ml_run, "--dest", str(dest)]) == 0
    assert capsys.readouterr().out.strip() == f"report written to {dest / 'report'}"
    md = (dest / "report" / "report.md").read_text()
    assert md == (run_dir / "report" / "report.md").read_text()
    assert all((dest / "report" / p).stat().st_size > 0 for p in PLOTS)
    # --dest is downloaded over: a folder holding anything (the run folder itself) is refused, untouched
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(RunnerError, match="--dest: exists and is not an empty folder"):
        _cli(["report", ml_run, "--dest", str(run_dir)])
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_report_of_an_unknown_mlflow_run_names_the_store(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(RunnerError, match=f"no MLflow store at {tmp_path / 'mlflow.db'} to look up run {'ab' * 16}"):
        _cli(["report", "ab" * 16])
    assert not (tmp_path / "mlflow.db").exists()  # a mistyped store path is said, never created empty
    MlflowClient(tracking_uri=uri).search_experiments()  # now the store exists, without that run
    with pytest.raises(RunnerError, match=f"cannot download artifacts of MLflow run {'ab' * 16} from {uri}"):
        _cli(["report", "ab" * 16])


@pytest.mark.slow  # mlflow's import: seconds
@pytest.mark.timeout(120)
def test_report_of_a_run_on_a_dead_server_fails_in_seconds_not_minutes(tmp_path, monkeypatch):
    """`runner report RUN_ID` with MLFLOW_TRACKING_URI on a refused loopback port took 4 min 10 s of
    MLflow's default retries before its one line; audit and tracking already failed fast. The variables
    are set before the request (a user's own value wins)."""
    import os
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.setenv(name, "")  # recorded, so the test leaves the variable as it found it
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
    with pytest.raises(RunnerError, match=f"cannot download artifacts of MLflow run {'ab' * 16} from http://127"):
        _cli(["report", "ab" * 16, "--dest", str(tmp_path / "d")])
    assert (os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"], os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]) == ("0", "7")


def test_the_report_draws_training_loss_and_learning_rate_and_says_what_n_counts(run_dir, tmp_path):
    """Issue 38, item 7: training.png (loss and learning rate against step, from train.jsonl, a step
    redone after a resume drawn once, at its last value) in report.md; N explained in one line."""
    from runner.fsio import read_jsonl
    from runner.reports.curves import _by_step
    from runner.reports.tables import render_report_dir

    out = run_dir / "report"
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "## Training loss and learning rate" in md and "![training](training.png)" in md
    assert md.index("## Training loss") < md.index("## Validation loss")
    n_line = next(x for x in md.splitlines() if " N = " in x)
    assert "(`num_parameters()`)" in n_line
    rows = read_jsonl(run_dir / "metrics" / "train.jsonl")
    drawn = _by_step(rows)
    assert [r["step"] for r in drawn] == sorted({r["step"] for r in rows})
    redone = [r for r in rows if r["step"] == 3]
    assert len(redone) >= 1 and drawn[2] is redone[-1]
    # rebuilt from its tables alone (an MLflow run's artifacts): no train.jsonl, no curve, no section
    copy = tmp_path / "report"
    shutil.copytree(out, copy)
    (copy / "training.png").unlink()
    render_report_dir(copy)
    assert "## Training loss" not in (copy / "report.md").read_text()


def test_a_run_without_targets_tasks_or_experts_has_no_empty_section(run_dir):
    """Issue 38, item 7: a dense run without downstream tasks has no Downstream or Experts section, and
    a run without targets no Quality targets section (it said only "No targets declared")."""
    from runner.reports import targets

    md = (run_dir / "report" / "report.md").read_text()
    cfg = yaml.safe_load((run_dir / "experiment.yaml").read_text())
    assert not (cfg["eval"].get("tasks") or cfg["model"].get("moe"))
    for empty in ("## Downstream", "## Experts"):
        assert empty not in md, empty
    assert "## Quality targets" in md  # the fixture declares targets
    assert targets.render_markdown([], build_tables(run_dir)["targets"]) == []
