"""Where the suite's time goes, on every run, and CI's time budget.

After the test summary, pytest prints the suite's wall time and the test files that took longest
(setup + call + teardown of their tests, summed over every worker: the CPU-side cost of a file,
which is what pytest -n shares out), next to pytest's own `--durations` list of single tests.
`RUNNER_TEST_TIMES=PATH` also writes that table, every file and the slowest tests, as markdown
(`.ci/run` puts it in the CI job's summary).

The budget: with `CI=true` (what GitHub Actions and most CI set), a run whose wall time passes
`RUNNER_SUITE_BUDGET_S` (default 1,200 s: 20 minutes) fails, naming its time and the budget,
even when every test passed: a suite that creeps past it is fixed (a shared fixture, a launch
in-process) rather than waited for. Outside CI it is only said.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

DEFAULT_BUDGET_S = 20 * 60
SHOWN_FILES = 12
SHOWN_TESTS = 25


def budget_s() -> float:
    return float(os.environ.get("RUNNER_SUITE_BUDGET_S", DEFAULT_BUDGET_S))


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


class SuiteTimes:
    """A pytest plugin for the controlling process (pytest -n's workers report to it)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.tests: dict[str, float] = defaultdict(float)  # node id -> setup + call + teardown seconds
        self.wall_s = 0.0
        self.over_budget = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid] += report.duration

    def files(self) -> list[tuple[str, float, int]]:
        """(file, seconds, tests), the longest first."""
        total: dict[str, float] = defaultdict(float)
        count: dict[str, int] = defaultdict(int)
        for nodeid, seconds in self.tests.items():
            name = nodeid.split("::", 1)[0]
            total[name] += seconds
            count[name] += 1
        return sorted(((f, s, count[f]) for f, s in total.items()), key=lambda r: (-r[1], r[0]))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.wall_s = time.monotonic() - self.t0
        self.over_budget = on_ci() and self.wall_s > budget_s()
        if self.over_budget and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        path = os.environ.get("RUNNER_TEST_TIMES")
        if path:
            Path(path).write_text(self.markdown())

    def verdict(self) -> str:
        budget = budget_s()
        head = f"suite wall time {self.wall_s:.1f} s ({self.wall_s / 60:.1f} min), {len(self.tests)} tests"
        if self.over_budget:
            return f"FAILED: {head}: over CI's budget of {budget:.0f} s (RUNNER_SUITE_BUDGET_S)"
        where = "CI's budget" if on_ci() else "the budget CI enforces"
        return f"{head}; {where}: {budget:.0f} s"

    def markdown(self) -> str:
        total = sum(self.tests.values())
        lines = [f"## Test times\n\n{self.verdict()}; {total:.1f} s of test time over all workers\n"]
        lines += ["| file | seconds | tests |", "|---|---:|---:|"]
        lines += [f"| {f} | {s:.1f} | {n} |" for f, s, n in self.files()]
        lines += ["", "| slowest tests | seconds |", "|---|---:|"]
        slowest = sorted(self.tests.items(), key=lambda kv: -kv[1])[:SHOWN_TESTS]
        lines += [f"| {nodeid} | {s:.1f} |" for nodeid, s in slowest]
        return "\n".join(lines) + "\n"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        tr.section("time per test file (setup + call + teardown, all workers)")
        for name, seconds, n in self.files()[:SHOWN_FILES]:
            tr.write_line(f"{seconds:8.1f} s  {n:4d} tests  {name}")
        tr.write_line(self.verdict(), red=self.over_budget, bold=self.over_budget)
