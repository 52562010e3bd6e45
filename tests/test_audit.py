"""`runner audit`: a clean fabricated run passes; every tampering fails naming the check."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from runfixtures import SEQ_LEN, make_run, run_commands
from runner.audit import audit
from runner.commands.report import register
from runner.errors import RunnerError
from runner.report import write_report


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("audit"))
    write_report(run)
    return run


def _cli(argv):
    return run_commands(register, argv)


def test_clean_run_passes_from_run_folder_and_report_folder(run_dir, capsys):
    result = audit(run_dir)
    assert result.passed, result.render()
    names = {c.name for c in result.checks}
    assert {"replay: exposure per domain", "replay: repetition histogram", "peak is the device's dense peak",
            "mfu recomputed", "report matches the run folder"} <= names
    assert audit(run_dir / "report").passed
    assert _cli(["audit", str(run_dir / "report")]) == 0
    assert "PASS" in capsys.readouterr().out


def _tamper_accounting_exposure(t):
    # One more web sample of exposure, with everything derivable from it made consistent.
    a, s = t["accounting"], t["run_summary"]
    web = a["domain"] == "web"
    a.loc[web, ["exposure_tokens", "processed_tokens"]] += SEQ_LEN
    a["realized_ratio"] = a["exposure_tokens"] / a["exposure_tokens"].sum()
    a["epochs"] = a["exposure_tokens"] / a["pool_tokens"]
    s["exposure_tokens"] += SEQ_LEN
    s["processed_tokens"] += SEQ_LEN


def _tamper_realized(t):
    a = t["accounting"]
    a.loc[a["domain"] == "web", "realized_ratio"] *= 1.005


def _tamper_unique(t):
    a = t["accounting"]
    code = a["domain"] == "code"
    a.loc[code, "unique_tokens"] = a.loc[code, "exposure_tokens"] + SEQ_LEN


def _tamper_sparse_peak(t):
    # MFU recomputed (consistently) against the H200's sparse figure.
    s = t["run_summary"]
    s["peak_tflops"] = 2 * 989.4
    s["mfu"] /= 2
    s["goodput_mfu"] /= 2


def _tamper_total(t):
    t["run_summary"]["unique_tokens"] -= SEQ_LEN


def _tamper_histogram(t):
    # math {1: 6, 2: 3} -> {1: 7, 2: 1, 3: 1}: samples, exposure and unique all unchanged.
    h = t["repetition"]
    math = h["domain"] == "math"
    assert {k: n for k, n in zip(h.loc[math, "times_seen"], h.loc[math, "samples"]) if n} == {1: 6, 2: 3}
    h.loc[math & (h["times_seen"] == 1), "samples"] = 7
    h.loc[math & (h["times_seen"] == 2), "samples"] = 1
    t["repetition"] = pd.concat([h, pd.DataFrame([{"domain": "math", "times_seen": 3, "samples": 1}])],
                                ignore_index=True)


TAMPERINGS = [
    ("one more sample of exposure", _tamper_accounting_exposure, "replay: exposure per domain"),
    ("realized ratio off by 0.5%", _tamper_realized, "schema: accounting"),
    ("unique above exposure", _tamper_unique, "schema: accounting"),
    ("unique above exposure (replay)", _tamper_unique, "replay: unique per domain"),
    ("MFU against the sparse peak", _tamper_sparse_peak, "peak is the device's dense peak"),
    ("MFU against the sparse peak (recount)", _tamper_sparse_peak, "mfu recomputed"),
    ("total not the sum of domains", _tamper_total, "invariant 2: totals = sum of domains"),
    ("histogram not the replay", _tamper_histogram, "replay: repetition histogram"),
]


@pytest.mark.parametrize("what,tamper,check", TAMPERINGS, ids=[t[0] for t in TAMPERINGS])
def test_tampered_report_fails_naming_the_check(run_dir, tmp_path, what, tamper, check, capsys):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    tables = {n: pd.read_parquet(report / f"{n}.parquet") for n in ("run_summary", "accounting", "repetition")}
    tamper(tables)
    for name, df in tables.items():
        df.to_parquet(report / f"{name}.parquet", index=False)
    result = audit(report)
    assert check in result.failed(), result.render()
    assert _cli(["audit", str(report), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is False and check in [c["name"] for c in out["checks"] if c["status"] == "FAIL"]


def test_report_out_of_step_with_run_folder_fails(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ledger = json.loads((run / "ledger.json").read_text())
    ledger["counters"]["web"]["useful"] -= 1
    ledger["counters"]["total"]["useful"] -= 1
    (run / "ledger.json").write_text(json.dumps(ledger))
    assert "report matches the run folder" in audit(run).failed()


def test_manifest_edited_after_the_run_fails(run_dir, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    m = json.loads((report / "manifests" / "code.json").read_text())
    m["pool_tokens"] += SEQ_LEN
    (report / "manifests" / "code.json").write_text(json.dumps(m))
    failed = audit(report).failed()
    assert "manifests match the experiment's pins" in failed
    assert "accounting matches manifests and mixture" in failed


def test_unusable_input_is_a_runner_error(tmp_path):
    with pytest.raises(RunnerError, match="neither a run folder"):
        audit(tmp_path)
    with pytest.raises(RunnerError, match="not an MLflow run id"):
        audit(tmp_path / "missing")
    report = tmp_path / "report"
    report.mkdir()
    (report / "run_summary.parquet").write_bytes(b"not parquet")
    with pytest.raises(RunnerError):
        audit(report)


@pytest.mark.slow
def test_mlflow_final_metrics_must_agree(run_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    ml_run = client.create_run(client.create_experiment("audit")).info.run_id
    client.log_metric(ml_run, "exposure_tokens", 768)
    client.log_metric(ml_run, "eval/web/loss_nats", 4.9)
    client.log_metric(ml_run, "useful_tokens", 767)
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    info = json.loads((run / "run.json").read_text())
    info["mlflow"] = {"tracking_uri": uri, "experiment_id": None, "run_id": ml_run}
    (run / "run.json").write_text(json.dumps(info))
    write_report(run)
    check = next(c for c in audit(run).checks if c.name == "MLflow final metrics agree")
    assert check.status == "FAIL" and "useful_tokens: MLflow 767, report 768" in check.detail
