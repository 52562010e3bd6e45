"""The README's main job, as a new user runs it: built-in data, the CPU experiment, MLflow, report,
audit, publish; and the reports the repository ships, audited as CI does."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]


# The console script, as a user types it (`python -m runner` would import the project copy's
# runner/ folder, which holds only the tokenizer, from the current directory).
RUNNER = shutil.which("runner", path=str(Path(sys.executable).parent)) or shutil.which("runner") or "runner"


def runner(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RUNNER, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=SUBPROCESS_TIMEOUT_S,
    )


@pytest.mark.slow
def test_readme_main_job_end_to_end(tmp_path: Path):
    project = tmp_path / "project"
    for folder in ("recipes", "experiments"):
        shutil.copytree(REPO / folder, project / folder)
    tok = project / "runner/builtin/assets/tokenizer.json"
    tok.parent.mkdir(parents=True)
    shutil.copy(REPO / "runner/builtin/assets/tokenizer.json", tok)
    env = {"MLFLOW_TRACKING_URI": ""}  # MLflow's own default: sqlite:///mlflow.db here

    out = runner(project, "data", "builtin")
    assert out.returncode == 0, out.stderr
    out = runner(project, "launch", "experiments/cpu-tiny.yaml", "--run-name", "demo", env=env)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert (
        "warning: experiments/cpu-tiny.yaml: data.manifests.legal: domain 'legal' is validated on 2 samples"
        in out.stderr
    )
    run_dir = project / "runs/cpu-tiny/demo"
    assert "tokens: processed 307,200  exposure 307,200  useful 307,200" in out.stdout

    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["committed_steps"] == 150
    assert info["conventions"]["peak_source"].startswith("theoretical: ")  # stable, unlike a matmul burst
    ledger = json.loads((run_dir / "ledger.json").read_text())["counters"]
    assert {d: c["exposure"] for d, c in ledger.items()} == {
        "code": 153_600,
        "prose": 122_880,
        "legal": 30_720,
        "total": 307_200,
    }
    assert ledger["legal"]["unique"] == ledger["legal"]["pool"]  # the small domain is repeated: every sample seen
    for name in ("report.md", "accounting.parquet", "accounting.csv", "validation.parquet", "loss_by_domain.png"):
        assert (run_dir / "report" / name).stat().st_size > 0

    db = project / "mlflow.db"
    con = sqlite3.connect(db)
    metrics = dict(con.execute("select key, count(*) from metrics group by key").fetchall())
    tags = dict(con.execute("select key, value from tags").fetchall())
    artifacts_logged = con.execute("select artifact_uri from runs").fetchone()[0]
    con.close()
    assert metrics["loss"] == 150 // 10  # train.log_interval_steps: 10
    assert {"val_loss.code", "val_bpb.legal", "tokens.total.unique", "realized_ratio.prose", "mfu"} <= set(metrics)
    assert tags["fingerprint"] == info["fingerprint"] and tags["recipe.model"] == "llama-tiny@1"
    assert artifacts_logged

    out = runner(project, "audit", str(run_dir), "--require-verified", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MLflow metrics = the report" in out.stdout and "\nPASS: " in out.stdout and "0 failed" in out.stdout
    # By MLflow run id, from the default store launch wrote to; elsewhere, one line and no empty store.
    out = runner(project, "audit", info["mlflow"]["run_id"], env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = runner(elsewhere, "audit", info["mlflow"]["run_id"], env=env)
    assert out.returncode == 2 and out.stderr.startswith("error: no MLflow store at ") and "Traceback" not in out.stderr
    assert not (elsewhere / "mlflow.db").exists()

    out = runner(project, "publish", str(run_dir), "--reports-dir", str(project / "reports"), env=env)
    assert out.returncode == 0, out.stderr
    index = (project / "reports/README.md").read_text()
    assert "| cpu-tiny | 2 | [demo]" in index
    assert runner(project, "audit-reports", "--reports-dir", str(project / "reports")).returncode == 0


@pytest.mark.slow
def test_published_reports_in_the_repository_pass_the_audit():
    published = [p for p in (REPO / "reports").glob("*/*/run_summary.csv")]
    assert published, "the repository ships at least the CPU experiment's report"
    out = runner(REPO, "audit-reports", "--reports-dir", str(REPO / "reports"), env={"MLFLOW_TRACKING_URI": ""})
    # Without the MLflow store that holds their runs (CI has none) published reports are consistent
    # but UNVERIFIED (exit 5), and only the MLflow checks may be what is not verified.
    assert out.returncode in (0, 5), out.stdout + out.stderr
    for line in out.stdout.splitlines():
        if line.startswith("UNVERIFIED "):
            assert line.split("not verified: ")[1].split(", ") == [
                "MLflow run reachable",
                "MLflow params = experiment.yaml",
                "MLflow tags = the run's record",
                "MLflow metrics = the report",
                "MLflow evidence = the report",
            ], line


def _truncate_a_shard(project: Path) -> None:
    shard = sorted((project / "data/builtin/code").glob("train-*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])


def _unpin(project: Path, key: str) -> None:
    path = project / "experiments/cpu-tiny.yaml"
    import yaml

    data = yaml.safe_load(path.read_text())
    node = data
    *head, last = key.split(".")
    for k in head:
        node = node[k]
    node[last] = None
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _retokenized(project: Path) -> None:
    import yaml

    from runner.data.manifest import write_manifest

    mpath = project / "data/builtin/legal/manifest.json"
    fields = json.loads(mpath.read_text())
    fields["tokenizer_sha256"] = "cd" * 32
    sha = write_manifest(mpath, fields)
    path = project / "experiments/cpu-tiny.yaml"
    data = yaml.safe_load(path.read_text())
    data["data"]["manifests"]["legal"]["sha256"] = sha
    path.write_text(yaml.safe_dump(data, sort_keys=False))


LAUNCH_REFUSALS = [
    (_truncate_a_shard, "data/builtin/code/train-00000.bin"),
    (
        lambda p: _unpin(p, "data.manifests.prose.sha256"),
        "experiments/cpu-tiny.yaml: data.manifests.prose.sha256: not pinned",
    ),
    (
        _retokenized,
        "experiments/cpu-tiny.yaml: data.manifests.legal: data/builtin/legal/manifest.json was tokenized with tokenizer cdcdcdcdcdcd",
    ),
]


@pytest.mark.slow
def test_launch_refuses_bad_data_before_writing_anything(project_with_data: Path):
    import shutil as _sh

    pristine = project_with_data.parent / "pristine"
    _sh.copytree(project_with_data, pristine)
    for break_it, expected in LAUNCH_REFUSALS:
        _sh.rmtree(project_with_data)
        _sh.copytree(pristine, project_with_data)
        break_it(project_with_data)
        out = runner(project_with_data, "launch", "experiments/cpu-tiny.yaml", "--no-tracking")
        assert out.returncode == 2, (expected, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr
        assert expected in out.stderr, out.stderr
        assert not (project_with_data / "runs").exists()
