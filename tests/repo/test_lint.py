"""The lint and type gate, run with the tests (CI runs `./install.sh && python -m pytest`).

ruff (lint and format) covers the package, the schemas, the tests and the benchmarks; mypy covers
the package and the schemas (its settings, like ruff's, are in pyproject.toml). Each check fails
with the tool's own report, so the fix is on screen.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

LINTED = ("runner", "schemas", "tests", "bench")


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_finds_nothing():
    out = _tool("ruff", "check", "--no-cache", *LINTED)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_changes_nothing():
    out = _tool("ruff", "format", "--check", "--no-cache", *LINTED)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy_finds_nothing():
    out = _tool("mypy")
    assert out.returncode == 0, out.stdout + out.stderr
