"""Quality targets: declared as data, judged at evaluations, bracketed, timed across resumes, logged to
MLflow, reported, and recounted by the audit."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from runfixtures import make_run
from trainfixtures import launch, make_project, run_in_process

from runner.config.load import load_experiment
from runner.data.manifest import write_manifest
from runner.fsio import read_jsonl, sha256_file
from runner.reports import targets as tg
from runner.reports.audit.run import audit
from runner.reports.tables import build_tables, read_tables, write_report
from schemas.report_tables import validate_tables

REPO = Path(__file__).resolve().parents[2]


# ---- declared as data ---------------------------------------------------------------------------


def _eval_recipe(project: Path, targets: dict) -> None:
    path = project / "recipes/eval/tiny-eval.yaml"
    data = yaml.safe_load(path.read_text())
    data["targets"] = targets
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _validate(project: Path) -> subprocess.CompletedProcess:
    """`runner validate experiments/cpu-tiny.yaml` in `project`, in this process as a subprocess runs it."""
    return run_in_process(project, ["validate", "experiments/cpu-tiny.yaml"], dict(os.environ))


def test_bad_targets_are_refused_one_line_each(project):
    _eval_recipe(
        project,
        {
            "ok": {"domain": "code", "loss_nats": 6.0},
            "typo": {"domain": "cod", "loss_nats": 6.0},
            "both": {"domain": "mean", "loss_nats": 6.0, "bpb": 2.0},
            "neither": {"domain": "prose"},
            "negative": {"domain": "prose", "bpb": -1.0},
            "nan": {"domain": "legal", "loss_nats": float("nan")},
            "a.b": {"domain": "code", "bpb": 2.0},
        },
    )
    out = _validate(project)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = set(out.stderr.strip().splitlines())
    # each target's own faults are the eval recipe's: named in that file
    e = "error: recipes/eval/tiny-eval.yaml: targets"
    assert lines == {
        f"{e}.both: give exactly one of loss_nats or bpb: a target is one threshold (declare two targets for both)",
        f"{e}.neither: give exactly one of loss_nats or bpb",
        f"{e}.negative.bpb: must be a positive, finite number, got -1.0",
        f"{e}.nan.loss_nats: must be a positive, finite number, got nan",
        f"{e}.a.b: a target name is letters, digits, '_' and '-' (it names MLflow metrics)",
    }
    # a domain the mixture lacks is the experiment's (the recipe alone knows no mixture)
    _eval_recipe(project, {"ok": {"domain": "code", "loss_nats": 6.0}, "typo": {"domain": "cod", "loss_nats": 6.0}})
    out = _validate(project)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: experiments/cpu-tiny.yaml: eval.targets.typo.domain: 'cod' is not a domain of the mixture "
        "(code, prose, legal) nor 'mean' (did you mean 'code'?)"
    )
    _eval_recipe(project, {"x": {"domain": "code", "loss_nats": "low"}})
    out = _validate(project)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: recipes/eval/tiny-eval.yaml: targets.x.loss_nats: must be a number, got 'low'"


def test_targets_are_not_part_of_the_fingerprint(project):
    shipped = load_experiment(project / "experiments/cpu-tiny.yaml")
    assert len(shipped.config.eval.targets) == 4  # tiny-eval@2 ships targets
    _eval_recipe(project, {})
    assert load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint == shipped.fingerprint
    _eval_recipe(project, {"other": {"domain": "mean", "bpb": 1.0}})
    assert load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint == shipped.fingerprint
    # The fingerprint before targets existed (tiny-eval@1): every saved run keeps its identity.
    assert shipped.fingerprint.startswith("4f70b16fe06fec74")


# ---- judged at evaluations ----------------------------------------------------------------------


def _validation(losses: dict[int, dict[str, float]], tokens: dict[str, int]) -> pd.DataFrame:
    rows = []
    for step, by_domain in losses.items():
        for d, loss in by_domain.items():
            rows.append(
                {
                    "step": step,
                    "exposure_tokens": step * 100,
                    "domain": d,
                    "loss_nats": loss,
                    "bpb": loss / 2,
                    "tokens": tokens[d],
                    "useful_tokens": step * 90,
                    "wall_seconds": 10.0 * step,
                    "device_wall_seconds": 20.0 * step,
                }
            )
    return pd.DataFrame(rows)


LOSSES = {10: {"x": 6.0, "y": 5.0}, 20: {"x": 5.5, "y": 4.0}, 30: {"x": 5.2, "y": 4.2}}
TOKENS = {"x": 300, "y": 100}


def _rows(target: tg.Target, committed: int = 30) -> dict[str, dict]:
    table = tg.targets_table([target], _validation(LOSSES, TOKENS), committed, price_per_device_hour=3.0)
    assert validate_tables_targets(table) == []
    return tg.outcome(table, target.name)


def validate_tables_targets(table: pd.DataFrame) -> list:
    from schemas.report_tables import SCHEMAS

    try:
        SCHEMAS["targets"].validate(table, lazy=True)
    except Exception as err:  # pandera SchemaErrors: list what failed
        return [str(err)]
    return []


def test_target_met_exactly_at_an_evaluation():
    rows = _rows(tg.Target("t", "x", "loss_nats", 5.5))
    assert set(rows) == {"before", "met"}
    met, before = rows["met"], rows["before"]
    assert (met["step"], met["value"], before["step"], before["value"]) == (20, 5.5, 10, 6.0)
    assert (met["exposure_tokens"], met["useful_tokens"], met["wall_seconds"]) == (2000, 1800, 200.0)
    assert met["device_hours"] == pytest.approx(400 / 3600) and met["cost_usd"] == pytest.approx(3 * 400 / 3600)


def test_target_met_between_evaluations_is_bracketed():
    rows = _rows(tg.Target("t", "x", "loss_nats", 5.3))
    assert (rows["before"]["step"], rows["met"]["step"], rows["met"]["value"]) == (20, 30, 5.2)
    first = _rows(tg.Target("t", "y", "loss_nats", 5.0))  # met at the first evaluation: no before
    assert set(first) == {"met"} and first["met"]["step"] == 10


def test_target_never_met_reports_the_best_value():
    rows = _rows(tg.Target("t", "y", "loss_nats", 3.0))
    assert set(rows) == {"best"} and (rows["best"]["step"], rows["best"]["value"]) == (20, 4.0)
    assert rows["best"]["met"] is False
    # evaluations past the lineage (work lost after the last checkpoint) never count
    assert _rows(tg.Target("t", "x", "loss_nats", 5.3), committed=20)["best"]["step"] == 20


def test_mean_target_is_weighted_by_validation_tokens():
    values = tg.metric_by_step(_validation(LOSSES, TOKENS), "mean", "loss_nats")
    assert values.loc[10] == pytest.approx((6.0 * 300 + 5.0 * 100) / 400)  # 5.75, not the plain mean 5.5
    rows = _rows(tg.Target("t", "mean", "loss_nats", 5.6))
    assert rows["met"]["step"] == 20 and rows["before"]["value"] == pytest.approx(5.75)
    bpb = _rows(tg.Target("t", "mean", "bpb", 2.5))
    assert bpb["met"]["step"] == 30 and bpb["met"]["value"] == pytest.approx((5.2 * 300 + 4.2 * 100) / 400 / 2)
    assert bpb["before"]["value"] == pytest.approx((5.5 * 300 + 4.0 * 100) / 400 / 2)  # 2.5625 > 2.5


# ---- a real run: learnable data so the loss falls at every evaluation --------------------------


def learnable_project(root: Path, **kw) -> Path:
    """trainfixtures.make_project with periodic token pools: a tiny model learns them within a few
    steps, so validation loss falls from one evaluation to the next."""
    exp = make_project(root, **kw)
    data = yaml.safe_load(exp.read_text())
    for d, pin in data["data"]["manifests"].items():
        mpath = Path(pin["path"])
        fields = json.loads(mpath.read_text())
        fields.pop("manifest_sha256")
        period = 7 if d == "a" else 11
        for shard in fields["shards"] + fields["validation_shards"]:
            path = mpath.parent / shard["path"]
            (np.arange(shard["tokens"]) % period * 37 + 5).astype(np.uint16).tofile(path)
            shard["sha256"] = sha256_file(path)
        pin["sha256"] = write_manifest(mpath, fields)
    exp.write_text(yaml.safe_dump(data, sort_keys=False))
    return exp


def _set_targets(path: Path, targets: dict, key: tuple[str, ...]) -> None:
    data = yaml.safe_load(path.read_text())
    node = data
    for k in key:
        node = node.setdefault(k, {})
    node["targets"] = targets
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _mlflow(tmp: Path, run_dir: Path) -> tuple[dict, dict]:
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow"]["run_id"]
    db = sqlite3.connect(tmp / "mlflow.db")
    latest = dict(db.execute("select key, value from latest_metrics where run_uuid=?", (run_id,)).fetchall())
    tags = dict(db.execute("select key, value from tags where run_uuid=?", (run_id,)).fetchall())
    db.close()
    return latest, tags


@pytest.mark.slow
def test_resume_across_a_target_counts_the_lost_work_and_restart(tmp_path):
    # 12 steps, evaluations every 3, checkpoints every 6: killed in step 11, the resume from step 6
    # redoes the evaluation at step 9 where the target is met: time-to-target is the redone one.
    exp = learnable_project(tmp_path, steps=12, eval_every=3, checkpoint_every=6, lr=1e-2)
    run = tmp_path / "runs" / "r"
    killed = launch(tmp_path, exp, "--run-dir", run, "--kill-at-step", 11, check=False)
    assert killed.returncode != 0
    first = {r["step"]: r for r in read_jsonl(run / "metrics" / "eval.jsonl") if r["domain"] == "a"}
    assert sorted(first) == [3, 6, 9] and first[9]["loss_nats"] < first[6]["loss_nats"] < first[3]["loss_nats"]
    # Targets are operational: declared in the run's experiment.yaml, the resume accepts them.
    _set_targets(
        run / "experiment.yaml",
        {"a-at-9": {"domain": "a", "loss_nats": first[9]["loss_nats"]}, "never": {"domain": "b", "loss_nats": 0.01}},
        ("eval",),
    )
    launch(tmp_path, run)

    rows = read_jsonl(run / "metrics" / "eval.jsonl")
    redone = [r for r in rows if r["step"] == 9 and r["domain"] == "a"]
    assert len(redone) == 2 and redone[1]["loss_nats"] == redone[0]["loss_nats"]  # bit-identical resume
    assert redone[1]["wall_seconds"] > redone[0]["wall_seconds"]
    journal = read_jsonl(run / "journal" / "processed.jsonl")
    attempt1_wall = max(e["wall_seconds"] for e in journal if e["attempt"] == 1)
    assert redone[1]["wall_seconds"] > attempt1_wall  # the crashed attempt's time is in it

    table = read_tables(run / "report")["targets"]
    met = table[(table["target"] == "a-at-9") & (table["point"] == "met")].iloc[0]
    assert (int(met["step"]), int(met["exposure_tokens"]), int(met["useful_tokens"])) == (9, 9 * 8 * 16, 9 * 8 * 16)
    assert met["wall_seconds"] == pytest.approx(redone[1]["wall_seconds"])
    assert met["device_hours"] == pytest.approx(redone[1]["device_wall_seconds"] / 3600)
    assert met["cost_usd"] == pytest.approx(met["device_hours"] * 0.1)
    never = table[table["target"] == "never"].iloc[0]
    assert never["point"] == "best" and int(never["step"]) == 12

    latest, tags = _mlflow(tmp_path, run)
    assert latest["target.a-at-9.time_to_target_seconds"] == pytest.approx(met["wall_seconds"])
    assert latest["target.a-at-9.step"] == 9 and latest["target.a-at-9.before.step"] == 6
    assert tags["target.a-at-9.met"] == "true" and tags["target.never.met"] == "false"
    assert latest["target.never.best_value"] == pytest.approx(float(never["value"]))
    result = audit(run)
    assert result.consistent, result.render()


@pytest.mark.slow
def test_targets_declared_at_launch_reach_mlflow_report_and_terminal(tmp_path):
    exp = learnable_project(tmp_path, steps=6, eval_every=2, checkpoint_every=6, lr=1e-2)
    _set_targets(
        tmp_path / "recipes/eval/e.yaml",
        {"loose": {"domain": "mean", "loss_nats": 50.0}, "tight": {"domain": "a", "bpb": 0.001}},
        (),
    )
    run = tmp_path / "runs" / "t"
    out = launch(tmp_path, exp, "--run-dir", run)
    assert "target `loose` (mean loss_nats <= 50): met at the first evaluation, step 2" in out.stdout
    assert "target `tight` (a bpb <= 0.001): NOT met; best" in out.stdout
    table = read_tables(run / "report")["targets"]
    loose = table[table["target"] == "loose"].iloc[0]
    latest, tags = _mlflow(tmp_path, run)
    assert latest["target.loose.time_to_target_seconds"] == pytest.approx(loose["wall_seconds"])
    assert latest["target.loose.cost_to_target_usd"] == pytest.approx(loose["cost_usd"])
    assert tags["target.loose.definition"] == "mean loss_nats <= 50"
    assert "## Quality targets" in (run / "report" / "report.md").read_text()


# ---- the audit recounts them --------------------------------------------------------------------


@pytest.fixture()
def reported(tmp_path):
    run = make_run(tmp_path)
    write_report(run)
    return run


def _tamper(report: Path, table: str, row: int, column: str, value) -> None:
    df = read_tables(report)[table]
    df.loc[row, column] = value
    df.to_parquet(report / f"{table}.parquet", index=False)
    df.to_csv(report / f"{table}.csv", index=False)


def _failed(result) -> dict[str, str]:
    return {c.name: c.detail for c in result.checks if c.status == "FAIL"}


def test_a_tampered_time_to_target_fails_the_audit(reported):
    report = reported / "report"
    assert audit(report, check_mlflow=False).consistent
    table = read_tables(report)["targets"]
    row = int(table.index[(table["target"] == "code-5") & (table["point"] == "met")][0])
    true_wall = float(table.loc[row, "wall_seconds"])
    _tamper(report, "targets", row, "wall_seconds", true_wall / 2)
    failed = _failed(audit(report, check_mlflow=False))
    assert failed["quality targets recounted from the evaluations"] == (
        f"code-5 met.wall_seconds: report {true_wall / 2!r}, recount {true_wall!r}"
    )
    # in a run folder the rebuilt tables disagree too
    assert "report matches the run folder" in _failed(audit(reported, check_mlflow=False))


def test_tampered_evaluation_times_fail_the_audit(reported):
    report = reported / "report"
    val = read_tables(report)["validation"]
    last = val["step"] == val["step"].max()
    val.loc[last, "wall_seconds"] = 1e6  # later than the whole run
    val.loc[last, "device_wall_seconds"] = 2e6
    val.to_parquet(report / "validation.parquet", index=False)
    val.to_csv(report / "validation.csv", index=False)
    failed = _failed(audit(report, check_mlflow=False))
    assert "after the run's" in failed["evaluation times and tokens within the run's"]
    assert "quality targets recounted from the evaluations" in failed  # the table no longer follows them


def test_old_eval_rows_stay_readable(tmp_path):
    run = make_run(tmp_path)
    path = run / "metrics" / "eval.jsonl"
    new = build_tables(run)
    rows = read_jsonl(path)
    path.write_text("".join(json.dumps({k: r[k] for k in r if k not in tg.PROGRESS_FIELDS}) + "\n" for r in rows))
    old = build_tables(run)
    assert validate_tables(old) == []
    # useful tokens come back exactly from train.jsonl; times are unknown, not made up
    assert list(old["validation"]["useful_tokens"]) == list(new["validation"]["useful_tokens"])
    assert old["validation"]["wall_seconds"].isna().all()
    met = old["targets"][old["targets"]["point"] == "met"]
    assert len(met) and met["wall_seconds"].isna().all() and met["cost_usd"].isna().all()
    write_report(run)
    assert "not recorded" in (run / "report" / "report.md").read_text()
    assert audit(run, check_mlflow=False).consistent


def test_the_report_section_names_every_target(reported):
    md = (reported / "report" / "report.md").read_text()
    assert "`code-5` (code loss_nats <= 5): met between step 3 (5.15) and step 6 (4.7)" in md
    assert "`math-first` (math loss_nats <= 5.3): met at the first evaluation, step 3 (5.25)" in md
    assert "`web-never` (web loss_nats <= 4): NOT met; best 4.9 at step 6" in md
    assert not math.isnan(read_tables(reported / "report")["targets"]["wall_seconds"].max())


def test_a_target_whose_every_evaluation_is_nan_has_no_rows_not_a_traceback():
    """A domain evaluated only to NaN (a diverged model's loss) made `runner report` and the audit stop
    on pandas' idxmin ('Encountered all NA values'); such a target has no best evaluation, so no rows.
    One number among the NaNs is still its best."""
    from runner.training.targets import Target, bracket

    rows = [
        {
            "step": s,
            "domain": "code",
            "loss_nats": math.nan,
            "bpb": math.nan,
            "tokens": 100,
            "exposure_tokens": 10 * s,
            "useful_tokens": 10 * s,
            "wall_seconds": 1.0 * s,
            "device_wall_seconds": 1.0 * s,
        }
        for s in (1, 2)
    ]
    target = Target("code-6", "code", "loss_nats", 6.0)
    assert bracket(target, pd.DataFrame(rows), 1.0) == []
    rows[1]["loss_nats"] = 7.0
    (best,) = bracket(target, pd.DataFrame(rows), 1.0)
    assert (best["point"], best["step"], best["met"], best["value"]) == ("best", 2, False, 7.0)


@pytest.mark.parametrize(
    "file, row, says",
    [
        ("eval.jsonl", {"step": "x", "domain": "code"}, 'step: line 1: must be a whole number >= 0, got "x"'),
        ("eval.jsonl", {"domain": "code", "loss_nats": 5.0}, "step: line 1: missing"),
        ("train.jsonl", {"step": 1, "loss": [1]}, "loss: line 1: must be a number, got [1]"),
    ],
)
def test_a_tracked_resume_reads_the_lineages_rows_checked_not_with_int(tmp_path, file, row, says):
    """A tracked resume judges the quality targets on the evaluations before its step, read back from
    metrics/: a row of another shape (a step as text, a row without its step) was int()'s ValueError or a
    KeyError at the launch's start, every attempt. One line naming the file, field and line, as the
    report's reader says it."""
    from runner.errors import RunnerError
    from runner.training.callbacks import TargetsCallback

    cfg = load_experiment(REPO / "experiments" / "cpu-tiny.yaml", check_files=False).config
    assert tg.declared_targets(cfg)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / file).write_text(json.dumps(row) + "\n")
    with pytest.raises(RunnerError) as err:
        TargetsCallback(None, cfg, tmp_path, start_step=6, enabled=True)
    assert str(err.value) == f"{tmp_path / 'metrics' / file}: {says}"
    (tmp_path / "metrics" / file).unlink()
    assert TargetsCallback(None, cfg, tmp_path, start_step=6, enabled=True).rows == {}  # a run not yet evaluated
