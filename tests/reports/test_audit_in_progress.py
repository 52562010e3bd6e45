"""`runner audit RUN` while a launch holds the run folder says IN PROGRESS (exit 6) and audits nothing
(issue 27, item 7): it read report/ while the launch rewrote it (csv "finished", parquet "running") and
FAILed an honest run. A holder that ended, SIGKILL included, stops nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from runfixtures import make_run

from runner.cli import main
from runner.errors import EXIT_IN_PROGRESS, EXIT_UNVERIFIED, RunnerError
from runner.reports.publish import publish
from runner.reports.tables import write_report
from runner.runs.lock import RunLock

HOLD = "import sys; from runner.runs.lock import RunLock; l = RunLock(sys.argv[1], 'runner launch').__enter__(); print('held', flush=True); sys.stdin.read()"


@pytest.fixture(scope="module")
def _made(tmp_path_factory):
    folder = make_run(tmp_path_factory.mktemp("held"))
    write_report(folder)
    return folder


@pytest.fixture()
def run(_made, tmp_path):
    """A run folder with its report, each test its own copy."""
    shutil.copytree(_made, tmp_path / "run")
    return tmp_path / "run"


def _audit(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["audit", *map(str, argv), "--no-mlflow"])
    return code, capsys.readouterr().out


def test_a_run_held_by_a_launch_in_another_process_is_in_progress_not_failed(run, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (run / "report" / "run_summary.csv").write_text("half-written")  # what a reader sees mid-rewrite
        for target in (run, run / "report"):
            code, out = _audit(capsys, target)
            assert code == EXIT_IN_PROGRESS == 6, out
            assert out.startswith(f"IN PROGRESS {target}: in use by runner launch")
            assert f"pid {holder.pid}" in out and "audit it when that process ends" in out
        code, out = _audit(capsys, run, "--json")
        assert json.loads(out)["verdict"] == "IN PROGRESS" and json.loads(out)["holder"]["pid"] == holder.pid
        with pytest.raises(RunnerError, match="in use by runner launch"):
            publish(run, run.parent / "published")
    finally:
        holder.kill()  # SIGKILL: the kernel drops the flock, the record stays unreleased
        holder.wait()
    write_report(run)
    code, out = _audit(capsys, run)
    assert code == EXIT_UNVERIFIED, out  # audited again: a dead holder holds nothing


def test_a_lock_released_or_held_by_this_process(run, capsys):
    with RunLock(run, "runner report"):
        assert _audit(capsys, run)[0] == EXIT_IN_PROGRESS
    assert _audit(capsys, run)[0] == EXIT_UNVERIFIED  # released
