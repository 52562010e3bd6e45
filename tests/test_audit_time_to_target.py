"""A forged time-to-target against the run's MLflow record (issue 27, item 1): halve every evaluation's
wall and device seconds in metrics/eval.jsonl, rebuild the report, extend the run by one honest step
(whose end logs evidence over the forged tables): the audit compares every reported target figure and
evaluation time with what MLflow recorded when the evaluation happened, and FAILs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_targets import _set_targets, learnable_project
from trainfixtures import launch

from runner.reports.audit import audit
from runner.reports.audit_tracked import METRICS
from runner.reports.checks import FAIL, PASS
from runner.reports.evidence import write_evidence
from runner.reports.tables import read_tables, write_report

STEP_TOKENS = 8 * 16


@pytest.fixture(scope="module")
def targeted_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("time-to-target")
    exp = learnable_project(root, steps=6, eval_every=2, checkpoint_every=6, lr=1e-2)
    _set_targets(
        root / "recipes/eval/e.yaml",
        {"loose": {"domain": "mean", "loss_nats": 50.0}, "tight": {"domain": "a", "bpb": 0.001}},
        (),
    )
    run = root / "runs" / "t"
    launch(root, exp, "--run-dir", run, timeout=900)
    return run


def _metrics_check(result):
    return next(c for c in result.checks if c.name == METRICS)


@pytest.mark.slow
def test_a_forged_time_to_target_fails_even_after_an_honest_extension(targeted_run: Path):
    run = targeted_run
    honest = audit(run)
    assert honest.failed() == [] and _metrics_check(honest).status == PASS, honest.render()
    detail = _metrics_check(honest).detail
    assert "target." not in detail.split("no report counterpart:")[1]  # compared, not just listed
    assert "eval.wall_seconds" not in detail.split("no report counterpart:")[1]
    true_met = read_tables(run / "report")["targets"].set_index(["target", "point"]).loc[("loose", "met")]

    path = run / "metrics" / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["wall_seconds"] /= 2
        r["device_wall_seconds"] /= 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(run)
    write_evidence(run)
    forged = read_tables(run / "report")["targets"].set_index(["target", "point"]).loc[("loose", "met")]
    assert forged["wall_seconds"] == pytest.approx(true_met["wall_seconds"] / 2)
    launch(run.parents[2], run, "--extend-to", 7 * STEP_TOKENS, timeout=900)  # one honest step

    result = audit(run)
    assert result.verdict == FAIL, result.render()
    failed = _metrics_check(result)
    assert failed.status == FAIL
    step = int(true_met["step"])
    assert f"target.loose.time_to_target_seconds at step {step}: MLflow {true_met['wall_seconds']:.10g}" in failed.detail
    assert f"eval.wall_seconds at step {step}: MLflow" in failed.detail
    assert "eval.device_wall_seconds at step 6: MLflow" in failed.detail
