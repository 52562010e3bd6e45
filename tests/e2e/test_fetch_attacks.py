"""What an adversary tried on `runner fetch` and the records it writes (issue 27, items 2-4): a hostile
Hub listing that writes outside local_dir, symlinks, repo ids the Hub refuses, hand-edited fetch
records, a fetch killed part-way, and fetched files whose bytes changed since."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from fakehub import FakeHub
from hubfixtures import DATA_REPO, SHARDS, _downloads, _exp, serving_hub, use_hub

from runner.cli import main
from runner.config.data_recipes import repo_id_problem
from runner.data.fetch import fetch_experiment
from runner.data.fetch_record import journal_path
from runner.reports.pr_review import check_pr

RAW = Path("data/raw/tiny-fineweb")
RECORD = RAW / ".runner-fetch.json"


@pytest.fixture()
def hub(tmp_path: Path):
    with serving_hub(tmp_path) as server:
        yield server


@pytest.fixture()
def hub_project(project: Path, hub: FakeHub, monkeypatch) -> Path:
    return use_hub(project, hub, monkeypatch)


def _one_error(capsys, *argv: str) -> str:
    capsys.readouterr()
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


def _data_downloads(hub: FakeHub) -> list[str]:
    return [p for p, _ in _downloads(hub) if DATA_REPO in p]


# ---- item 2: a hostile listing writes nowhere ----------------------------------------------------


@pytest.mark.parametrize("kind", ["dot-dot", "absolute"])
def test_a_hostile_listing_is_refused_before_any_download(hub_project: Path, hub: FakeHub, capsys, kind):
    target = hub_project / "outside" / "x.parquet"  # in the project, outside local_dir
    if kind == "dot-dot":  # matched by the recipe's sample/10BT/*.parquet (fnmatch's * spans '/')
        hostile = "sample/10BT/../../../../../outside/x.parquet"
    else:  # matched by a pattern of the whole repository
        hostile = str(target)
        recipe = hub_project / "recipes/mixture/tiny-web.yaml"
        recipe.write_text(recipe.read_text().replace("files: [sample/10BT/*.parquet]", "files: ['*.parquet']"))
    assert (hub_project / RAW / hostile).resolve() == target.resolve()
    hub.hostile[hostile] = b"written where it was never asked"
    line = _one_error(capsys, "fetch", "experiments/tiny-hub.yaml")
    assert line.startswith("error: recipes/mixture/tiny-web.yaml: domains.web.source.files: ")
    assert f"{hostile!r} would land outside" in line and "refused" in line
    assert _data_downloads(hub) == [] and not target.exists()  # refused at the listing: nothing fetched
    assert not (hub_project / RECORD).exists()


def test_a_symlink_below_local_dir_is_refused_and_nothing_lands_through_it(hub_project: Path, hub: FakeHub, capsys):
    elsewhere = hub_project.parent / "elsewhere"
    elsewhere.mkdir()
    (hub_project / RAW).mkdir(parents=True)
    (hub_project / RAW / "sample").symlink_to(elsewhere)
    line = _one_error(capsys, "fetch", "experiments/tiny-hub.yaml")
    assert "data/raw/tiny-fineweb/sample is a symlink" in line and "refused" in line
    assert list(elsewhere.iterdir()) == [] and _data_downloads(hub) == []


def test_local_dir_itself_may_be_a_link_to_a_data_disk(hub_project: Path, hub: FakeHub):
    disk = hub_project.parent / "disk"
    disk.mkdir()
    (hub_project / RAW.parent).mkdir(parents=True)
    (hub_project / RAW).symlink_to(disk)
    fetch_experiment(_exp(hub_project), say=lambda _: None)
    assert (disk / SHARDS[0]).read_bytes() == hub.files[SHARDS[0]]


def test_a_relative_local_dir_leaving_the_project_needs_its_key_and_check_pr_names_it(hub_project: Path, capsys):
    recipe = hub_project / "recipes/mixture/tiny-web.yaml"
    text = recipe.read_text()
    recipe.write_text(text.replace("local_dir: data/raw/tiny-fineweb", "local_dir: data/../../raw"))
    line = _one_error(capsys, "validate", "experiments/tiny-hub.yaml")
    assert line == (
        "error: recipes/mixture/tiny-web.yaml: domains.web.source.local_dir: 'data/../../raw' leaves the project: "
        "give an absolute path (a data disk), or set local_dir_outside_project: true if that is meant"
    )
    recipe.write_text(text.replace("local_dir: data/raw/tiny-fineweb", f"local_dir: {hub_project.parent / 'raw'}"))
    assert main(["validate", "experiments/tiny-hub.yaml"]) == 0  # an absolute path is a data disk
    recipe.write_text(
        text.replace("local_dir: data/raw/tiny-fineweb", "local_dir: ../raw\n      local_dir_outside_project: true")
    )
    assert main(["validate", "experiments/tiny-hub.yaml"]) == 0
    for other in (hub_project / "experiments").rglob("*.yaml"):  # check-pr validates each: only this one
        if other.name != "tiny-hub.yaml":
            other.unlink()
    git = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=hub_project, check=True, env={**os.environ, **git})
    problems, report = check_pr("main", hub_project)
    assert (
        problems == []
        and (
            "warning: experiments/tiny-hub.yaml: mixture.domains.web.source.local_dir_outside_project: true: "
            "files land in '../raw', outside the project"
        )
        in report
    )


# ---- item 3: repo ids, hand-edited records --------------------------------------------------------


REPO_IDS = [
    "EleutherAI/gpt-neox-20b",
    "HuggingFaceFW/fineweb-edu",
    "a/b",
    "user_1/model.v2",
    "../x",
    "a/../b",
    "./x",
    "a/.b",
    "a/b-",
    "-a/b",
    "a--b/c",
    "a/b..c",
    "a/b.git",
    "a/" + "x" * 96,
    "a/" + "x" * 97,
    "a/b c",
    "a/b/c",
    "a/",
    "/b",
    "a/b%2e",
    "a/_b_",
]


def test_repo_ids_follow_the_hub_clients_rules():
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    for repo in REPO_IDS:
        try:
            validate_repo_id(repo)
            hub_ok = True
        except HFValidationError:
            hub_ok = False
        assert (repo_id_problem(repo) is None) == hub_ok, repo


def test_a_repo_id_the_hub_refuses_fails_at_validate(hub_project: Path, capsys):
    recipe = hub_project / "recipes/mixture/tiny-web.yaml"
    recipe.write_text(recipe.read_text().replace("repo: test-org/tiny-fineweb", 'repo: "../x"'))
    line = _one_error(capsys, "validate", "experiments/tiny-hub.yaml")
    assert line.startswith("error: recipes/mixture/tiny-web.yaml: domains.web.source.repo: '../x' must be a Hub")
    line = _one_error(capsys, "fetch", "experiments/tiny-hub.yaml")  # no HFValidationError traceback
    assert "domains.web.source.repo: '../x' must be a Hub" in line


RECORD_EDITS = [
    (lambda r: r.pop("commit"), "commit: missing"),
    (lambda r: r.update(files={"a": 1}), "files: must be a list, got dict"),
    (lambda r: r.update(patterns="x"), "patterns: must be a list, got str"),
    (lambda r: r.update(format="runner-fetch/9"), "format: 'runner-fetch/9' is not runner-fetch/1"),
    (lambda r: r["files"][1].pop("sha256"), "files[1].sha256: missing"),
    (lambda r: r["files"][0].update(size="12"), "files[0].size: must be an integer, got '12'"),
    (lambda r: r["files"][0].update(lfs="yes"), "files[0].lfs: must be a bool, got str"),
    (lambda r: r["files"][0].update(local="../../../etc/passwd"), "files[0].local: '../../../etc/passwd' is not where"),
    (lambda r: r["files"][0].update(path="../../x", local="../../x"), "files[0].path: '../../x' would land outside"),
    (lambda r: r.update(files=[]), "files: lists 0 files"),
]


@pytest.mark.slow  # 4-6 s: out of the fast subset (under 2 minutes)
def test_a_hand_edited_fetch_record_is_one_line_in_pin_and_prepare(hub_project: Path, capsys):
    fetch_experiment(_exp(hub_project), say=lambda _: None)
    assert main(["data", "prepare", "experiments/tiny-hub.yaml"]) == 0  # pin reads the record after the manifest
    path = hub_project / RECORD
    good = path.read_text()
    for n, (edit, says) in enumerate(RECORD_EDITS):
        record = json.loads(good)
        edit(record)
        path.write_text(json.dumps(record))
        commands = [["data", "prepare", "experiments/tiny-hub.yaml"]] + [["pin", "experiments/tiny-hub.yaml"]] * (n < 4)
        for argv in commands:  # one reader behind both: pin for the first few
            line = _one_error(capsys, *argv)
            assert line.startswith(f"error: {RECORD}: ") and says in line, (argv, line)
            assert "run `runner fetch` again" in line
    path.write_text("{not json")
    assert "not valid JSON" in _one_error(capsys, "data", "prepare", "experiments/tiny-hub.yaml")
    fetch_experiment(_exp(hub_project), say=lambda _: None)  # fetch rewrites it
    assert json.loads(path.read_text())["commit"]


# ---- item 4: recovery ------------------------------------------------------------------------------


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (not an Exception: no handler catches it)."""


