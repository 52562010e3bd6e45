"""The audit's result: named checks and the verdict they add up to.

Owns: the four statuses a check can have, the three verdicts (PASS: every check that bears on the
report ran and held; FAIL: at least one discrepancy; UNVERIFIED: nothing contradicts the report but
named checks could not run), their exit codes, and how a result is printed. A check that could not
run is UNVERIFIED, never a pass.
Never: runs a check or reads a report (runner.reports.audit.run does).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from runner.errors import EXIT_DISCREPANCY, EXIT_OK, EXIT_UNVERIFIED

PASS, FAIL, UNVERIFIED = "PASS", "FAIL", "UNVERIFIED"
INFO = "INFO"  # a fact a reader should see next to the checks; never fails, never verifies
MAX_PROBLEMS_SHOWN = 8

#: the audit's relative tolerance for a recomputed figure against the reported one
REL_TOL = 1e-6


def close(a: float, b: float, rel: float = REL_TOL) -> bool:
    """Whether a recomputed figure and the reported one agree within `rel` (and 1e-12 absolute)."""
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-12)


def first_difference(written: str, rendered: str, renders: str, width: int = 90) -> str:
    """Where a file differs from what the runner renders: "line N reads '...', RENDERS '...'" with each excerpt around the first character that differs (a long table row differs far
    past its first 90 characters), for the checks that compare a written file with its rendering."""
    ours, theirs = written.splitlines(), rendered.splitlines()
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    a, b = (ours[n] if n < len(ours) else None), (theirs[n] if n < len(theirs) else None)
    at = next((i for i, (x, y) in enumerate(zip(a or "", b or "")) if x != y), min(len(a or ""), len(b or "")))
    start = max(0, at - width // 3) if max(len(a or ""), len(b or "")) > width else 0

    def excerpt(line: str | None) -> str:
        if line is None:
            return "(none)"
        cut = line[start : start + width]
        return repr(("..." if start else "") + cut + ("..." if start + width < len(line) else ""))

    return f"line {n + 1} reads {excerpt(a)}, {renders} {excerpt(b)}"


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


def _joined(problems: list[str]) -> str:
    shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return shown + (f"; ... {more} more" if more > 0 else "")


@dataclass
class AuditResult:
    source: str
    checks: list[Check] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        statuses = {c.status for c in self.checks}
        if FAIL in statuses:
            return FAIL
        return UNVERIFIED if UNVERIFIED in statuses or PASS not in statuses else PASS

    @property
    def passed(self) -> bool:
        """Everything verified: the verdict is PASS (an UNVERIFIED report has not passed)."""
        return self.verdict == PASS

    @property
    def consistent(self) -> bool:
        """No check found a discrepancy (PASS or UNVERIFIED)."""
        return self.verdict != FAIL

    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == FAIL]

    def unverified(self) -> list[str]:
        return [c.name for c in self.checks if c.status == UNVERIFIED]

    def add(self, name: str, problems: list[str], *, ok_detail: str = "") -> None:
        """A check that ran: PASS without problems, else FAIL listing them."""
        self.checks.append(Check(name, FAIL if problems else PASS, _joined(problems) if problems else ok_detail))

    def could_not(self, name: str, why: str) -> None:
        """A check that could not run: UNVERIFIED, saying why."""
        self.checks.append(Check(name, UNVERIFIED, why))

    def info(self, name: str, detail: str) -> None:
        self.checks.append(Check(name, INFO, detail))

    def exit_code(self, require_verified: bool = False) -> int:
        if self.verdict == PASS:
            return EXIT_OK
        if self.verdict == UNVERIFIED and not require_verified:
            return EXIT_UNVERIFIED
        return EXIT_DISCREPANCY

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "verdict": self.verdict,
            "passed": self.passed,
            "failed": self.failed(),
            "unverified": self.unverified(),
            "checks": [asdict(c) for c in self.checks],
        }

    def summary_line(self) -> str:
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, UNVERIFIED, INFO)}
        line = (
            f"{self.verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, "
            f"{counts[UNVERIFIED]} unverified, {counts[INFO]} informational"
        )
        if self.verdict == UNVERIFIED:
            line += "; not verified: " + ", ".join(self.unverified())
        return line

    def render(self) -> str:
        width = max((len(c.name) for c in self.checks), default=5)
        lines = [f"audit of {self.source}", f"{'check':<{width}}  {'result':<10}  detail"]
        lines += [f"{c.name:<{width}}  {c.status:<10}  {c.detail}" for c in self.checks]
        lines.append(self.summary_line())
        return "\n".join(lines)
