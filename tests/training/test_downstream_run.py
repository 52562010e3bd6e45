"""Downstream tasks in a run: scored in the loop at eval.downstream_interval_steps and at the end
(metrics/downstream.jsonl, per-request files, MLflow `downstream/<task>/<metric>`), and by
`runner eval` after the fact without touching the training lineage."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import yaml
from datafixtures import ARC, arc_easy_task
from trainfixtures import env, launch, make_project, run_in_process

from runner.fsio import read_jsonl, sha256_file

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def _with_tasks(root: Path, micro: int = 4, **eval_extra) -> Path:
    exp = make_project(root, steps=STEPS, seq_len=64, global_batch=4, micro=micro, checkpoint_every=2, eval_every=4)
    recipe = root / "recipes/eval/e.yaml"
    body = yaml.safe_load(recipe.read_text())
    body["tasks"] = {
        "builtin": {"format": "builtin", "limit": 4, "metrics": ["acc", "centered_acc", "bpb"]},
        "arc_easy": arc_easy_task(3, ["acc", "acc_per_char"]),
    }
    body.update(eval_extra)
    recipe.write_text(yaml.safe_dump(body))
    return exp


#: downstream quality targets (operational): met at the first scoring, and one judged by hand below
TASK_TARGETS = {
    "any": {"task": "aggregate", "metric": "mean_centered", "at_least": -1.0},
    "sure": {"task": "builtin", "metric": "acc", "at_least": 1.0},
}


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("downstream")
    exp = _with_tasks(tmp, downstream_interval_steps=2, downstream_micro_batch=5, targets=TASK_TARGETS)
    launch(tmp, exp, "--run-dir", tmp / "run")
    return tmp


def _lls(path: Path) -> dict[tuple, float]:
    with gzip.open(path, "rt") as f:
        return {(r["task"], r["doc_id"], r["choice"]): r["ll"] for r in map(json.loads, f)}


@pytest.mark.slow
def test_loop_scores_at_the_interval_and_the_end_and_tracks_it(scored_run):
    run = scored_run / "run"
    rows = read_jsonl(run / "metrics/downstream.jsonl")
    expected = {("builtin", m) for m in ("acc", "centered_acc", "bpb")} | {
        ("arc_easy", "acc"),
        ("arc_easy", "acc_per_char"),
    }
    expected |= {("aggregate", "mean_centered")}
    assert {(r["step"], r["task"], r["metric"]) for r in rows} == {(s, t, m) for s in (2, 4) for t, m in expected}
    for r in rows:
        assert r["t_eval_seconds"] > 0 and r["exposure_tokens"] == r["step"] * 4 * 64
        assert r["documents"] == {"builtin": 4, "arc_easy": 3, "aggregate": 7}[r["task"]]
    arc = next(r for r in rows if r["task"] == "arc_easy")
    record = json.loads(arc["convention"])
    assert (
        record["task_sha256"] == sha256_file(ARC / "requests.jsonl.gz") and record["limit"] == 3 and record["seed"] == 1
    )
    assert arc["random_baseline"] == pytest.approx(0.25)
    assert {r["random_baseline"] for r in rows if r["metric"] == "bpb"} == {None}  # an accuracy's; bpb has none
    agg = json.loads(next(r for r in rows if r["task"] == "aggregate")["convention"])
    assert agg["tasks"] == {"builtin": "centered_acc", "arc_easy": "centered_acc"}
    assert {t: r["limit"] for t, r in agg["task_records"].items()} == {"builtin": 4, "arc_easy": 3}
    lls = _lls(run / "downstream/requests-loop-step-0000004.jsonl.gz")
    assert len(lls) == 4 * 4 + 3 * 4 and all(v < 0 for v in lls.values())
    # training steps' own time excludes the scoring: train.jsonl is unchanged in shape
    assert [r["step"] for r in read_jsonl(run / "metrics/train.jsonl")] == list(range(1, STEPS + 1))

    from mlflow.tracking import MlflowClient

    info = json.loads((run / "run.json").read_text())
    client = MlflowClient(f"sqlite:///{scored_run / 'mlflow.db'}")
    history = client.get_metric_history(info["mlflow"]["run_id"], "downstream/arc_easy/acc")
    assert [h.step for h in history] == [2, 4]
    final = next(r for r in rows if r["step"] == 4 and r["task"] == "arc_easy" and r["metric"] == "acc")
    assert history[-1].value == pytest.approx(final["value"])
    tags = client.get_run(info["mlflow"]["run_id"]).data.tags
    assert json.loads(tags["downstream.arc_easy.acc.convention"]) == record


@pytest.mark.slow
def test_runner_eval_rescores_a_checkpoint_without_changing_the_lineage(scored_run):
    run = scored_run / "run"
    lineage = [run / "run.json", run / "ledger.json", *sorted((run / "checkpoints").rglob("*.*"))]
    before = {p: sha256_file(p) for p in lineage}
    train_rows = (run / "metrics/downstream.jsonl").read_text()
    proc = run_in_process(scored_run, ["eval", str(run)], env(scored_run))
    assert proc.returncode == 0, proc.stderr
    assert (
        "evidence: MLflow run " in proc.stdout and "evidence.runner_eval.step-0000004.downstream.sha256" in proc.stdout
    )
    assert {p: sha256_file(p) for p in lineage} == before
    assert (run / "metrics/downstream.jsonl").read_text() == train_rows
    record = json.loads((run / "downstream/eval-step-0000004.json").read_text())
    assert record["source"] == "runner eval" and record["checkpoint"] == "step-0000004"
    got = _lls(run / "downstream" / record["requests_file"])
    loop = _lls(run / "downstream/requests-loop-step-0000004.jsonl.gz")
    assert got.keys() == loop.keys()
    assert all(abs(got[k] - loop[k]) <= 1e-4 + 1e-6 * abs(loop[k]) for k in got)
    loop_rows = {
        (r["task"], r["metric"]): r["value"] for r in read_jsonl(run / "metrics/downstream.jsonl") if r["step"] == 4
    }
    assert {(r["task"], r["metric"]): r["value"] for r in record["rows"]}.keys() == loop_rows.keys()

    proc = run_in_process(
        scored_run,
        ["eval", str(run / "checkpoints/step-0000002"), "--tasks", "builtin", "--limit", "2"],
        env(scored_run),
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((run / "downstream/eval-step-0000002.json").read_text())["rows"]
    assert {r["task"] for r in rows} == {"builtin", "aggregate"}
    assert rows[0]["documents"] == 2 and json.loads(rows[0]["convention"])["limit"] == 2
    proc = run_in_process(
        scored_run, ["eval", str(run / "checkpoints/step-0000002"), "--tasks", "builtin"], env(scored_run)
    )
    assert proc.returncode == 0, proc.stderr
    again = json.loads((run / "downstream/eval-step-0000002-2.json").read_text())  # the first one is kept
    assert again["requests_file"] == "requests-eval-step-0000002-2.jsonl.gz" and again["rows"][0]["documents"] == 4
    assert not list((run / "downstream").glob(".eval-*.claim"))  # each claim released once its record is written

    from runner.reports.downstream.table import downstream_table

    table = downstream_table(run)
    assert set(table["source"]) == {"loop", "runner eval"}
    assert sorted(set(table.loc[table["source"] == "runner eval", "step"])) == [2, 4]
    assert len(table[table["source"] == "loop"]) == 2 * 6

    from runner.reports.audit.downstream import check_run

    assert check_run(run) == []

    proc = run_in_process(scored_run, ["eval", str(run), "--tasks", "hellaswag"], env(scored_run))
    assert proc.returncode == 2 and "no task hellaswag in the eval recipe (known: arc_easy, builtin)" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_in_process(scored_run, ["eval", str(run), "--tasks", ""], env(scored_run))
    assert (
        proc.returncode == 2
        and proc.stderr == "error: --tasks: names no task (''): give task names of the eval recipe, or builtin\n"
    )


@pytest.mark.slow
def test_audit_recomputes_every_figure_and_fails_a_forgery(scored_run, tmp_path):
    import shutil

    from runner.reports.audit.downstream import check_run
    from runner.reports.audit.run import audit

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run)
    assert check_run(run) == []
    statuses = {c.name: c.status for c in audit(run, check_mlflow=False).checks}
    assert statuses["report.md = its tables"] == statuses["plots = its tables"] == "PASS"  # sections, downstream.png
    passed = {name: status for name, status in statuses.items() if name.startswith("downstream")}
    assert passed == {
        "downstream table schema": "PASS",
        "downstream figures recomputed from per-request log-likelihoods": "PASS",
        "downstream table equals the recomputed figures": "PASS",
        "downstream scoring times and tokens within the run's": "PASS",
        "downstream targets recounted from the loop's scorings": "PASS",
    }
    rows = read_jsonl(run / "metrics/downstream.jsonl")
    forged = [
        dict(r, value=r["value"] + 0.25) if (r["step"], r["task"], r["metric"]) == (4, "builtin", "acc") else r
        for r in rows
    ]
    (run / "metrics/downstream.jsonl").write_text("".join(json.dumps(r) + "\n" for r in forged))
    problems = check_run(run)
    assert len(problems) == 1 and problems[0].startswith("loop step 4: builtin.acc: recorded")

    result = audit(run, check_mlflow=False)
    failed = [c for c in result.checks if c.name.startswith("downstream figures") and c.status == "FAIL"]
    assert failed and "builtin.acc" in failed[0].detail and result.verdict == "FAIL"
    # a consistent forgery (the accuracy, its centered form and the aggregate over it) still fails
    b = next(r["random_baseline"] for r in rows if r["task"] == "builtin")
    consistent = []
    for r in rows:
        if r["step"] == 4 and r["task"] == "builtin" and r["metric"] in ("acc", "centered_acc"):
            r = dict(r, value=r["value"] + (0.25 if r["metric"] == "acc" else 0.25 / (1 - b)))
        elif r["step"] == 4 and r["task"] == "aggregate":
            r = dict(r, value=r["value"] + 0.25 / (1 - b) / 2)
        consistent.append(r)
    (run / "metrics/downstream.jsonl").write_text("".join(json.dumps(r) + "\n" for r in consistent))
    flagged = {p.split(":")[1].strip() for p in check_run(run)}
    assert flagged == {"builtin.acc", "builtin.centered_acc", "aggregate"}
    (run / "downstream/requests-loop-step-0000002.jsonl.gz").unlink()
    assert any("loop step 2: no per-request file" in p for p in check_run(run))


@pytest.mark.slow
def test_a_refused_task_stops_the_run_after_its_first_step(tmp_path):
    exp = _with_tasks(tmp_path, downstream_interval_steps=1000)
    recipe = tmp_path / "recipes/eval/e.yaml"
    body = yaml.safe_load(recipe.read_text())
    body["tasks"]["arc_easy"]["sha256"] = "0" * 64
    recipe.write_text(yaml.safe_dump(body))
    proc = launch(tmp_path, exp, "--run-dir", tmp_path / "run", "--no-tracking", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "requests.jsonl.gz: eval.tasks.arc_easy.sha256: file sha256 is" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "run/run.json").read_text()).get("committed_steps", 0) <= 1


@pytest.mark.longest(1)
@pytest.mark.slow
def test_two_fsdp2_ranks_score_as_one_process(tmp_path):
    """Under FSDP2 every rank runs the same forwards (a short rank repeats one: 7 batches on 2 ranks),
    or the weights' all-gathers deadlock; the figures equal one process's."""
    import subprocess
    import sys

    from timeouts import SUBPROCESS_TIMEOUT_S

    roots = {"one": tmp_path / "one", "two": tmp_path / "two"}
    for name, root in roots.items():
        _with_tasks(root, micro=2, downstream_interval_steps=2, downstream_micro_batch=4)  # 28 requests: 7 batches
        if name == "two":
            hw = root / "recipes/hardware/cpu.yaml"
            hw.write_text(yaml.safe_dump({**yaml.safe_load(hw.read_text()), "distributed": "fsdp"}))
    launch(roots["one"], roots["one"] / "experiments/t.yaml", "--run-dir", "run", "--no-tracking")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "runner"]
        + ["launch", str(roots["two"] / "experiments/t.yaml"), "--run-dir", "run", "--no-tracking"],
        cwd=roots["two"],
        env=env(roots["two"]),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (read_jsonl(roots[n] / "run/metrics/downstream.jsonl") for n in ("one", "two"))
    assert [(r["step"], r["task"], r["metric"]) for r in a] == [(r["step"], r["task"], r["metric"]) for r in b]
    assert {r["forwards"] for r in b} == {4} and {r["forwards"] for r in a} == {7}
    for step in (2, 4):
        la = _lls(roots["one"] / f"run/downstream/requests-loop-step-{step:07d}.jsonl.gz")
        lb = _lls(roots["two"] / f"run/downstream/requests-loop-step-{step:07d}.jsonl.gz")
        assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) <= 1e-3 + 1e-5 * abs(la[k]) for k in la)


def test_runner_eval_refuses_what_is_no_run(tmp_path):
    proc = run_in_process(tmp_path, ["eval", str(tmp_path)], env(tmp_path))
    assert proc.returncode == 2 and "neither a run folder" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_in_process(tmp_path, ["eval", str(tmp_path), "--micro-batch", "0"], env(tmp_path))
    assert proc.returncode == 2 and "--micro-batch: must be >= 1" in proc.stderr


def test_downstream_keys_are_operational_and_checked(tmp_path):
    from runner.config.load import load_experiment

    exp = make_project(tmp_path, steps=STEPS, seq_len=64)
    plain = load_experiment(exp).fingerprint
    recipe = tmp_path / "recipes/eval/e.yaml"
    body = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump({**body, "downstream_interval_steps": 7, "downstream_micro_batch": 3}))
    assert load_experiment(exp).fingerprint == plain
    recipe.write_text(yaml.safe_dump({**body, "tasks": {"builtin": {"format": "builtin"}}, "aggregate": "none"}))
    assert load_experiment(exp).fingerprint == plain  # what is trained is the same; figures carry their record
    recipe.write_text(yaml.safe_dump({**body, "tasks": {"x": {"format": "mc", "limit": 0}}}))
    from runner.errors import RunnerError

    with pytest.raises(RunnerError, match=r"recipes/eval/e.yaml: tasks.x.path: a mc task pins its file") as e:
        load_experiment(exp)
    assert "e.yaml: tasks.x.limit: must be >= 1" in str(e.value)
    recipe.write_text(yaml.safe_dump({**body, "tasks": {"aggregate": {"format": "builtin"}}}))
    with pytest.raises(RunnerError, match=r"t.yaml: eval.tasks.aggregate: 'aggregate' names the figure over the tasks"):
        load_experiment(exp)


def test_downstream_table_schema_refuses_impossible_figures():
    import pandas as pd
    import pandera.errors

    from schemas.report_tables import DOWNSTREAM

    good = {
        "source": "loop",
        "step": 10,
        "exposure_tokens": 640,
        "task": "arc_easy",
        "metric": "acc",
        "value": 0.5,
        "documents": 3,
        "random_baseline": 0.25,
        "convention": json.dumps({"metric": "acc", "task_sha256": "0" * 64}),
        "t_eval_seconds": 0.1,
        "useful_tokens": 600,
        "wall_seconds": 12.5,
        "device_wall_seconds": 12.5,
    }
    DOWNSTREAM.validate(pd.DataFrame([good]))
    DOWNSTREAM.validate(pd.DataFrame([{**good, "wall_seconds": float("nan"), "device_wall_seconds": float("nan")}]))
    for bad in (
        {"value": 1.5},
        {"metric": "bpb", "value": -1.0},
        {"metric": "acc_norm"},
        {"documents": 0},
        {"source": "hand"},
        {"useful_tokens": -1},
        {"wall_seconds": -1.0},
    ):
        with pytest.raises(pandera.errors.SchemaError):
            DOWNSTREAM.validate(pd.DataFrame([{**good, **bad}]))


def _own_store(scored_run: Path, run: Path, tmp_path: Path) -> str:
    """A copy of the fixture's MLflow store for a copy of its run (run.json pointed at it): what a test
    logs (runner eval's evidence) stays in it. Returns its URI."""
    import shutil

    shutil.copy(scored_run / "mlflow.db", tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    info = json.loads((run / "run.json").read_text())
    info["mlflow"]["tracking_uri"] = uri
    (run / "run.json").write_text(json.dumps(info, indent=1))
    return uri


@pytest.mark.slow
def test_report_shows_the_downstream_table_and_audit_checks_it_against_the_requests(scored_run, tmp_path):
    import shutil

    import pandas as pd

    from runner.reports.audit.downstream import EVAL_FIGURES
    from runner.reports.audit.run import audit
    from runner.reports.audit.tracked import EVIDENCE
    from runner.reports.downstream.table import downstream_table

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run, ignore=shutil.ignore_patterns("*eval-step-*"))  # whatever ran before
    uri = _own_store(scored_run, run, tmp_path)
    environ = env(scored_run, MLFLOW_TRACKING_URI=uri)
    proc = run_in_process(scored_run, ["report", str(run)], environ)
    assert proc.returncode == 0, proc.stderr
    report = run / "report"
    table = pd.read_parquet(report / "downstream.parquet")
    pd.testing.assert_frame_equal(table, downstream_table(run), check_dtype=False)
    assert set(pd.read_csv(report / "downstream.csv")["task"]) == {"builtin", "arc_easy", "aggregate"}
    assert sorted(set(table.loc[table["source"] == "loop", "step"])) == [2, 4]
    md = (report / "report.md").read_text()
    section = md[md.index("## Downstream tasks") : md.index("## How fast")]
    final = table[(table["source"] == "loop") & (table["step"] == 4)]
    arc = final[(final["task"] == "arc_easy") & (final["metric"] == "acc")].iloc[0]
    assert f"| loop | 4 | {arc.exposure_tokens:,} | arc_easy | acc | {arc.value:.6g} | 3 | 0.25 |" in section
    bpb = final[final["metric"] == "bpb"].iloc[0]
    assert f"| builtin | bpb | {bpb.value:.6g} | 4 | none |" in section  # bpb has no random baseline
    assert json.loads(arc.convention)["task_sha256"] in section and "![downstream](downstream.png)" in section
    assert (report / "downstream.png").stat().st_size > 0  # two loop scorings: a curve

    checks = {c.name: c for c in audit(run, tracking_uri=uri).checks}
    for name in (
        "schema: downstream",
        "downstream table equals the recomputed figures",
        "report matches the run folder",
        EVIDENCE,
    ):
        assert checks[name].status == "PASS", checks[name]
    # a later `runner eval` is not yet in the report: noted, not failed (the report is rebuilt to show it)
    proc = run_in_process(scored_run, ["eval", str(run), "--tasks", "builtin", "--limit", "2"], environ)
    assert proc.returncode == 0, proc.stderr
    assert "vouches for the downstream table with this scoring" in proc.stdout, proc.stdout
    checks = {c.name: c for c in audit(run, tracking_uri=uri).checks}
    later = checks["downstream table equals the recomputed figures"]
    assert later.status == "PASS" and "runner eval figures scored after the report" in later.detail, later
    assert checks["report matches the run folder"].status == "PASS" and checks[EVIDENCE].status == "PASS"
    assert EVAL_FIGURES not in checks  # none in the report
    # runner eval, then runner report: MLflow's evidence vouches for the table with the scoring (runner
    # eval logged its hash), as for the loop's figures; without MLflow only a rescoring would
    proc = run_in_process(scored_run, ["report", str(run)], environ)
    assert proc.returncode == 0, proc.stderr
    result = audit(run, tracking_uri=uri)
    checks = {c.name: c for c in result.checks}
    assert result.failed() == [] and checks[EVIDENCE].status == "PASS", result.render()
    assert checks[EVAL_FIGURES].status == "INFO" and "logged to MLflow's evidence" in checks[EVAL_FIGURES].detail
    unvouched = next(c for c in audit(run, check_mlflow=False).checks if c.name == EVAL_FIGURES)
    assert unvouched.status == "UNVERIFIED" and "run `runner audit --recompute-eval`" in unvouched.detail
    assert unvouched.detail.startswith("4 figures of 1 runner eval scoring (step 4): only their arithmetic")
    # and the audited run exports: the card carries the final step's figures of both sources
    out = tmp_path / "exported"
    proc = run_in_process(scored_run, ["export", str(run), "--out", str(out), "--dtype", "fp32"], environ)
    assert proc.returncode == 0, proc.stderr
    card = (out / "README.md").read_text()
    assert "## Downstream tasks (step 4)" in card and "| runner eval | builtin | acc |" in card, card
    assert "| loop | arc_easy | acc |" in card
    # a forged table value (parquet and csv alike) fails against the figures the requests give, and
    # against MLflow's evidence
    forged = pd.read_parquet(report / "downstream.parquet")
    forged.loc[(forged["task"] == "arc_easy") & (forged["metric"] == "acc"), "value"] = 1.0
    forged.to_parquet(report / "downstream.parquet", index=False)
    forged.to_csv(report / "downstream.csv", index=False)
    result = audit(run, tracking_uri=uri)
    failed = {c.name: c.detail for c in result.checks if c.status == "FAIL"}
    assert (
        "loop step 4 arc_easy.acc: value 1.0 in the table" in failed["downstream table equals the recomputed figures"]
    )
    assert failed[EVIDENCE].startswith("table downstream: sha256 "), failed[EVIDENCE]
    assert re.search(r"\(nor any of the \d+ runner eval scorings' since\)$", failed[EVIDENCE]), failed[EVIDENCE]
    assert result.verdict == "FAIL"
    # a report without the table reads as older only where nothing says it had one: this run has tasks
    (report / "downstream.parquet").unlink()
    from runner.errors import RunnerError
    from runner.reports.tables import read_tables

    with pytest.raises(RunnerError, match="missing table"):
        read_tables(report)


def test_a_report_written_before_the_downstream_table_reads_it_as_empty(tmp_path):
    import shutil

    from runner.reports.tables import missing_report_files, predated_tables, read_tables

    published = REPO / "reports/cpu-tiny/20261201-crash-resume"
    assert not (published / "downstream.parquet").exists()
    report = tmp_path / "report"
    shutil.copytree(published, report)
    assert predated_tables(report) == ("downstream", "downstream_targets")
    tables = read_tables(report)
    assert tables["downstream"].empty and list(tables["downstream"].columns)[0] == "source"
    assert "downstream.parquet" not in missing_report_files(report, ["code", "legal", "prose"])
    evidence = json.loads((report / "evidence.json").read_text())
    evidence["tables"]["downstream"] = "0" * 64  # its evidence says it had one: the table is missing
    (report / "evidence.json").write_text(json.dumps(evidence))
    assert predated_tables(report) == ("downstream_targets",)
    assert "downstream.parquet" in missing_report_files(report, ["code", "legal", "prose"])


def _read_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _write_gz(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _refigure(rows: list[dict], got: dict) -> None:
    """Each figure row recomputed in place from `got` (task -> metric -> value), the centred ones and
    the aggregate as the scoring computes them."""
    from runner.reports.audit.downstream import _centered

    baselines = {r["task"]: r["random_baseline"] for r in rows if r["random_baseline"] is not None}
    for r in rows:
        if r["task"] == "aggregate":
            parts = json.loads(r["convention"])["tasks"].items()
            r["value"] = sum(_centered(got[t][m.removeprefix("centered_")], baselines[t]) for t, m in parts) / len(
                parts
            )
        elif r["metric"].startswith("centered_"):
            r["value"] = _centered(got[r["task"]][r["metric"].removeprefix("centered_")], r["random_baseline"])
        else:
            r["value"] = got[r["task"]][r["metric"]]


def _forge_eval_scoring(record_path: Path, edit) -> list[dict]:
    """What a careful forger does to a `runner eval` scoring: its request file edited (`edit(rows)`),
    then every figure of its record (centered forms and the aggregate too) recomputed from it with
    the audit's own arithmetic, so that the two files agree. Returns the edited request rows."""
    from runner.reports.audit.downstream import recompute

    record = json.loads(record_path.read_text())
    path = record_path.parent / record["requests_file"]
    requests = _read_gz(path)
    edit(requests)
    _write_gz(path, requests)
    got = recompute(requests)
    _refigure(record["rows"], got)
    record_path.write_text(json.dumps(record))
    return requests


@pytest.mark.slow
def test_recompute_eval_rescores_the_loop_and_runner_eval_requests_from_the_checkpoints(scored_run, tmp_path):
    import shutil

    from runner.reports.audit.downstream import EVAL_FIGURES, check_run
    from runner.reports.audit.evidence import write_report_with_evidence
    from runner.reports.audit.recompute_downstream import NAME, check_recomputed_downstream
    from runner.reports.audit.result import AuditResult
    from runner.reports.audit.run import audit, load_input
    from runner.training.downstream.posthoc import run_eval

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run, ignore=shutil.ignore_patterns("*eval-step-*"))  # whatever ran before
    record = run_eval(run, ["builtin"], limit=2, say=lambda *a: None)  # a runner eval scoring at step 4
    check = next(c for c in audit(run, check_mlflow=False, recompute_eval=True).checks if c.name == NAME)
    assert check.status == "PASS", check
    assert check.detail.startswith(
        "loop steps 2, 4; runner eval eval-step-0000004.json: every request record equal (gold, choices, tokens, "
        "characters), ll within 1e-4 + 1e-6 |ll|"
    ), check
    # one request's recorded log-likelihood moved by 1e-3: the rescoring names it
    path = run / "downstream/requests-loop-step-0000004.jsonl.gz"
    honest = path.read_bytes()
    rows = _read_gz(path)
    rows[5]["ll"] -= 1e-3
    _write_gz(path, rows)
    check = next(c for c in audit(run, check_mlflow=False, recompute_eval=True).checks if c.name == NAME)
    want = f"step 4: {rows[5]['task']} document {rows[5]['doc_id']} choice {rows[5]['choice']}: recorded ll"
    assert check.status == "FAIL" and want in check.detail
    path.write_bytes(honest)

    # A runner eval scoring forged consistently: one document's wrong choice made the likeliest (its ll
    # above the gold's), another request's token count changed; the record's figures recomputed from
    # the edited requests. Its arithmetic holds; its rescoring names both requests and the step.
    edited: dict[str, dict] = {}

    def edit(requests: list[dict]) -> None:
        wrong = edited["ll"] = next(r for r in requests if r["choice"] != r["gold"])
        gold = next(r for r in requests if r["doc_id"] == wrong["doc_id"] and r["choice"] == r["gold"])
        wrong["ll"] = gold["ll"] + 5.0
        requests[-1]["tokens"] += 1

    honest_eval = {f: f.read_bytes() for f in (record, run / "downstream/requests-eval-step-0000004.jsonl.gz")}
    forged = _forge_eval_scoring(record, edit)
    assert check_run(run) == []
    result = audit(run, check_mlflow=False, recompute_eval=True)
    check = next(c for c in result.checks if c.name == NAME)
    wrong = edited["ll"]
    where = "runner eval step 4 (eval-step-0000004.json): builtin document"
    assert check.status == "FAIL" and result.verdict == "FAIL", check
    assert f"{where} {wrong['doc_id']} choice {wrong['choice']}: recorded ll " in check.detail, check.detail
    last = forged[-1]
    assert (
        f"{where} {last['doc_id']} choice {last['choice']}: recorded tokens {last['tokens']}, rescored " in check.detail
    )
    # its request file cut short: a failed check naming the file, not a crash
    requests = run / "downstream/requests-eval-step-0000004.jsonl.gz"
    requests.write_bytes(requests.read_bytes()[:-20])
    res = AuditResult("x")
    check_recomputed_downstream(res, load_input(run))
    assert res.checks[0].status == "FAIL", res.checks
    assert "requests-eval-step-0000004.jsonl.gz: not a whole gzip jsonl file (EOFError" in res.checks[0].detail

    for f, data in honest_eval.items():
        f.write_bytes(data)
    write_report_with_evidence(run)  # the report shows the runner eval figures

    shutil.rmtree(run / "checkpoints/step-0000002")  # a pruned checkpoint is named, not failed
    checks = {c.name: c for c in audit(run, check_mlflow=False, recompute_eval=True).checks}
    assert checks[NAME].status == "PASS" and "; no checkpoint for loop step 2" in checks[NAME].detail
    assert EVAL_FIGURES not in checks  # rescored: nothing left to vouch for
    shutil.rmtree(run / "checkpoints/step-0000004")
    checks = {c.name: c for c in audit(run, check_mlflow=False, recompute_eval=True).checks}
    check = checks[NAME]
    assert check.status == "UNVERIFIED" and "no checkpoint that verifies at a scored step (2, 4)" in check.detail
    # runner eval figures neither rescored nor vouched for by MLflow: UNVERIFIED under --recompute-eval too
    assert checks[EVAL_FIGURES].status == "UNVERIFIED", checks[EVAL_FIGURES]


#: damaged per-request files (loop step 4's): the audit's line for each
DAMAGED = {
    "cut": (lambda b: b[:-20], "not a whole gzip jsonl file (EOFError"),
    "not gzip": (lambda b: gzip.decompress(b), "not a whole gzip jsonl file (BadGzipFile"),
    "not json": (lambda b: gzip.compress(b"{not json\n"), "line 1 is not JSON"),
    "no ll": (
        lambda b: gzip.compress(
            "".join(
                json.dumps({k: v for k, v in r.items() if k != "ll"}) + "\n"
                for r in map(json.loads, gzip.decompress(b).splitlines())
            ).encode()
        ),
        "line 1 lacks ll",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_request_file_is_a_failed_check_naming_it(scored_run, tmp_path, damage):
    import shutil

    from runner.reports.audit.downstream import NAME, audit_checks, check_run
    from runner.reports.audit.recompute_downstream import check_recomputed_downstream
    from runner.reports.audit.result import AuditResult
    from runner.reports.audit.run import load_input

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run, ignore=shutil.ignore_patterns("*eval-step-*"))
    path = run / "downstream/requests-loop-step-0000004.jsonl.gz"
    change, message = DAMAGED[damage]
    path.write_bytes(change(path.read_bytes()))
    want = f"loop step 4: {path}: {message}"
    assert any(want in p for p in check_run(run)), check_run(run)
    checks = {name: problems for name, problems, _ in audit_checks(run)}
    assert any(want in p for p in checks[NAME]), checks[NAME]
    res = AuditResult("x")
    check_recomputed_downstream(res, load_input(run))  # the rescoring reads it too
    assert res.checks[0].status == "FAIL" and f"step 4: {path}: {message}" in res.checks[0].detail, res.checks


@pytest.mark.slow
def test_a_malformed_downstream_row_or_record_is_one_line_naming_the_file_and_column(scored_run, tmp_path):
    import shutil

    from runner.errors import RunnerError
    from runner.reports.audit.run import audit
    from runner.reports.downstream.table import downstream_table

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run, ignore=shutil.ignore_patterns("*eval-step-*"))
    loop_file = run / "metrics/downstream.jsonl"
    honest = loop_file.read_text()
    rows = [json.loads(line) for line in honest.splitlines()]
    acc = next(i for i, r in enumerate(rows) if r["metric"] == "acc")
    for edit, message in (
        ({"value": "high"}, "value: not float64"),
        ({"value": 1.5}, "value: fails accuracies in [0, 1], centered <= 1, bpb > 0 (the row of step 2, task"),
        ({"documents": 0}, "documents: 0 fails greater_than_or_equal_to(1)"),
        ({"documents": 20.5}, "documents: not int64 (20.5 is not a whole number)"),  # astype read it as 20
        ({"exposure_tokens": True}, "exposure_tokens: not int64 (True is not a whole number)"),
        ({"value": "0.5"}, "value: not float64 ('0.5' is not a number)"),  # astype read it as 0.5
        ({"t_eval_seconds": True}, "t_eval_seconds: not float64 (True is not a number)"),
        ({"wall_seconds": "2"}, "wall_seconds and device_wall_seconds must be numbers, got '2'"),
        ({"random_baseline": None}, "random_baseline: fails a random baseline on every figure but bpb"),
        ({"convention": "{"}, "convention: fails the convention record names the metric"),
        ({"useful_tokens": "many"}, "useful_tokens must be an integer, got 'many'"),
        ({"step": "two"}, "step must be an integer and task, metric strings, got 'two'"),
    ):
        edited = [dict(r, **edit) if i == acc else r for i, r in enumerate(rows)]
        loop_file.write_text("".join(json.dumps(r) + "\n" for r in edited))
        with pytest.raises(RunnerError) as e:
            downstream_table(run)
        assert str(e.value).startswith(f"{loop_file}: ") and message in str(e.value), str(e.value)
        assert len(str(e.value).splitlines()) == 1
    # runner report: exit 2, one line; the audit: a failed check naming the file and column, no traceback
    proc = run_in_process(scored_run, ["report", str(run)], env(scored_run))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "step must be an integer" in proc.stderr
    result = audit(run, check_mlflow=False)
    schema = next(c for c in result.checks if c.name == "downstream table schema")
    assert schema.status == "FAIL" and "metrics/downstream.jsonl: row " in schema.detail, schema
    assert result.verdict == "FAIL"
    loop_file.write_text(honest)
    # a runner eval record whose rows are not figures, or whose request file is elsewhere
    record = run / "downstream/eval-step-0000004.json"
    for body, message in (
        ({"rows": [1], "requests_file": "requests-eval-step-0000004.jsonl.gz"}, "rows: must be a list of JSON objects"),
        ({"rows": [], "requests_file": "../../run.json"}, "requests_file: must name the per-request file beside it"),
        ([1, 2], "a runner eval record must be a JSON object"),
    ):
        record.write_text(
            json.dumps(body if isinstance(body, list) else {"step": 4, "checkpoint": "step-0000004", **body})
        )
        with pytest.raises(RunnerError, match=rf"eval-step-0000004.json: {re.escape(message)}"):
            downstream_table(run)
    # a record's figures: each at the record's step, a whole number (a step of text in a row older than
    # useful_tokens was int()'s traceback in runner report and the audit; 1.5 or true was read as step 1)
    row = {k: v for k, v in rows[acc].items() if k not in ("wall_seconds", "device_wall_seconds")}
    at, task, older = row["step"], row["task"], {k: v for k, v in row.items() if k != "useful_tokens"}
    record.unlink()
    record = run / f"downstream/eval-step-{at:07d}.json"
    for figure, message in (
        (dict(row, step=at + 0.5), f"got {at + 0.5}, '{task}', 'acc'"),
        (dict(older, step="x"), f"got 'x', '{task}', 'acc'"),
        (dict(row, step=True), f"got True, '{task}', 'acc'"),
        (dict(row, metric=None), f"got {at}, '{task}', None"),
        (dict(row, step=at + 1), f"figure 1 is at step {at + 1}, the record at step {at}"),
    ):
        body = {"step": at, "checkpoint": f"step-{at:07d}", "requests_file": f"requests-eval-step-{at:07d}.jsonl.gz"}
        record.write_text(json.dumps({**body, "rows": [figure]}))
        with pytest.raises(RunnerError) as e:
            downstream_table(run)
        assert str(e.value).startswith(f"{record}: rows: ") and message in str(e.value), str(e.value)
        proc = run_in_process(scored_run, ["report", str(run)], env(scored_run))
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and message in proc.stderr, proc.stderr


def _bracket_by_hand(rows: list[dict], task: str, metric: str, at_least: float) -> dict[str, int]:
    """point -> step: the first loop scoring at or above at_least and the one before, else the best."""
    values = {r["step"]: r["value"] for r in rows if (r["task"], r["metric"]) == (task, metric)}
    steps = sorted(values)
    met = [s for s in steps if values[s] >= at_least]
    if not met:
        return {"best": max(steps, key=lambda s: (values[s], -s))}
    before = [s for s in steps if s < met[0]]
    return {"met": met[0], **({"before": before[-1]} if before else {})}


@pytest.mark.slow
def test_downstream_targets_are_reported_recounted_and_a_forged_crossing_fails(scored_run, tmp_path):
    import shutil

    import pandas as pd

    from runner.reports.audit.run import audit

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run)
    proc = run_in_process(scored_run, ["report", str(run)], env(scored_run))
    assert proc.returncode == 0, proc.stderr
    report = run / "report"
    table = pd.read_parquet(report / "downstream_targets.parquet")
    price = float(pd.read_parquet(report / "run_summary.parquet")["price_per_device_hour"].iloc[0])
    rows = read_jsonl(run / "metrics/downstream.jsonl")
    stamps = {r["step"]: r for r in rows}  # every row of a scoring carries the same stamp
    run_json = json.loads((run / "run.json").read_text())
    for name, spec in TASK_TARGETS.items():
        got = table[table["target"] == name].set_index("point")
        want = _bracket_by_hand(rows, spec["task"], spec["metric"], spec["at_least"])
        assert {p: int(got.loc[p, "step"]) for p in got.index} == want, name
        for point, step in want.items():
            stamp = stamps[step]
            assert got.loc[point, "wall_seconds"] == stamp["wall_seconds"] <= run_json["wall_seconds"]
            assert got.loc[point, "useful_tokens"] == stamp["useful_tokens"] <= stamp["exposure_tokens"]
            assert got.loc[point, "device_hours"] == pytest.approx(stamp["device_wall_seconds"] / 3600)
            assert got.loc[point, "cost_usd"] == pytest.approx(stamp["device_wall_seconds"] / 3600 * price)
    assert _bracket_by_hand(rows, "aggregate", "mean_centered", -1.0) == {"met": 2}
    md = (report / "report.md").read_text()
    section = md[md.index("## Downstream targets") :]
    assert "`any` (aggregate mean_centered >= -1): met at the first evaluation, step 2" in section
    from runner.reports.targets import summary_lines  # what `runner launch` prints after a run

    assert [line.split(" (")[0] for line in summary_lines(report)] == ["`any`", "`sure`"]

    checks = {c.name: c for c in audit(run, check_mlflow=False).checks}
    for name in (
        "downstream targets recounted from the loop's scorings",
        "downstream scoring times and tokens within the run's",
    ):
        assert checks[name].status == "PASS", checks[name]

    def write(name: str, df: pd.DataFrame) -> None:
        df.to_parquet(report / f"{name}.parquet", index=False)
        df.to_csv(report / f"{name}.csv", index=False)

    # an edited figure: time-to-target halved
    edited = table.copy()
    edited.loc[edited["target"] == "any", "wall_seconds"] /= 2
    write("downstream_targets", edited)
    failed = {c.name: c.detail for c in audit(run, check_mlflow=False).checks if c.status == "FAIL"}
    assert "any met.wall_seconds: report" in failed["downstream targets recounted from the loop's scorings"]
    # a forged crossing, consistent across both tables: `sure` met at step 2 (builtin acc 1.0 there)
    scores = pd.read_parquet(report / "downstream.parquet")
    at = (
        (scores["source"] == "loop")
        & (scores["step"] == 2)
        & (scores["task"] == "builtin")
        & (scores["metric"] == "acc")
    )
    scores.loc[at, "value"] = 1.0
    write("downstream", scores)
    from runner.training.task_targets import TaskTarget, task_targets_table

    declared = [TaskTarget(n, s["task"], s["metric"], s["at_least"]) for n, s in sorted(TASK_TARGETS.items())]
    forged = task_targets_table(declared, scores, STEPS, price)
    assert forged[forged["target"] == "sure"]["point"].tolist() == ["met"]
    write("downstream_targets", forged)
    result = audit(run, check_mlflow=False)
    checks = {c.name: c for c in result.checks}
    assert checks["downstream targets recounted from the loop's scorings"].status == "PASS"  # consistent...
    assert (
        "loop step 2 builtin.acc: value 1.0 in the table"
        in checks["downstream table equals the recomputed figures"].detail
    )
    assert checks["report matches the run folder"].status == "FAIL" and result.verdict == "FAIL"


