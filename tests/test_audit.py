"""`runner audit`: a clean fabricated run passes; every tampering fails naming the check."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from runfixtures import SEQ_LEN, make_run, run_commands

from runner.cli.report import register
from runner.errors import RunnerError
from runner.reports.audit import audit
from runner.reports.tables import write_report


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
    assert {
        "replay: exposure per domain",
        "replay: repetition histogram",
        "peak is the device's dense peak",
        "mfu recomputed",
        "report matches the run folder",
    } <= names
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
    t["repetition"] = pd.concat(
        [h, pd.DataFrame([{"domain": "math", "times_seen": 3, "samples": 1}])], ignore_index=True
    )


def _tamper_devices(t):
    # Summary says 1 device (as the recipe of a torchrun run would) with MFU, goodput MFU and cost
    # made consistent with it; run.json says the run held 2.
    s = t["run_summary"]
    s["devices"] = 1
    s["devices_counted"] = 1
    s["mfu"] *= 2
    s["goodput_mfu"] *= 2
    s["cost_per_billion_useful_tokens"] /= 2


TAMPERINGS = [
    ("one more sample of exposure", _tamper_accounting_exposure, "replay: exposure per domain"),
    ("realized ratio off by 0.5%", _tamper_realized, "schema: accounting"),
    ("unique above exposure", _tamper_unique, "schema: accounting"),
    ("unique above exposure (replay)", _tamper_unique, "replay: unique per domain"),
    ("MFU against the sparse peak", _tamper_sparse_peak, "peak is the device's dense peak"),
    ("MFU against the sparse peak (recount)", _tamper_sparse_peak, "mfu recomputed"),
    ("total not the sum of domains", _tamper_total, "invariant 2: totals = sum of domains"),
    ("histogram not the replay", _tamper_histogram, "replay: repetition histogram"),
    ("MFU over fewer devices than held", _tamper_devices, "mfu recomputed"),
    ("goodput MFU over fewer devices than held", _tamper_devices, "goodput_mfu recomputed"),
    ("cost over fewer devices than held", _tamper_devices, "cost_per_billion_useful_tokens recomputed"),
    ("devices not the devices held", _tamper_devices, "summary matches experiment config"),
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


def test_torchrun_run_holding_more_devices_than_its_recipe_passes(tmp_path):
    # A 1-device recipe launched as 2 processes: run.json `devices` = 2 is what the run held.
    run = make_run(tmp_path, recipe_devices=1)
    write_report(run)
    s = pd.read_parquet(run / "report" / "run_summary.parquet").iloc[0]
    info = json.loads((run / "run.json").read_text())
    assert s["devices"] == 2 and s["devices_counted"] == 2
    assert s["cost_per_billion_useful_tokens"] == pytest.approx(info["cost_per_billion_useful_tokens"], rel=1e-9)
    assert s["mfu"] == pytest.approx(info["mfu"], rel=1e-9)
    result = audit(run)
    assert result.passed, result.render()
    row = next(c for c in result.checks if c.name == "devices held vs recipe")
    assert row.status == "INFO" and row.detail == "held 2, recipe 1"


def test_devices_held_vs_recipe_is_informational_when_equal(run_dir):
    row = next(c for c in audit(run_dir).checks if c.name == "devices held vs recipe")
    assert row.status == "INFO" and row.detail == "held 2, recipe 2"


def _csv_set(table, row, col, value):
    def edit(df):
        df.loc[row, col] = value
        return df

    return table, edit


def _csv_scale(table, col, factor):
    def edit(df):
        df[col] = [repr(float(v) * factor) for v in df[col]]
        return df

    return table, edit


CSV_TAMPERINGS = [
    (
        "code unique tokens",
        *_csv_set("accounting", 0, "unique_tokens", "9000"),
        "accounting: row 0, unique_tokens: csv '9000', parquet ",
    ),
    ("mfu off by 1e-6", *_csv_scale("run_summary", "mfu", 1 + 1e-6), "run_summary: row 0, mfu: csv "),
    ("domain renamed", *_csv_set("validation", 1, "domain", "wab"), "validation: row 1, domain: csv 'wab'"),
    (
        "bool flipped",
        *_csv_set("run_summary", 0, "attention_causal_half", "True"),
        "run_summary: row 0, attention_causal_half: csv 'True', parquet False",
    ),
    ("int not a number", *_csv_set("repetition", 2, "samples", "x"), "repetition: row 2, samples: csv 'x'"),
    ("row dropped", "throughput", lambda df: df.iloc[:-1], "throughput: csv has 5 rows, parquet 6"),
    (
        "column dropped",
        "repetition",
        lambda df: df.drop(columns=["samples"]),
        "repetition: csv columns ['domain', 'times_seen'], parquet ['domain', 'times_seen', 'samples']",
    ),
]


@pytest.mark.parametrize("what,table,edit,detail", CSV_TAMPERINGS, ids=[t[0] for t in CSV_TAMPERINGS])
def test_tampered_csv_copy_fails_naming_table_and_cell(run_dir, tmp_path, what, table, edit, detail):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    df = pd.read_csv(report / f"{table}.csv", dtype=str, keep_default_na=False)
    edit(df).to_csv(report / f"{table}.csv", index=False)
    result = audit(report)
    check = next(c for c in result.checks if c.name == "csv copies equal the parquet tables")
    assert check.status == "FAIL" and detail in check.detail, check.detail
    assert result.failed() == ["csv copies equal the parquet tables"], result.render()


def test_csv_copy_rounded_within_tolerance_passes_and_missing_copy_fails(run_dir, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    for name in ("run_summary", "throughput"):
        pd.read_parquet(report / f"{name}.parquet").to_csv(report / f"{name}.csv", index=False, float_format="%.15g")
    result = audit(report)
    assert result.passed, result.render()
    (report / "accounting.csv").unlink()
    check = next(c for c in audit(report).checks if c.name == "csv copies equal the parquet tables")
    assert check.status == "FAIL" and "accounting: accounting.csv missing" in check.detail


def _rewrite(report, name, df):
    df.to_parquet(report / f"{name}.parquet", index=False)
    df.to_csv(report / f"{name}.csv", index=False)


def _repeak(s, peak_tflops, source):
    s["mfu"] *= float(s["peak_tflops"].iloc[0]) / peak_tflops
    s["goodput_mfu"] *= float(s["peak_tflops"].iloc[0]) / peak_tflops
    s["peak_tflops"], s["peak_source"] = peak_tflops, source


def test_cpu_peak_derived_on_the_machine_is_accepted_a_datasheet_device_is_not(run_dir, tmp_path):
    # A CPU has no datasheet row: its peak is cores x clock x FLOP/cycle (runner.planning.hardware, cpu_peak:
    # theoretical) or a timed matmul (measured), recorded with how it was derived.
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    s = pd.read_parquet(report / "run_summary.parquet")
    s["device_name"], s["peak_dtype"] = "cpu", "fp32"
    _repeak(s, 0.3323, "theoretical: 2 cores x 2.596 GHz x 64 fp32 FLOP/cycle")
    _rewrite(report, "run_summary", s)
    result = audit(report)
    assert result.passed, result.render()

    # The same wording does not excuse an H200 from its datasheet's dense peak.
    s = pd.read_parquet(run_dir / "report" / "run_summary.parquet")
    _repeak(s, 2 * 989.4, "theoretical: 2x the dense figure")
    _rewrite(report, "run_summary", s)
    assert "peak is the device's dense peak" in audit(report).failed()
