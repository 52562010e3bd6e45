"""`runner audit` on a fabricated run: a clean run is consistent but UNVERIFIED without its MLflow
run; every tampering fails naming the check; a skipped check never counts as a pass."""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest
import yaml
from runfixtures import SEQ_LEN, make_run, run_commands

from runner.cli.report import register
from runner.errors import EXIT_DISCREPANCY, EXIT_OK, EXIT_UNVERIFIED, RunnerError
from runner.reports.audit.evidence import write_evidence
from runner.reports.audit.result import FAIL, INFO, PASS, UNVERIFIED, AuditResult, Check
from runner.reports.audit.run import audit
from runner.reports.audit.tracked import NAMES as MLFLOW_CHECKS
from runner.reports.tables import write_report

CHECKPOINT_CHECK = "final checkpoint agrees with the report"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("audit"))
    write_report(run)
    write_evidence(run)
    return run


def _cli(argv):
    return run_commands(register, argv)


def test_verdicts_and_their_exit_codes():
    def result(*statuses):
        return AuditResult("x", [Check(f"c{i}", s) for i, s in enumerate(statuses)])

    assert result(PASS, INFO).verdict == PASS and result(PASS).exit_code() == EXIT_OK
    unverified = result(PASS, UNVERIFIED, INFO)
    assert unverified.verdict == UNVERIFIED and not unverified.passed and unverified.consistent
    assert unverified.exit_code() == EXIT_UNVERIFIED and unverified.exit_code(require_verified=True) == EXIT_DISCREPANCY
    failed = result(PASS, UNVERIFIED, FAIL)
    assert failed.verdict == FAIL and failed.exit_code() == EXIT_DISCREPANCY and not failed.consistent
    assert result(INFO).verdict == UNVERIFIED  # nothing checked is nothing verified
    assert len({EXIT_OK, EXIT_DISCREPANCY, EXIT_UNVERIFIED, 2}) == 4


def test_clean_run_without_mlflow_is_unverified_naming_what_could_not_run(run_dir, capsys):
    result = audit(run_dir)
    assert result.failed() == [], result.render()
    # Fabricated: no MLflow run, no checkpoint. Everything else verified.
    assert result.verdict == UNVERIFIED and result.unverified() == [CHECKPOINT_CHECK, *MLFLOW_CHECKS]
    names = {c.name for c in result.checks if c.status == PASS}
    assert {
        "replay: exposure per domain",
        "replay: repetition histogram",
        "peak is the device's dense peak",
        "mfu recomputed",
        "report matches the run folder",
        "fingerprint recomputed from experiment.yaml",
        "every mixture domain in every table",
        "evidence.json matches the report",
    } <= names
    assert audit(run_dir / "report").consistent
    assert _cli(["audit", str(run_dir / "report")]) == EXIT_UNVERIFIED
    out = capsys.readouterr().out
    assert "\nUNVERIFIED: " in out and f"not verified: {CHECKPOINT_CHECK}, MLflow run reachable, " in out
    assert _cli(["audit", str(run_dir / "report"), "--require-verified"]) == EXIT_DISCREPANCY
    capsys.readouterr()
    assert _cli(["audit", str(run_dir / "report"), "--json"]) == EXIT_UNVERIFIED
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == UNVERIFIED and out["passed"] is False and out["failed"] == []


def test_no_mlflow_is_unverified_not_passed(run_dir):
    result = audit(run_dir, check_mlflow=False)
    rows = {c.name: c for c in result.checks}
    assert all(rows[n].status == UNVERIFIED and "--no-mlflow" in rows[n].detail for n in MLFLOW_CHECKS)


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


def _tamper_domain_validation(t):
    v = t["validation"]
    t["validation"] = v[v["domain"] != "math"].reset_index(drop=True)


def _tamper_validation_exposure(t):
    t["validation"]["exposure_tokens"] += 8 * SEQ_LEN  # one more step of exposure at every evaluation


def _tamper_steps(t):
    # Two steps fewer claimed, everything in the summary scaled to match; run.json still says 6.
    s = t["run_summary"]
    s["steps"] -= 2


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
    ("a domain's validation rows removed", _tamper_domain_validation, "every mixture domain in every table"),
    ("validation exposure not its step's", _tamper_validation_exposure, "every mixture domain in every table"),
    ("fewer steps than run.json", _tamper_steps, "summary matches experiment config"),
]


@pytest.mark.parametrize("what,tamper,check", TAMPERINGS, ids=[t[0] for t in TAMPERINGS])
def test_tampered_report_fails_naming_the_check(run_dir, tmp_path, what, tamper, check, capsys):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    names = ("run_summary", "accounting", "repetition", "validation")
    tables = {n: pd.read_parquet(report / f"{n}.parquet") for n in names}
    tamper(tables)
    for name, df in tables.items():
        df.to_parquet(report / f"{name}.parquet", index=False)
    result = audit(report)
    assert check in result.failed(), result.render()
    assert _cli(["audit", str(report), "--json"]) == EXIT_DISCREPANCY
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == FAIL and check in [c["name"] for c in out["checks"] if c["status"] == FAIL]


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