@pytest.mark.slow
def test_run_json_sums_evaluation_time_per_attempt_and_the_report_shows_it(tmp_path):
    """run.json's `t_eval` (records.EvalTimes): each attempt's validation and downstream seconds, and
    their sums over the run; the downstream seconds are the attempt's scorings' t_eval_seconds."""
    exp = _with_tasks(tmp_path, downstream_interval_steps=2)
    launch(tmp_path, exp, "--run-dir", tmp_path / "run", "--no-tracking", "--max-steps", "2")
    first = json.loads((tmp_path / "run/run.json").read_text())["t_eval"]
    assert [a["attempt"] for a in first["attempts"]] == [1]
    launch(tmp_path, tmp_path / "run", "--no-tracking")  # resumed at step 2: attempt 2 scores step 4
    info = json.loads((tmp_path / "run/run.json").read_text())
    t = info["t_eval"]
    assert [a["attempt"] for a in t["attempts"]] == [1, 2] and t["attempts"][0] == first["attempts"][0]
    rows = read_jsonl(tmp_path / "run/metrics/downstream.jsonl")
    scorings = {r["step"]: r["t_eval_seconds"] for r in rows}  # one t_eval per scoring, on each of its rows
    assert sorted(scorings) == [2, 4]
    assert t["attempts"][0]["downstream_seconds"] == pytest.approx(scorings[2], abs=2e-6)
    assert t["attempts"][1]["downstream_seconds"] == pytest.approx(scorings[4], abs=2e-6)
    for key in ("validation_seconds", "downstream_seconds", "downstream_prepare_seconds"):
        assert t[key] == pytest.approx(sum(a[key] for a in t["attempts"]), abs=2e-6)
    # each attempt evaluated validation at its last step (2, then 4)
    assert sorted({r["step"] for r in read_jsonl(tmp_path / "run/metrics/eval.jsonl")}) == [2, 4]
    assert all(a["validation_seconds"] > 0 for a in t["attempts"])
    assert all(a["downstream_prepare_seconds"] > 0 for a in t["attempts"])  # tasks prepared once per attempt
    assert t["validation_seconds"] + t["downstream_seconds"] < info["wall_seconds"]
    proc = run_in_process(tmp_path, ["report", str(tmp_path / "run")], env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "run/report/report.md").read_text()
    assert (
        f"- Evaluation (t_eval, never step time; run.json `t_eval`): validation {t['validation_seconds']:.1f} s, "
        f"downstream scoring {t['downstream_seconds']:.1f} s" in md
    )


