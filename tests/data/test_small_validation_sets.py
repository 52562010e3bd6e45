"""Honest small sets: the report shows the samples and tokens each validation loss rests on, and
the audit notes (never fails) domains below the threshold."""

from __future__ import annotations

import json

import pandas as pd
from runfixtures import SEQ_LEN, make_run

from runner.data.manifest import MIN_VALIDATION_SAMPLES, small_validation_warning
from runner.reports.audit.run import INFO, audit
from runner.reports.tables import write_report


def test_report_and_audit_show_each_domains_validation_samples(tmp_path):
    run = make_run(tmp_path)  # its eval recipe scores 2 samples per domain
    write_report(run)
    validation = pd.read_parquet(run / "report/validation.parquet")
    assert set(validation["samples"]) == {2} and set(validation["tokens"]) == {2 * SEQ_LEN}
    md = (run / "report/report.md").read_text()
    assert "| domain | loss_nats | bpb | samples | tokens |" in md
    assert f"- domain 'code' is validated on 2 samples ({2 * SEQ_LEN} tokens), fewer than 16" in md
    assert "(raise eval.samples_per_domain)" in md  # the eval recipe asked for 2: the data is not the limit

    result = audit(run)
    assert result.consistent, result.render()  # a note, not a failure (UNVERIFIED: no MLflow run here)
    (note,) = [c for c in result.checks if c.name == "validation set sizes"]
    domains = sorted(json.loads((run / "ledger.json").read_text())["counters"])
    assert note.status == INFO
    assert all(
        f"domain '{d}' is validated on 2 samples ({2 * SEQ_LEN} tokens)" in note.detail for d in domains if d != "total"
    )


def test_the_threshold_and_its_advice():
    assert small_validation_warning("web", MIN_VALIDATION_SAMPLES, 16 * 2048) is None
    assert "no validation samples" in small_validation_warning("web", 0, 0)
    assert "raise eval.samples_per_domain" in small_validation_warning("web", 4, 512, samples_asked=4)
    assert "--validation-fraction" in small_validation_warning("web", 4, 512, samples_asked=16)
