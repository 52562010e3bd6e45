"""The run summary says what timed the steps (`step_clock`, runner-report/4): the run's record, held to it
by the audit; reports written under runner-report/3 (the published ones) still audit, reading it as host."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from conftest import REPO
from runfixtures import make_run

from runner.reports.audit.evidence import write_report_with_evidence
from runner.reports.audit.run import audit
from runner.reports.compare.runs import load_source
from runner.reports.tables import build_tables
from schemas.report_tables import READABLE_VERSIONS, SCHEMA_VERSION, validate_tables

PUBLISHED = REPO / "reports" / "cpu-tiny" / "20261201-crash-resume"  # written under runner-report/3


def _statuses(result) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


@pytest.mark.slow  # a report written and audited twice: ~8 s on a loaded core
def test_the_run_summary_says_what_timed_the_steps_and_the_audit_holds_it_to_run_json(tmp_path):
    run = make_run(tmp_path)
    assert build_tables(run)["run_summary"].iloc[0]["step_clock"] == "host"  # a record without it: host
    info = json.loads((run / "run.json").read_text())
    info["conventions"]["step_clock"] = "device"
    (run / "run.json").write_text(json.dumps(info))
    tables = build_tables(run)
    assert tables["run_summary"].iloc[0]["step_clock"] == "device"
    assert tables["run_summary"].iloc[0]["schema_version"] == SCHEMA_VERSION == "runner-report/4"
    write_report_with_evidence(run)
    assert audit(run, check_mlflow=False).consistent
    # A summary that claims another clock than the run recorded is caught, with the key named
    summary = run / "report" / "run_summary.parquet"
    edited = pd.read_parquet(summary).assign(step_clock="host")
    edited.to_parquet(summary, index=False)
    result = audit(run / "report", check_mlflow=False)
    assert _statuses(result)["summary matches experiment config"] == "FAIL"
    assert "step_clock = 'host', run/config say 'device'" in result.render()
    bad = dict(tables, run_summary=tables["run_summary"].assign(step_clock="gpu"))
    assert any(f.table == "run_summary" and f.column == "step_clock" for f in validate_tables(bad))


def test_a_report_written_under_runner_report_3_still_audits_and_reads_the_host_clock(tmp_path):
    assert pd.read_parquet(PUBLISHED / "run_summary.parquet")["schema_version"].iloc[0] == "runner-report/3"
    result = audit(PUBLISHED, check_mlflow=False)
    assert result.consistent and not result.failed(), result.render()
    info = {c.name: c.detail for c in result.checks}["schema version"]
    assert "written under runner-report/3" in info and "run_summary.step_clock reads as 'host'" in info
    assert _statuses(result)["evidence.json matches the report"] == "PASS"  # its tables hashed as written
    source = load_source(str(PUBLISHED))  # compare reads the current columns
    assert source.tables["run_summary"].iloc[0]["step_clock"] == "host"
    # A version this runner does not read is still refused, naming the ones it does
    older = tmp_path / "older"
    shutil.copytree(PUBLISHED, older)
    summary = pd.read_parquet(older / "run_summary.parquet").assign(schema_version="runner-report/2")
    summary.to_parquet(older / "run_summary.parquet", index=False)
    result = audit(older, check_mlflow=False)
    assert "schema version" in result.failed() and ", ".join(READABLE_VERSIONS) in result.render()
