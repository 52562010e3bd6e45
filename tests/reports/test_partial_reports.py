"""Partial reports (issue 27, item 6): a SIGKILLed `runner publish` left 20 of 30 files and
`runner audit-reports` skipped the folder (exit 0, "0 published reports"). A report and a published
folder are now built beside their place and renamed into it, and audit-reports FAILs any folder
under reports/ that is neither a complete report nor a documented kind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from runfixtures import make_run

from runner.cli import main
from runner.errors import EXIT_DISCREPANCY, EXIT_UNVERIFIED
from runner.reports import publish as pub
from runner.reports.audit.evidence import write_report_with_evidence
from runner.reports.compare import render
from runner.reports.compare import runs as cmp

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def _made(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("made")
    run = make_run(root / "project")
    write_report_with_evidence(run)
    dest, result = pub.publish(run, root / "reports")
    assert dest is not None and result.consistent, result.render()
    return root, run, dest


@pytest.fixture()
def published(_made, tmp_path) -> tuple[Path, Path]:
    """(a run folder, its published report), each test its own copy."""
    root, run, dest = _made
    shutil.copytree(root, tmp_path, dirs_exist_ok=True, symlinks=True)
    return tmp_path / run.relative_to(root), tmp_path / dest.relative_to(root)


def _audit_reports(capsys, reports: Path) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["audit-reports", str(reports)])
    return code, capsys.readouterr().out


def test_a_publish_killed_midway_leaves_the_published_report_whole_and_is_caught(published, capsys, monkeypatch):
    run, dest = published
    reports = dest.parents[1]
    before = sorted(p.relative_to(dest) for p in dest.rglob("*"))
    copied = []

    def copy_then_die(src, dst):
        if len(copied) == 20:
            raise KeyboardInterrupt  # SIGKILL, as far as the files on disk can tell
        copied.append(dst)
        return shutil.copy2(src, dst)

    monkeypatch.setattr(pub.shutil, "copy2", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(run, reports)
    monkeypatch.undo()
    assert sorted(p.relative_to(dest) for p in dest.rglob("*")) == before  # the earlier publish, whole
    leftover = [p for p in dest.parent.iterdir() if p.name.startswith(".")]
    assert len(leftover) == 1 and len(list(leftover[0].rglob("*.*"))) < len(before)
    code, out = _audit_reports(capsys, reports)
    assert code == EXIT_DISCREPANCY, out
    assert f"audit of {leftover[0]}" in out and "a complete report or a documented kind  FAIL" in out
    pub.publish(run, reports)  # the next publish clears what the killed one left
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]
    assert _audit_reports(capsys, reports)[0] == EXIT_UNVERIFIED


def test_a_published_folder_missing_files_fails_audit_reports(published, capsys):
    _, dest = published
    partial = dest.parent / "20250101-partial"
    shutil.copytree(dest, partial)
    for name in ("throughput.png", "evidence.json", "router.csv", "manifests/web.json"):
        (partial / name).unlink()
    code, out = _audit_reports(capsys, dest.parents[1])
    assert code == EXIT_DISCREPANCY, out
    assert "incomplete report: router.csv, throughput.png, manifests/web.json, evidence.json missing" in out
    assert out.strip().splitlines()[-1] == "2 published reports: 0 PASS, 1 UNVERIFIED, 1 FAIL"


def test_stray_folders_and_files_fail_and_documented_kinds_pass(published, capsys):
    _, dest = published
    reports = dest.parents[1]
    (reports / "claims").mkdir()
    (reports / "claims" / "seeds.yaml").write_text("claims: []\n")
    (reports / "claims" / "README.md").write_text("# claims\n")
    (reports / "models" / "tiny").mkdir(parents=True)
    (reports / "models" / "tiny" / "README.md").write_text("---\nlibrary_name: transformers\n---\n")
    shutil.copytree(REPO / "reports" / "comparisons", reports / "comparisons")
    assert pub.layout_results(reports) == []
    (reports / "notes.txt").write_text("x")
    (reports / "fixture" / "half").mkdir()
    (reports / "comparisons" / "cpu-tiny-lr" / "comparison.json").unlink()
    (reports / "claims" / "draft.txt").write_text("x")
    code, out = _audit_reports(capsys, reports)
    assert code == EXIT_DISCREPANCY, out
    failed = {r.source: r.render() for r in pub.layout_results(reports)}
    assert set(failed) == {str(reports / n) for n in ("notes.txt", "fixture/half", "comparisons", "claims")}
    assert "cpu-tiny-lr: incomplete (comparison.json missing)" in failed[str(reports / "comparisons")]
    assert "draft.txt: not a claims file" in failed[str(reports / "claims")]


def test_the_shipped_reports_folder_holds_only_complete_reports_and_documented_kinds():
    assert pub.layout_results(REPO / "reports") == []


def test_a_comparison_folder_is_made_whole_or_not_at_all(published, tmp_path, monkeypatch):
    _, dest = published
    other = dest.parent / "20250101-other"
    shutil.copytree(dest, other)
    out = tmp_path / "comparisons" / "x"
    out.mkdir(parents=True)
    (out / "README.md").write_text("what this comparison shows\n")

    def sources():
        found = [cmp.load_source(str(p)) for p in (dest, other)]
        cmp.assign_labels(found, ["a", "b"])
        return found

    (out / "comparison.json").write_text("{}")  # an earlier comparison
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def killed(found):
        raise KeyboardInterrupt  # after the audited report copies are staged, before any table

    monkeypatch.setattr(render, "compare", killed)
    with pytest.raises(KeyboardInterrupt):
        render.write_comparison_folder(sources(), out)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    staged = [p for p in out.parent.iterdir() if p.name.startswith(".")]
    assert len(staged) == 1 and (staged[0] / "runs" / "b" / "report.md").is_file()  # beside, hidden, not in place
    assert (staged[0] / "README.md").read_text() == "what this comparison shows\n"  # its own files go along
