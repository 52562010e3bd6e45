"""`runner publish`: a published run.json carries no machine paths, and still passes the audit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runfixtures import make_run

from runner.errors import RunnerError
from runner.reports.audit.evidence import write_report_with_evidence
from runner.reports.audit.run import audit
from runner.reports.publish import portable, publish


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


@pytest.mark.slow
def test_published_run_json_has_paths_relative_to_the_project_or_none(tmp_path):
    root = tmp_path / "project"
    run = make_run(root)
    info = json.loads((run / "run.json").read_text())
    home = str(Path.home())
    info.update(
        project_root=str(root),
        experiment_file=str(root / "experiments" / "fixture.yaml"),
        mlflow={"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment_id": "1", "run_id": "a" * 32},
        notes=f"prepared in {home}/data on the login node",
        elsewhere=str(tmp_path / "scratch" / "run"),
    )
    (run / "run.json").write_text(json.dumps(info))
    write_report_with_evidence(run)
    dest, result = publish(run, root / "reports")
    assert result.consistent, result.render()  # UNVERIFIED: the fixture names an MLflow run no store holds
    published = json.loads((dest / "run.json").read_text())
    assert published["project_root"] == "."
    assert published["experiment_file"] == "experiments/fixture.yaml"
    assert published["mlflow"] == {"tracking_uri": "sqlite:///mlflow.db", "experiment_id": "1", "run_id": "a" * 32}
    assert published["notes"] == "prepared in ~/data on the login node"
    assert published["elsewhere"] is None  # outside the project: no relative form, removed
    assert set(published) == set(info)  # every field a reader knew is still there
    for text in _strings(published):
        assert not text.startswith("/") and ":///" + "/" not in text and "file:///" not in text, text
        assert home not in text, text
    # The published copy alone is consistent under the audit, and opening its store creates nothing.
    listing = sorted(root.rglob("*"))
    again = audit(dest)
    assert again.consistent, again.render()
    assert sorted(root.rglob("*")) == listing
    # The run folder itself keeps its machine paths: resumes need them.
    assert json.loads((run / "run.json").read_text())["project_root"] == str(root)


def test_portable_leaves_servers_and_plain_text_alone(tmp_path):
    value = {"a": ["http://mlflow.internal:5000", "6N+attn", 3, None], "b": {"c": "theoretical: 2 cores x 2.4 GHz"}}
    assert portable(value, tmp_path) == value


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_publish_never_replaces_the_run_or_what_is_not_a_published_copy(tmp_path):
    """publish replaces reports/<experiment>/<run_id>/ whole and rewrites the index: `--reports-dir runs`
    replaced the run folder itself by its report (checkpoints, ledger gone), `--reports-dir .` would
    rewrite the project's README.md. Each is refused in one line before anything is written; a republish
    into the real reports folder replaces the earlier copy."""
    root = tmp_path / "project"
    run = make_run(root)  # root/runs/<experiment>/<run_id>
    write_report_with_evidence(run)
    (root / "README.md").write_text("# My project\n")
    taken = root / "elsewhere" / run.parent.name / run.name
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("mine")
    before = {p: _tree(p) for p in (run, root / "elsewhere")}
    for reports_dir, words in (
        (run.parent.parent, "is inside or around the run folder"),
        (run, "is inside or around the run folder"),
        (root, "README.md is not a published-runs index"),
        (root / "elsewhere", "exists and is not a published copy"),
        (root / "README.md" / "reports", "README.md is a file, not a folder"),  # was `Not a directory`, no flag
    ):
        with pytest.raises(RunnerError, match=words) as e:
            publish(run, reports_dir)
        assert str(e.value).startswith("--reports-dir: "), e.value
    assert {p: _tree(p) for p in (run, root / "elsewhere")} == before
    assert (root / "README.md").read_text() == "# My project\n"
    first, _ = publish(run, root / "reports")
    again, _ = publish(run, root / "reports")
    assert first == again and (again / "run_summary.parquet").is_file()


@pytest.mark.parametrize("key", ["run_id", "experiment"])
def test_a_run_json_naming_a_path_is_refused_before_anything_is_published(tmp_path, key):
    """publish makes reports/<experiment>/<run_id>/ of the run's record: a forged run.json whose run_id was
    `../../../escaped` published the report to a folder beside the project, outside reports/ (the audit of a
    --no-tracking run has nothing that vouches for run.json's names). A run.json's run_id and experiment
    are names, or the run folder is refused in one line by every verb that reads it."""
    root = tmp_path / "project"
    run = make_run(root)
    record = json.loads((run / "run.json").read_text())
    record[key] = "../../../escaped"
    (run / "run.json").write_text(json.dumps(record))
    for verb in (lambda: publish(run, root / "reports"), lambda: audit(run)):
        with pytest.raises(RunnerError, match=rf"run.json: {key}: '../../../escaped' is not a name"):
            verb()
    assert not (root / "reports").exists() and not list(tmp_path.rglob("escaped"))
