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

from runner.reports.audit.evidence import write_evidence
from runner.reports.audit.result import FAIL, PASS
from runner.reports.audit.run import audit
from runner.reports.audit.tracked import EVIDENCE, METRICS
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
    launch(root, exp, "--run-dir", run)
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
    launch(run.parents[2], run, "--extend-to", 7 * STEP_TOKENS)  # one honest step

    result = audit(run)
    assert result.verdict == FAIL, result.render()
    failed = _metrics_check(result)
    assert failed.status == FAIL
    step = int(true_met["step"])
    assert (
        f"target.loose.time_to_target_seconds at step {step}: MLflow {true_met['wall_seconds']:.10g}" in failed.detail
    )
    assert f"eval.wall_seconds at step {step}: MLflow" in failed.detail
    assert "eval.device_wall_seconds at step 6: MLflow" in failed.detail
    # the extension's evidence matches the forged tables, and says it vouches only as of its own end
    evidence = next(c for c in result.checks if c.name == EVIDENCE)
    assert evidence.status == PASS and "rows up to step 6 rest on MLflow's metric history" in evidence.detail


def test_a_figure_is_vouched_for_by_the_evaluation_the_lineage_kept():
    """Unit check of the rule: at a step evaluated twice (a resume redid it), only points logged at or
    after the later evaluation count; `before.*` is logged at the met step; a best so far at another
    step than the report's best is not compared."""
    from types import SimpleNamespace

    from runner.reports.audit.tracked import Tracked, _compare_lineage, lineage_points

    stamps = {
        "val_loss.a": [(3, 5.0, 100), (6, 4.0, 200), (6, 4.1, 900)],  # step 6 redone at t=900
        "eval.wall_seconds": [(3, 10.0, 100), (6, 20.0, 200), (6, 31.0, 900)],
        "target.t.time_to_target_seconds": [(6, 20.0, 201), (6, 31.0, 901)],
        "target.t.before.wall_seconds": [(6, 10.0, 901)],
        "target.u.best_value": [(3, 5.0, 150)],  # attempt 1's best so far; the report's best is at 6
        "target.v.step": [(6, 6.0, 150)],  # logged before the lineage's evaluation at 6: superseded
    }
    tracked = Tracked("uri", "id", "r", {}, {}, {k: [(s, v) for s, v, _ in p] for k, p in stamps.items()}, stamps)
    assert lineage_points(tracked, "eval.wall_seconds") == {3: 10.0, 6: 31.0}
    assert lineage_points(tracked, "target.t.time_to_target_seconds") == {6: 31.0}
    assert lineage_points(tracked, "target.v.step") == {}

    def row(step, **kw):
        return {"step": step, **kw}

    want = SimpleNamespace(
        final=6,
        progress={3: {"wall_seconds": 10.0}, 6: {"wall_seconds": 31.0}},
        targets={
            ("t", "met"): row(6, wall_seconds=31.0),
            ("t", "before"): row(3, wall_seconds=10.0),
            ("u", "best"): row(6, value=4.1),
        },
    )
    problems: list[str] = []
    for key in stamps:
        if not key.startswith("val_loss"):
            _compare_lineage(key, tracked, want, problems)
    assert problems == []
    assert _compare_lineage("target.u.best_value", tracked, want, problems) == (0, 1)
    want.targets[("t", "before")] = row(3, wall_seconds=5.0)  # forged
    want.progress[3] = {"wall_seconds": 5.0}
    for key in ("eval.wall_seconds", "target.t.before.wall_seconds"):
        _compare_lineage(key, tracked, want, problems)
    assert problems == [
        "eval.wall_seconds at step 3: MLflow 10, report 5",
        "target.t.before.wall_seconds at step 6: MLflow 10, report 5",
    ]
