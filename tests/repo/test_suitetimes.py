"""The suite's time report and CI's time budget (tests/suitetimes.py), on a real pytest session
of two small test files run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
from suitetimes import DEFAULT_BUDGET_S, SuiteTimes

REPO = Path(__file__).resolve().parents[2]


def _session(tmp_path: Path, monkeypatch, capsys, **environ) -> tuple[int, str, SuiteTimes]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "test_slowish.py").write_text(
        "import time\n\ndef test_a():\n    time.sleep(0.2)\n\ndef test_b():\n    time.sleep(0.1)\n"
    )
    (tmp_path / "test_quick.py").write_text("def test_c():\n    assert True\n")
    for key in ("CI", "RUNNER_SUITE_BUDGET_S", "RUNNER_TEST_TIMES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    plugin = SuiteTimes()
    # pytest's own plugins only (the installed ones cost seconds to load again), and not those that
    # cost seconds in a process holding torch (gc.collect five times)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    args = [str(tmp_path), "-q", "--rootdir", str(tmp_path), "--import-mode=importlib"]
    for name in ("cacheprovider", "unraisableexception", "threadexception"):
        args += ["-p", f"no:{name}"]
    code = pytest.main(args, plugins=[plugin])
    return int(code), capsys.readouterr().out, plugin


def test_every_run_reports_its_wall_time_and_its_files_longest_first(tmp_path, monkeypatch, capsys):
    code, out, plugin = _session(tmp_path, monkeypatch, capsys, RUNNER_TEST_TIMES=str(tmp_path / "times.md"))
    assert code == 0
    files = plugin.files()
    assert [(f, n) for f, _, n in files] == [("test_slowish.py", 2), ("test_quick.py", 1)]
    assert files[0][1] >= 0.3 and files[0][1] > files[1][1]
    assert plugin.wall_s >= files[0][1]  # one worker: the wall holds every test's time
    assert "time per test file" in out and "test_slowish.py" in out.split("time per test file")[1]
    assert f"suite wall time {plugin.wall_s:.1f} s" in out and f"the budget CI enforces: {DEFAULT_BUDGET_S} s" in out
    table = (tmp_path / "times.md").read_text()
    assert "| test_slowish.py |" in table and "| test_quick.py |" in table
    assert "| test_slowish.py::test_a |" in table  # and the slowest tests


def test_on_ci_a_run_past_the_budget_fails_though_every_test_passed(tmp_path, monkeypatch, capsys):
    code, out, plugin = _session(tmp_path, monkeypatch, capsys, CI="true", RUNNER_SUITE_BUDGET_S="0.25")
    assert plugin.over_budget and code == pytest.ExitCode.TESTS_FAILED
    assert "3 passed" in out
    assert "FAILED: suite wall time" in out and "over CI's budget of 0 s (RUNNER_SUITE_BUDGET_S)" in out


def test_within_the_budget_or_outside_ci_the_time_is_only_said(tmp_path, monkeypatch, capsys):
    code, out, plugin = _session(tmp_path / "ci", monkeypatch, capsys, CI="true")
    assert code == 0 and not plugin.over_budget and f"CI's budget: {DEFAULT_BUDGET_S} s" in out
    code, out, plugin = _session(tmp_path / "local", monkeypatch, capsys, RUNNER_SUITE_BUDGET_S="0.25")
    assert code == 0 and not plugin.over_budget and "FAILED" not in out


def test_the_budget_is_the_one_the_readme_states():
    assert DEFAULT_BUDGET_S == 20 * 60
    text = (REPO / "README.md").read_text()
    assert "20 minutes" in text and "RUNNER_SUITE_BUDGET_S" in text