def _forge_loop_scoring(run: Path, step: int, edit) -> None:
    """A loop scoring forged consistently: its request file edited (`edit(rows)`), then every figure
    of that step in metrics/downstream.jsonl recomputed from it with the audit's own arithmetic."""
    from runner.reports.audit.downstream import recompute

    path = run / f"downstream/requests-loop-step-{step:07d}.jsonl.gz"
    requests = _read_gz(path)
    edit(requests)
    _write_gz(path, requests)
    got = recompute(requests)
    loop_file = run / "metrics/downstream.jsonl"
    rows = read_jsonl(loop_file)
    _refigure([r for r in rows if r["step"] == step], got)
    loop_file.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _gold_likeliest(task: str):
    def edit(requests: list[dict]) -> None:
        for r in requests:
            if r["task"] == task and r["choice"] == r["gold"]:
                r["ll"] = max(q["ll"] for q in requests if q["task"] == task and q["doc_id"] == r["doc_id"]) + 1.0

    return edit


@pytest.mark.slow
def test_forged_downstream_figures_and_stamps_fail_after_an_honest_extension(scored_run, tmp_path):
    """Issue 37 items 1 and 2: a loop scoring forged consistently (its checkpoint pruned), every loop
    row's wall and device seconds halved, two runner eval scorings forged consistently (one checkpoint
    kept, one pruned), then one honest extension segment, whose end rebuilds the report and logs evidence over the
    forged files: the audit compares MLflow's downstream history, logged at each scoring's step
    before the extension, with the report, and FAILs naming each figure, with and without
    --recompute-eval."""
    import shutil

    from runner.reports.audit.run import audit
    from runner.reports.audit.tracked import METRICS

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run, ignore=shutil.ignore_patterns("*eval-step-*"))
    uri = _own_store(scored_run, run, tmp_path)
    environ = env(scored_run, MLFLOW_TRACKING_URI=uri)
    for target in (run, run / "checkpoints/step-0000002"):  # runner eval scorings at steps 4 and 2
        proc = run_in_process(scored_run, ["eval", str(target), "--tasks", "builtin", "--limit", "2"], environ)
        assert proc.returncode == 0, proc.stderr
    proc = run_in_process(scored_run, ["report", str(run)], environ)
    assert proc.returncode == 0, proc.stderr
    honest = audit(run, tracking_uri=uri)
    metrics = next(c for c in honest.checks if c.name == METRICS)
    assert honest.failed() == [] and metrics.status == "PASS", honest.render()
    assert "downstream/" not in metrics.detail.split("no report counterpart:")[1], metrics.detail
    assert "runner_eval/" not in metrics.detail.split("no report counterpart:")[1], metrics.detail

    true_acc = next(
        r["value"]
        for r in read_jsonl(run / "metrics/downstream.jsonl")
        if (r["step"], r["task"], r["metric"]) == (2, "builtin", "acc")
    )
    _forge_loop_scoring(run, 2, _gold_likeliest("builtin"))
    loop_file = run / "metrics/downstream.jsonl"
    rows = read_jsonl(loop_file)
    assert next(r for r in rows if (r["step"], r["task"], r["metric"]) == (2, "builtin", "acc"))["value"] == 1.0
    for r in rows:
        r["wall_seconds"] /= 2
        r["device_wall_seconds"] /= 2
    loop_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _forge_eval_scoring(run / "downstream/eval-step-0000004.json", _gold_likeliest("builtin"))  # checkpoint kept
    _forge_eval_scoring(run / "downstream/eval-step-0000002.json", _gold_likeliest("builtin"))  # checkpoint pruned
    shutil.rmtree(run / "checkpoints/step-0000002")  # pruned, as keep_last prunes it
    launch(scored_run, run, "--extend-to", (STEPS + 1) * 4 * 64, MLFLOW_TRACKING_URI=uri)

    for recompute in (False, True):
        result = audit(run, tracking_uri=uri, recompute_eval=recompute)
        failed = next(c for c in result.checks if c.name == METRICS)
        assert result.verdict == "FAIL" and failed.status == "FAIL", result.render()
        assert "downstream/aggregate/mean_centered at step 2: MLflow " in failed.detail, failed.detail
    # every problem (the check shows the first few)
    from runner.reports.audit.downstream_tracked import compare
    from runner.reports.audit.tracked import _read_run
    from runner.reports.tables import read_tables

    tracked = _read_run(uri, json.loads((run / "run.json").read_text())["mlflow"]["run_id"])
    problems = "; ".join(compare(tracked.history, read_tables(run / "report")["downstream"], STEPS + 1)[0])
    assert f"downstream/builtin/acc at step 2: MLflow {true_acc:.10g}, report 1;" in problems, problems
    assert "downstream/wall_seconds at step 2: MLflow " in problems
    assert "downstream/device_wall_seconds at step 4: MLflow " in problems
    assert "runner_eval/builtin/acc at step 4: MLflow " in problems
    assert "runner_eval/builtin/bpb at step 2: MLflow " in problems  # the gold's ll raised: bpb always moves
    assert "step 5" not in problems  # the extension's own scoring is honest


