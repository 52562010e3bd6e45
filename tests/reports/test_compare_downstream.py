"""`runner compare` shows downstream figures side by side and refuses to compare those recorded
under differing convention records (SPEC "Downstream evaluation": two figures compare only when
their records are equal): one line naming the differing key, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from runner.reports.tables import _typed

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "reports/cpu-tiny/20261201-crash-resume"


def _record(metric: str, **changed) -> str:
    record = {
        "task_sha256": "a" * 64,
        "config_sha256": None,
        "format": "builtin",
        "metric": metric,
        "limit": None,
        "seed": 0,
        "shots": "as rendered",
        "empty_context_prefix": 0,
        "delimiter": "as rendered",
        "seq_len": 128,
        "dtype": "float32",
        "random_baseline": None,
    }
    return json.dumps({**record, **changed}, sort_keys=True)


def _report(tmp: Path, name: str, acc: dict[int, float], **changed) -> Path:
    """A copy of the published cpu-tiny report with a downstream table: builtin acc at each step."""
    folder = tmp / name
    shutil.copytree(PUBLISHED, folder)
    rows = [
        {
            "source": "loop",
            "step": step,
            "exposure_tokens": step * 1024,
            "task": "builtin",
            "metric": "acc",
            "value": value,
            "documents": 151,
            "random_baseline": 0.25,
            "convention": _record("acc", **changed),
            "t_eval_seconds": 1.5,
            "useful_tokens": step * 1000,
            "wall_seconds": step * 2.0,
            "device_wall_seconds": step * 2.0,
        }
        for step, value in acc.items()
    ]
    df = _typed("downstream", pd.DataFrame(rows))
    df.to_parquet(folder / "downstream.parquet", index=False)
    df.to_csv(folder / "downstream.csv", index=False)
    return folder


@pytest.fixture()
def cli(capsys):
    from runner.cli import main

    def run(*args):
        code = main([str(a) for a in args])
        return code, capsys.readouterr()

    return run


def test_same_convention_figures_are_shown_side_by_side(tmp_path, cli):
    a = _report(tmp_path, "a", {100: 0.20, 150: 0.30})
    b = _report(tmp_path, "b", {150: 0.35})
    code, out = cli("compare", a, b, "--labels", "base,other", "--json")
    assert code == 0, out.err
    rows = json.loads(out.out)["downstream"]
    assert rows == [
        {
            "task": "builtin",
            "metric": "acc",
            "base": 0.30,  # the latest scoring, not the first
            "base step": 150,
            "base documents": 151,
            "other": 0.35,
            "other step": 150,
            "other documents": 151,
        }
    ]
    code, out = cli("compare", a, b, "--labels", "base,other")
    assert code == 0 and "## Downstream tasks" in out.out
    assert "| builtin | acc | 0.3 | 150 | 151 | 0.35 | 150 | 151 |" in out.out


@pytest.mark.parametrize(
    ("key", "changed"),
    [("limit", 100), ("task_sha256", "b" * 64), ("delimiter", "\n")],
)
def test_differing_convention_records_are_refused_naming_the_key(tmp_path, cli, key, changed):
    a = _report(tmp_path, "a", {150: 0.30})
    b = _report(tmp_path, "b", {150: 0.35}, **{key: changed})
    code, out = cli("compare", a, b, "--labels", "base,other")
    assert code == 2 and out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err
    assert f"downstream builtin.acc: convention key `{key}` differs (base: " in lines[0]
    assert f"other: {changed!r}" in lines[0]


def test_runs_without_downstream_figures_compare_as_before(tmp_path, cli):
    code, out = cli("compare", PUBLISHED, _report(tmp_path, "b", {150: 0.35}), "--labels", "x,y", "--json")
    assert code == 0, out.err
    assert json.loads(out.out)["downstream"][0]["x"] is None  # the published run scored no task
    code, out = cli("compare", PUBLISHED, PUBLISHED, "--labels", "x,y", "--json")
    assert code == 0 and "downstream" not in json.loads(out.out)


def test_aggregates_over_differently_pinned_tasks_are_refused(tmp_path, cli):
    a = _report(tmp_path, "a", {150: 0.30})
    b = _report(tmp_path, "b", {150: 0.35}, task_sha256="c" * 64)
    for folder, value in ((a, 0.1), (b, 0.2)):
        df = pd.read_parquet(folder / "downstream.parquet")
        agg = df.iloc[[0]].assign(
            task="aggregate",
            metric="mean_centered",
            value=value,
            random_baseline=0.0,
            convention=json.dumps({"rule": "mean_centered", "tasks": {"builtin": "acc"}}, sort_keys=True),
        )
        part = _typed("downstream", pd.concat([agg, df]))
        part.to_parquet(folder / "downstream.parquet", index=False)
        part.to_csv(folder / "downstream.csv", index=False)
    code, out = cli("compare", a, b, "--labels", "base,other")
    assert code == 2
    # the aggregate's own record is the same in both runs; the tasks it averages are pinned differently
    assert "downstream aggregate.mean_centered: convention key `task_records` differs" in out.err


def test_aggregates_over_different_subsets_are_refused(tmp_path, cli):
    """The aggregate averages builtin's centered_acc, which neither run records as a figure: the
    aggregate's own record names each task's (limit included), so two subsets never compare equal."""
    folders = {}
    for name, limit in (("a", 100), ("b", 50)):
        folder = folders[name] = _report(tmp_path, name, {150: 0.30}, limit=limit)
        df = pd.read_parquet(folder / "downstream.parquet")
        record = {
            "rule": "mean_centered",
            "tasks": {"builtin": "centered_acc"},
            "task_records": {"builtin": json.loads(_record("centered_acc", limit=limit))},
        }
        agg = df.iloc[[0]].assign(task="aggregate", metric="mean_centered", value=0.1, random_baseline=0.0)
        agg = agg.assign(convention=json.dumps(record, sort_keys=True))
        part = _typed("downstream", pd.concat([agg, df[df["task"] != "builtin"]]))  # no builtin figure beside it
        part.to_parquet(folder / "downstream.parquet", index=False)
        part.to_csv(folder / "downstream.csv", index=False)
    code, out = cli("compare", folders["a"], folders["b"], "--labels", "base,other")
    assert code == 2 and len(out.err.strip().splitlines()) == 1, out.err
    assert "downstream aggregate.mean_centered: convention key `task_records` differs" in out.err


def test_downstream_targets_show_who_gets_there_first(tmp_path, cli):
    """A downstream target judged on each run's loop scorings: met at the first at or above, first in
    tokens, seconds and dollars; a name meaning two targets is refused."""
    import yaml

    def with_target(folder: Path, target: dict) -> Path:
        cfg = yaml.safe_load((folder / "experiment.yaml").read_text())
        cfg["eval"]["tasks"] = {"builtin": {"format": "builtin", "metrics": ["acc"]}}
        cfg["eval"]["targets"] = {"third": target}
        (folder / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        from runner.training.task_targets import TaskTarget, task_targets_table

        # the report's own table, as `runner report` writes it (a report with tasks has one)
        scores = pd.read_parquet(folder / "downstream.parquet")
        table = task_targets_table([TaskTarget("third", **target)], scores, 150, 1.0)
        table.to_parquet(folder / "downstream_targets.parquet", index=False)
        return folder

    spec = {"task": "builtin", "metric": "acc", "at_least": 0.3}
    a = with_target(_report(tmp_path, "a", {100: 0.20, 150: 0.30}), spec)
    b = with_target(_report(tmp_path, "b", {100: 0.32, 150: 0.35}), spec)
    code, out = cli("compare", a, b, "--labels", "base,other", "--json")
    assert code == 0, out.err
    rows = {r["run"]: r for r in json.loads(out.out)["downstream_targets"]}
    assert (rows["base"]["met"], rows["base"]["step"], rows["base"]["before_step"]) == (True, 150, 100)
    assert (rows["other"]["step"], rows["other"]["before_step"], rows["other"]["wall_seconds"]) == (100, None, 200.0)
    assert rows["other"]["first_in_exposure_tokens"] and not rows["base"]["first_in_exposure_tokens"]
    code, out = cli("compare", a, b, "--labels", "base,other")
    assert code == 0 and "### Downstream targets: who gets there first" in out.out
    assert "| `third` (builtin acc >= 0.3) | step 150: 153,600 tokens, 300.0 s," in out.out
    with_target(b, {**spec, "at_least": 0.5})
    code, out = cli("compare", a, b, "--labels", "base,other")
    assert code == 2 and out.err.strip().endswith("rename one so a comparison judges every run by the same target")