def test_experiment_yaml_edited_fails_the_recomputed_fingerprint(run_dir, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    cfg = yaml.safe_load((report / "experiment.yaml").read_text())
    cfg["optim"]["lr"] *= 10
    (report / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = audit(report)
    check = next(c for c in result.checks if c.name == "fingerprint recomputed from experiment.yaml")
    assert check.status == FAIL and "run.json says" in check.detail and "run_summary says" in check.detail
    assert "evidence.json matches the report" in result.failed()  # its sha256 of experiment.yaml


def test_missing_run_json_is_unverified_never_a_pass(run_dir, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    (report / "run.json").unlink()
    result = audit(report)
    assert result.verdict == UNVERIFIED and "run.json" in result.unverified(), result.render()
    rows = {c.name: c.detail for c in result.checks}
    assert rows["MLflow run reachable"].startswith("no run.json")


def test_sloppy_forgery_of_evidence_json_fails(run_dir, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    v = pd.read_parquet(report / "validation.parquet")
    v["loss_nats"] *= 0.8
    v["bpb"] *= 0.8
    v.to_parquet(report / "validation.parquet", index=False)
    v.to_csv(report / "validation.csv", index=False)
    result = audit(report)
    check = next(c for c in result.checks if c.name == "evidence.json matches the report")
    assert check.status == FAIL and "table validation: sha256" in check.detail and "final validation" in check.detail


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


def test_audit_creates_no_file_and_no_store(run_dir, tmp_path, monkeypatch):
    # run.json names a store in a folder that exists but holds none: MLflow would create it empty.
    report = tmp_path / "copy" / "report"
    shutil.copytree(run_dir / "report", report)
    info = json.loads((report / "run.json").read_text())
    info["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment_id": "1", "run_id": "a" * 32}
    (report / "run.json").write_text(json.dumps(info))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    before = sorted(p for p in tmp_path.rglob("*"))
    result = audit(report)
    assert sorted(p for p in tmp_path.rglob("*")) == before
    detail = next(c.detail for c in result.checks if c.name == "MLflow run reachable")
    assert f"no MLflow store at {tmp_path / 'mlflow.db'} on this machine" in detail
    assert os.listdir(cwd) == []


@pytest.mark.slow
def test_mlflow_metrics_must_agree(run_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    info = json.loads((run / "run.json").read_text())
    ml_run = client.create_run(client.create_experiment("audit"), run_name=info["run_id"]).info.run_id
    final = info["committed_steps"]
    client.log_metric(ml_run, "exposure_tokens", 768, step=final)
    client.log_metric(ml_run, "useful_tokens", 767, step=final)  # the report says 768
    client.log_metric(ml_run, "val_loss.web", 4.9, step=3)
    client.log_metric(ml_run, "tokens.wiki.exposure", 16, step=3)  # a domain the report does not have
    info["mlflow"] = {"tracking_uri": uri, "experiment_id": None, "run_id": ml_run}
    (run / "run.json").write_text(json.dumps(info))
    write_report(run)
    check = next(c for c in audit(run).checks if c.name == "MLflow metrics = the report")
    assert check.status == FAIL
    assert f"useful_tokens at step {final}: MLflow 767, report 768" in check.detail
    assert "val_loss.web at step 3: MLflow 4.9, report " in check.detail
    assert "tokens.wiki.exposure: MLflow logs domain 'wiki', absent from the report" in check.detail


def test_torchrun_run_holding_more_devices_than_its_recipe_is_consistent(tmp_path):
    # A 1-device recipe launched as 2 processes: run.json `devices` = 2 is what the run held.
    run = make_run(tmp_path, recipe_devices=1)
    write_report(run)
    s = pd.read_parquet(run / "report" / "run_summary.parquet").iloc[0]
    info = json.loads((run / "run.json").read_text())
    assert s["devices"] == 2 and s["devices_counted"] == 2
    assert s["cost_per_billion_useful_tokens"] == pytest.approx(info["cost_per_billion_useful_tokens"], rel=1e-9)
    assert s["mfu"] == pytest.approx(info["mfu"], rel=1e-9)
    result = audit(run)
    assert result.failed() == [], result.render()
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
    (report / "evidence.json").unlink()  # it pins the CSV text too: this test is about the copy check alone
    df = pd.read_csv(report / f"{table}.csv", dtype=str, keep_default_na=False)
    edit(df).to_csv(report / f"{table}.csv", index=False)
    result = audit(report)
    check = next(c for c in result.checks if c.name == "csv copies equal the parquet tables")
    assert check.status == FAIL and detail in check.detail, check.detail
    assert result.failed() == ["csv copies equal the parquet tables"], result.render()


def test_csv_copy_rounded_within_tolerance_is_consistent_and_missing_copy_fails(run_dir, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    for name in ("run_summary", "throughput"):
        pd.read_parquet(report / f"{name}.parquet").to_csv(report / f"{name}.csv", index=False, float_format="%.15g")
    result = audit(report)
    assert result.failed() == [], result.render()
    (report / "accounting.csv").unlink()
    check = next(c for c in audit(report).checks if c.name == "csv copies equal the parquet tables")
    assert check.status == FAIL and "accounting: accounting.csv missing" in check.detail


def _rewrite(report, name, df):
    df.to_parquet(report / f"{name}.parquet", index=False)
    df.to_csv(report / f"{name}.csv", index=False)


def _repeak(s, peak_tflops, source):
    s["mfu"] *= float(s["peak_tflops"].iloc[0]) / peak_tflops
    s["goodput_mfu"] *= float(s["peak_tflops"].iloc[0]) / peak_tflops
    s["peak_tflops"], s["peak_source"] = peak_tflops, source


def _as_cpu_run(report, peak_tflops, source):
    s = pd.read_parquet(report / "run_summary.parquet")
    s["device_name"], s["peak_dtype"] = "cpu", "fp32"
    _repeak(s, peak_tflops, source)
    _rewrite(report, "run_summary", s)
    info = json.loads((report / "run.json").read_text())
    for record in ("conventions",):
        info[record].update(peak_tflops=peak_tflops, peak_source=source, peak_dtype="fp32")
    (report / "run.json").write_text(json.dumps(info))


def test_cpu_peak_is_recomputed_from_cores_clock_and_flops_per_cycle(run_dir, tmp_path):
    # A CPU has no datasheet row: its peak is cores x clock x FLOP/cycle (runner.planning.hardware,
    # cpu_peak: theoretical), recomputed from the numbers its source records.
    report = tmp_path / "report"
    shutil.copytree(run_dir / "report", report)
    (report / "evidence.json").unlink()
    _as_cpu_run(report, 0.3323, "theoretical: 2 cores x 2.596 GHz x 64 fp32 FLOP/cycle (AVX-512)")
    result = audit(report)
    check = next(c for c in result.checks if c.name == "peak recomputed from cores x clock x FLOP/cycle")
    assert check.status == PASS and result.failed() == [], result.render()

    # Halved, so that MFU doubles, with the source left as written: the recount catches it.
    _as_cpu_run(report, 0.3323 / 2, "theoretical: 2 cores x 2.596 GHz x 64 fp32 FLOP/cycle (AVX-512)")
    assert "peak recomputed from cores x clock x FLOP/cycle" in audit(report).failed()

    # A measured burst cannot be recomputed: never a pass.
    _as_cpu_run(report, 0.3, "measured: torch.mm fp32 1024x1024, 2 threads, best burst over 1 s")
    result = audit(report)
    assert result.failed() == [] and "peak is a figure the audit can verify" in result.unverified()

    # The same wording does not excuse an H200 from its datasheet's dense peak.
    s = pd.read_parquet(run_dir / "report" / "run_summary.parquet")
    _repeak(s, 2 * 989.4, "theoretical: 2x the dense figure")
    _rewrite(report, "run_summary", s)
    assert "peak is the device's dense peak" in audit(report).failed()


def test_evidence_hashes_the_csv_text_and_reads_back_from_tags_exactly(run_dir):
    from runner.fsio import sha256_file
    from runner.reports.audit import evidence as ev

    found = ev.build_evidence(run_dir)
    for name, digest in found["tables"].items():
        assert digest == sha256_file(run_dir / "report" / f"{name}.csv")  # `sha256sum` says the same
    assert found["validation"]["step"] == 6 and set(found["validation"]["domains"]) == {"code", "math", "web"}
    found["checkpoint"] = {"step": 6, "state_json_sha256": "ab" * 32, "files": {"model.safetensors": "cd" * 32}}
    found["validation"]["domains"]["web"]["loss_nats"] = 0.1 + 0.2  # a float whose str() would lose digits
    tags = ev.evidence_tags(found)
    assert tags["evidence.checkpoint.file.model.safetensors.sha256"] == "cd" * 32
    assert ev.evidence_from_tags(tags) == found
    assert ev.evidence_from_tags({"fingerprint": "x"}) is None


def test_theoretical_cpu_peak_is_recomputed_from_its_own_source():
    from runner.planning.hardware import cpu_theoretical_tflops, theoretical_peak_from_source

    peak = cpu_theoretical_tflops(threads=3)
    if not peak.peak_source.startswith("theoretical"):
        pytest.skip("this CPU does not describe itself (no /proc/cpuinfo flags)")
    recomputed, rounding = theoretical_peak_from_source(peak.peak_source)
    assert recomputed == pytest.approx(peak.peak_tflops, rel=rounding)
    assert theoretical_peak_from_source("theoretical: 2 cores x 2.5 GHz x 32 fp32 FLOP/cycle (AVX2)") == (
        pytest.approx(0.16),
        pytest.approx(0.0002),
    )
    assert theoretical_peak_from_source("measured: torch.mm") is None
    assert theoretical_peak_from_source("theoretical: 0 cores x 2.5 GHz x 32 fp32 FLOP/cycle") is None