def test_a_fetch_killed_part_way_resumes_after_the_last_verified_file(hub_project: Path, hub: FakeHub):
    files = {**hub.files, **{f"sample/10BT/{i:03d}_00000.parquet": os.urandom(3000 + i) for i in range(2, 6)}}
    hub.add_repo("dataset", DATA_REPO, files, lfs=True)
    shards = sorted(p for p in files if p.startswith("sample/10BT/"))  # 6 files

    def killed_at_the_fifth(line: str) -> None:
        if line.startswith("  [5/6]"):
            raise Killed

    with pytest.raises(Killed):
        fetch_experiment(_exp(hub_project), say=killed_at_the_fifth)
    journal = journal_path(hub_project / RECORD)
    assert [json.loads(line)["path"] for line in journal.read_text().splitlines()] == shards[:4]
    assert not (hub_project / RECORD).exists()  # not complete: prepare and pin still refuse
    assert main(["data", "prepare", "experiments/tiny-hub.yaml"]) == 2

    hub.requests.clear()
    said: list[str] = []
    fetch_experiment(_exp(hub_project), say=said.append)
    assert sorted({p.split("/resolve/")[1].split("/", 1)[1] for p in _data_downloads(hub)}) == shards[4:]
    assert sum("sample/10BT/" in line and "already here, verified at fetch" in line for line in said) == 4
    assert (
        not journal.exists() and [f["path"] for f in json.loads((hub_project / RECORD).read_text())["files"]] == shards
    )


