"""`runner check-pr --markdown`: what a recipe pull request changes and costs, for the job summary."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from runner.cli import main
from runner.config.load import load_experiment
from runner.planning.plan import build_plan


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _edit(path: Path, **changes) -> None:
    data = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        node = data
        *head, last = dotted.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture()
def repo(project_with_data: Path) -> Path:
    """The repository's recipes and experiments, committed in a fresh git repo (data ignored)."""
    repo = project_with_data
    (repo / ".gitignore").write_text("data/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "base")
    return repo


def _review(repo: Path, monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.chdir(repo)
    code = main(["check-pr", "--base", "HEAD", "--markdown", "review/summary.md"])
    capsys.readouterr()
    return code, (repo / "review" / "summary.md").read_text()


def _plan(path: Path, root: Path) -> dict:
    return build_plan(load_experiment(path).to_container(), root=root)


@pytest.mark.slow
def test_summary_names_changed_keys_and_the_plan_before_and_after(repo, monkeypatch, capsys):
    exp = repo / "experiments/cpu-tiny.yaml"
    before = _plan(exp, repo)
    _edit(exp, version=3, **{"train.exposure_tokens": 360448, "overrides.optim.lr": 0.01})
    bumped = {"cpu-tiny@2": "cpu-tiny@3"}
    while bumped:  # every experiment based on cpu-tiny@2, and those based on them in turn
        following = {}
        for path in sorted((repo / "experiments").glob("*.yaml")):
            doc = yaml.safe_load(path.read_text())
            if doc.get("base") not in bumped:
                continue
            _edit(path, version=doc["version"] + 1, base=bumped[doc["base"]])
            following[f"{path.stem}@{doc['version']}"] = f"{path.stem}@{doc['version'] + 1}"
        bumped = following
    (repo / "experiments/cpu-tiny-h100.yaml").write_text(
        "name: cpu-tiny-h100\nversion: 1\ndescription: cpu-tiny's shape on an H100\nbase: cpu-tiny@3\n"
        "recipes: {hardware: h100@1}\n"
    )
    after = _plan(exp, repo)
    code, md = _review(repo, monkeypatch, capsys)
    assert code == 0 and "**check-pr: PASS**" in md
    section = md.split("### `experiments/cpu-tiny.yaml` (modified)")[1].split("### ")[0]
    assert "| `optim.lr` | 0.003 | 0.01 |" in section
    assert "| `train.exposure_tokens` | 307200 | 360448 |" in section
    assert "Not fingerprinted (labels, recipe references, operational keys): `version`" in section
    assert "| exposure tokens | 307,200 | 360,448 | +17.3% |" in section
    t0, t1 = before["time"]["assumed"], after["time"]["assumed"]
    assert f"| cost (USD) | {t0['cost_usd']:.4g} | {t1['cost_usd']:.4g} | +17.3% |" in section
    assert f"| device-hours | {t0['device_hours']:.4g} | {t1['device_hours']:.4g} |" in section
    assert "| parameters | 354,624 | 354,624 | same |" in section
    assert "| mixture | feasible (most epochs: legal 2.42) | feasible (most epochs: legal 2.85) |" in section
    assert "### `experiments/cpu-tiny-fsdp.yaml` (modified)" in md
    added = md.split("### `experiments/cpu-tiny-h100.yaml` (added)")[1].split("### ")[0]
    assert "| parameters | - | 354,624 |" in added and "| fits in device memory | - | yes |" in added
    assert "1p3b" not in md  # unchanged experiments are not listed


@pytest.mark.slow
def test_a_failing_pr_still_gets_its_summary(repo, monkeypatch, capsys):
    exp = repo / "experiments/cpu-tiny.yaml"
    _edit(exp, **{"train.exposure_tokens": 409600})  # no version bump, and legal needs 3.2 epochs (cap 3)
    code, md = _review(repo, monkeypatch, capsys)
    assert code == 2 and "**check-pr: FAIL**" in md
    assert (
        "- `experiments/cpu-tiny.yaml: version: changed since HEAD but its version was not bumped (was 2, now 2)`" in md
    )
    assert "| mixture | feasible (most epochs: legal 2.42) | INFEASIBLE: " in md
    assert "largest feasible budget at these ratios: 378,880 tokens" in md


@pytest.mark.slow
def test_a_pr_that_changes_no_experiment_says_so(repo, monkeypatch, capsys):
    code, md = _review(repo, monkeypatch, capsys)
    assert code == 0 and "No experiment's resolved config changes." in md
    assert main(["check-pr", "--base", "HEAD"]) == 0
    out = capsys.readouterr().out
    legal = [line for line in out.splitlines() if "domain 'legal' is validated on 2 samples" in line]
    assert len(legal) == 1, out  # said once, naming the experiments (it was 11 lines before PASS: issue 27)
    assert legal[0].startswith("warning: data.manifests.legal: ") and " experiments: " in legal[0]


def test_a_base_that_is_no_commit_or_no_checkout_is_one_line(repo, tmp_path_factory, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert main(["check-pr", "--base", "origin/main"]) == 2  # a fresh `git init`: no remote yet
    assert capsys.readouterr().err.splitlines() == [
        f"error: --base: 'origin/main' is not a commit, branch or tag of {repo}: name one "
        "(`git fetch origin` brings origin/main)"
    ]
    outside = tmp_path_factory.mktemp("not-a-checkout")
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(outside.parent))  # git looks no further up
    assert main(["check-pr", "--base", "HEAD"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {outside} is not in a git checkout: run check-pr inside the project's clone"
    ]


def test_a_pull_requests_strings_stay_text_in_its_review(repo, monkeypatch, capsys):
    """A key named "a`<!--" closed the review's code span (an error line quotes it) and the rest read
    as Markdown: raw HTML, a link, an image. Each string is a code span no backtick closes, or escaped
    text; rendered by markdown-it with HTML on, no tag of the PR's own appears."""
    markdown_it = pytest.importorskip("markdown_it")
    exp = repo / "experiments/cpu-tiny.yaml"
    exp.write_text(exp.read_text() + '"a`<img src=x> ![t](http://evil.example/p.png)": 1\n')
    code, md = _review(repo, monkeypatch, capsys)
    assert code == 2 and "**check-pr: FAIL**" in md
    assert "- ``experiments/cpu-tiny.yaml: a`<img src=x> ![t](http://evil.example/p.png): unknown key``" in md
    html = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(md)
    assert "<img" not in html
    assert "evil.example/p.png): unknown key</code>" in html


def test_a_broken_base_experiment_is_one_problem_not_one_per_experiment_on_it(repo, monkeypatch, capsys):
    """cpu-tiny.yaml is the base of five experiments: its YAML error was listed once per experiment."""
    monkeypatch.chdir(repo)
    exp = repo / "experiments/cpu-tiny.yaml"
    exp.write_text(exp.read_text() + "train: {seq_len: [}\n")
    code = main(["check-pr", "--base", "HEAD"])
    err = capsys.readouterr().err
    assert code == 2
    assert [l for l in err.splitlines() if "not valid YAML" in l] == [
        "error: experiments/cpu-tiny.yaml: line 26: not valid YAML: did not find expected node content"
    ], err