@pytest.mark.slow
def test_every_figures_exposure_is_its_steps_whole_batches_runner_eval_and_loop_alike(scored_run, tmp_path):
    """A `runner eval` figure's exposure and useful tokens were not checked at all (exposure 100 at
    step 12 passed the audit, --recompute-eval included, and showed in the report), and the loop's
    were read one row per step (a second row of a step could say anything). Each figure's exposure
    is its step's whole batches, its useful tokens at most that."""
    import shutil

    from runner.reports.audit.run import audit
    from runner.reports.downstream.targets import TIMELINE

    run = tmp_path / "run"
    shutil.copytree(scored_run / "run", run, ignore=shutil.ignore_patterns("*eval-step-*"))
    environ = env(scored_run)
    proc = run_in_process(scored_run, ["eval", str(run), "--tasks", "builtin", "--limit", "2"], environ)
    assert proc.returncode == 0, proc.stderr

    def timeline() -> object:
        proc = run_in_process(scored_run, ["report", str(run)], environ)
        assert proc.returncode == 0, proc.stderr
        return next(c for c in audit(run, check_mlflow=False).checks if c.name == TIMELINE)

    honest = timeline()
    assert honest.status == "PASS" and honest.detail == "2 loop scorings, 1 runner eval step", honest
    record = run / "downstream/eval-step-0000004.json"
    body = json.loads(record.read_text())
    batch = body["rows"][0]["exposure_tokens"] // 4
    for r in body["rows"]:  # stamped as if scored at step 2: a plausible count, not step 4's
        r["exposure_tokens"], r["useful_tokens"] = 2 * batch, 2 * batch
    record.write_text(json.dumps(body))
    forged = timeline()
    assert forged.status == "FAIL" and f"runner eval step 4: exposure {2 * batch:,} != 4 x {batch:,}" in forged.detail
    body["rows"][0].update(exposure_tokens=4 * batch, useful_tokens=4 * batch + 1)
    body["rows"][1:] = []
    record.write_text(json.dumps(body))
    assert "runner eval step 4: useful " in timeline().detail
    record.unlink()
    loop_file = run / "metrics/downstream.jsonl"
    rows = read_jsonl(loop_file)
    last = max(i for i, r in enumerate(rows) if r["step"] == 4)  # not the step's first row
    rows[last]["exposure_tokens"] = 3 * batch
    rows[last]["device_wall_seconds"] = 1e300  # the timeline read the step's first row (after sorting) only
    rows[last]["t_eval_seconds"] = rows[last]["wall_seconds"] + 1  # a scoring longer than the run so far
    loop_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    forged = timeline()
    assert forged.status == "FAIL" and f"loop step 4: exposure {3 * batch:,} != 4 x {batch:,}" in forged.detail
    assert "loop step 4: a figure's device_wall_seconds 1e+300 is after the run's " in forged.detail, forged
    assert "loop step 4: t_eval_seconds " in forged.detail and " is longer than the run had run when" in forged.detail


def test_two_scorings_of_one_step_at_once_take_two_stems(tmp_path):
    """Two `runner eval` of one step found the same free stem (the record is written after minutes of
    scoring), and the later one replaced the earlier's record and requests. A stem is claimed
    exclusively until its record is written; a claim left by a killed scoring only skips its stem."""
    from runner.training.downstream.posthoc import _claim_stem, _release

    out = tmp_path / "downstream"
    first, second = _claim_stem(out, 4), _claim_stem(out, 4)  # both scoring, neither written yet
    assert (first, second) == ("step-0000004", "step-0000004-2")
    (out / f"eval-{first}.json").write_text("{}")
    _release(out, first)
    assert _claim_stem(out, 4) == "step-0000004-3"  # the second still holds -2
    _release(out, second)  # failed before writing (run_eval releases in `finally`): the stem is free again
    assert _claim_stem(out, 4) == "step-0000004-2"
    (out / ".eval-step-0000007.claim").touch()  # left by a scoring killed mid-write
    assert _claim_stem(out, 7) == "step-0000007-2"