@pytest.mark.slow  # 4-6 s: out of the fast subset (under 2 minutes)
def test_a_fetched_file_whose_bytes_changed_is_named_and_fetched_again(hub_project: Path, hub: FakeHub, capsys):
    fetch_experiment(_exp(hub_project), say=lambda _: None)
    shard = hub_project / RAW / SHARDS[0]
    os.utime(shard)  # touched, same bytes: hashed again, still the ones verified
    assert main(["data", "prepare", "experiments/tiny-hub.yaml"]) == 0
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    for argv in (["data", "prepare", "experiments/tiny-hub.yaml"], ["pin", "experiments/tiny-hub.yaml"]):
        line = _one_error(capsys, *argv)
        assert f"{RAW / SHARDS[0]} changed since `runner fetch` verified it" in line, line
        assert "run `runner fetch` again" in line
    hub.requests.clear()
    assert main(["fetch", "experiments/tiny-hub.yaml"]) == 0
    out = capsys.readouterr().err
    assert f"{SHARDS[0]}: changed since it was fetched" in out and "downloading it again" in out
    assert [p.rsplit("/", 3)[-3:] for p in _data_downloads(hub)] == [SHARDS[0].split("/")]
    assert shard.read_bytes() == hub.files[SHARDS[0]]
    # the advice ends: prepare then pin go through
    assert main(["data", "prepare", "experiments/tiny-hub.yaml"]) == 0
    assert main(["pin", "experiments/tiny-hub.yaml"]) == 0
