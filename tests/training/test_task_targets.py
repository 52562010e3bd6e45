"""Downstream quality targets (`eval.targets.NAME: {task, metric, at_least}`, SPEC "Downstream
evaluation"): checked as data (one line naming file and key, exit 2; never in the fingerprint), judged
on the lineage's loop scorings (the bracket, time- and cost-to-target), and the table's schema."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pandera.errors
import pytest
import yaml
from trainfixtures import env, make_project, run_in_process

from runner.config.load import load_experiment
from runner.training.task_targets import TaskTarget, declared_task_targets, task_targets_table
from schemas.report_tables import DOWNSTREAM_TARGETS

PRICE = 3.0


def _scorings(values: dict[int, float], *, task: str = "builtin", metric: str = "acc", source: str = "loop"):
    """A downstream table's rows: `values` by step, with progress a hand computation can follow."""
    return [
        {
            "source": source,
            "step": step,
            "exposure_tokens": step * 100,
            "task": task,
            "metric": metric,
            "value": value,
            "documents": 8,
            "random_baseline": 0.25,
            "convention": "{}",
            "t_eval_seconds": 0.5,
            "useful_tokens": step * 90,
            "wall_seconds": 10.0 * step if source == "loop" else math.nan,
            "device_wall_seconds": 20.0 * step if source == "loop" else math.nan,
        }
        for step, value in values.items()
    ]


ACC = {10: 0.30, 20: 0.45, 30: 0.40, 40: 0.55}
TABLE = pd.DataFrame(
    _scorings(ACC)
    + _scorings({10: 0.9, 20: 0.9}, source="runner eval")  # scored after the fact: never judged
    + _scorings({20: 0.7}, metric="acc_norm")
)


def _outcome(target: TaskTarget, committed: int = 40) -> dict[str, dict]:
    table = task_targets_table([target], TABLE, committed, PRICE)
    DOWNSTREAM_TARGETS.validate(table)
    return {r["point"]: r for r in table.to_dict(orient="records")}


def test_met_at_the_first_scoring_at_or_above_with_the_one_before():
    rows = _outcome(TaskTarget("t", "builtin", "acc", 0.45))  # exactly at a scoring counts as met
    assert set(rows) == {"before", "met"}
    met, before = rows["met"], rows["before"]
    assert (before["step"], before["value"], met["step"], met["value"]) == (10, 0.30, 20, 0.45)
    assert (met["exposure_tokens"], met["useful_tokens"], met["wall_seconds"]) == (2000, 1800, 200.0)
    # device-hours: device-seconds at the scoring / 3600; cost: device-hours x price
    assert met["device_hours"] == pytest.approx(400 / 3600) and met["cost_usd"] == pytest.approx(PRICE * 400 / 3600)
    assert met["met"] and before["met"]
    # a value that dips after the crossing does not move it
    rows = _outcome(TaskTarget("t", "builtin", "acc", 0.42))
    assert (rows["before"]["step"], rows["met"]["step"]) == (10, 20)
    first = _outcome(TaskTarget("t", "builtin", "acc", 0.1))  # met at the first scoring: no before
    assert set(first) == {"met"} and first["met"]["step"] == 10


def test_never_met_reports_the_best_and_the_lineage_only():
    rows = _outcome(TaskTarget("t", "builtin", "acc", 0.6))
    assert set(rows) == {"best"} and (rows["best"]["step"], rows["best"]["value"]) == (40, 0.55)
    assert rows["best"]["met"] is False
    # steps past the last committed one (lost work) are not the lineage's: best is step 20 then
    rows = _outcome(TaskTarget("t", "builtin", "acc", 0.5), committed=30)
    assert set(rows) == {"best"} and rows["best"]["step"] == 20
    # runner eval's 0.9 at step 10 never meets a target; another metric is judged on its own figures
    assert set(_outcome(TaskTarget("t", "builtin", "acc", 0.8))) == {"best"}
    assert _outcome(TaskTarget("t", "builtin", "acc_norm", 0.7))["met"]["step"] == 20
    # no scoring of the task's metric: no rows
    assert task_targets_table([TaskTarget("t", "arc", "acc", 0.1)], TABLE, 40, PRICE).empty


def test_the_earliest_of_equal_best_values():
    table = pd.DataFrame(_scorings({10: 0.5, 20: 0.5, 30: 0.4}))
    out = task_targets_table([TaskTarget("t", "builtin", "acc", 0.9)], table, 30, PRICE)
    assert out["step"].tolist() == [10]


def test_the_schema_refuses_a_forged_bracket():
    good = task_targets_table([TaskTarget("t", "builtin", "acc", 0.45)], TABLE, 40, PRICE)
    DOWNSTREAM_TARGETS.validate(good)
    below = good.copy()
    below.loc[below["point"] == "met", "value"] = 0.44  # a met row under at_least
    above = good.copy()
    above.loc[above["point"] == "before", "value"] = 0.5  # a before row already at or above it
    later = good.copy()
    later.loc[later["point"] == "before", "step"] = 30  # before after met
    cheap = good.copy()
    cheap.loc[cheap["point"] == "met", "device_hours"] = 0.0  # fewer device-seconds than wall seconds
    for bad in (below, above, later, cheap):
        with pytest.raises(pandera.errors.SchemaError):
            DOWNSTREAM_TARGETS.validate(bad)


# ---- declared as data ---------------------------------------------------------------------------


def _project(tmp: Path, targets: dict) -> Path:
    exp = make_project(tmp, steps=4, seq_len=64)
    recipe = tmp / "recipes/eval/e.yaml"
    body = yaml.safe_load(recipe.read_text())
    body["tasks"] = {"builtin": {"format": "builtin", "metrics": ["acc", "centered_acc", "bpb"]}}
    body["targets"] = targets
    recipe.write_text(yaml.safe_dump(body))
    return exp


def _validate(tmp: Path, exp: Path):
    return run_in_process(tmp, ["validate", str(exp.relative_to(tmp))], env(tmp))


def test_bad_downstream_targets_are_refused_one_line_each(tmp_path):
    exp = _project(
        tmp_path,
        {
            "ok": {"task": "builtin", "metric": "acc", "at_least": 0.4},
            "bpb": {"task": "builtin", "metric": "bpb", "at_least": 0.4},
            "none": {"task": "builtin", "metric": "acc"},
            "high": {"task": "builtin", "metric": "acc", "at_least": 1.5},
            "mixed": {"task": "builtin", "metric": "acc", "at_least": 0.3, "domain": "a"},
            "loose": {"domain": "a", "loss_nats": 5.0, "at_least": 0.3},
        },
    )
    out = _validate(tmp_path, exp)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    e = "error: recipes/eval/e.yaml: targets"
    assert set(out.stderr.strip().splitlines()) == {
        f"{e}.bpb.metric: bpb is lower-is-better; a downstream target is an accuracy at_least",
        f"{e}.none.at_least: a downstream target is met at or above at_least: give it",
        f"{e}.high.at_least: must be a finite number <= 1 (an accuracy), got 1.5",
        f"{e}.mixed.domain: a downstream target (task) gives task, metric and at_least only",
        f"{e}.loose.at_least: a downstream target's key: give task too",
    }
    # a task or metric the recipe does not score is the experiment's to name (tasks and targets together)
    exp = _project(
        tmp_path,
        {
            "ok": {"task": "builtin", "metric": "acc", "at_least": 0.4},
            "typo": {"task": "builtn", "metric": "acc", "at_least": 0.4},
        },
    )
    out = _validate(tmp_path, exp)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: experiments/t.yaml: eval.targets.typo.task: 'builtn' is not a task of eval.tasks "
        "(builtin, aggregate) (did you mean 'builtin'?)"
    )
    exp = _project(tmp_path, {"m": {"task": "builtin", "metric": "acc_norm", "at_least": 0.4}})
    out = _validate(tmp_path, exp)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: experiments/t.yaml: eval.targets.m.metric: 'acc_norm' is not a metric task 'builtin' records "
        "(acc, centered_acc, bpb)"
    )
    exp = _project(tmp_path, {"m": {"task": "aggregate", "metric": "acc", "at_least": 0.1}})
    out = _validate(tmp_path, exp)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: experiments/t.yaml: eval.targets.m.metric: the aggregate's metric is eval.aggregate "
        "('mean_centered'), not 'acc'"
    )


def test_downstream_targets_are_declared_and_never_in_the_fingerprint(tmp_path):
    exp = _project(tmp_path, {})
    plain = load_experiment(exp).fingerprint
    exp = _project(
        tmp_path,
        {
            "arc": {"task": "builtin", "metric": "centered_acc", "at_least": -0.2},
            "all": {"task": "aggregate", "metric": "mean_centered", "at_least": 0.1},
            "val": {"domain": "a", "loss_nats": 5.0},
        },
    )
    loaded = load_experiment(exp)
    assert loaded.fingerprint == plain
    assert declared_task_targets(loaded.config) == [
        TaskTarget("all", "aggregate", "mean_centered", 0.1),
        TaskTarget("arc", "builtin", "centered_acc", -0.2),
    ]
    from runner.training.targets import declared_targets

    assert [t.name for t in declared_targets(loaded.config)] == ["val"]  # validation targets only
