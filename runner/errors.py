"""User-facing errors. Owns the one-line message format; never prints or exits itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def display_path(path: Any) -> str:
    """A path as the user would type it: relative to the current folder when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError, TypeError):
        return str(path)


class RunnerError(Exception):
    """Bad input a user can act on: `file: dotted.key: message`. The CLI exits 2 on it."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        file = display_path(file) if file else file
        parts = [p for p in (file, key) if p]
        self.file, self.key, self.detail = file, key, message
        super().__init__(": ".join(parts + [message]))


class MixtureInfeasible(RunnerError):
    """A mixture that cannot meet its target ratios within the budget and repetition caps."""


class Preempted(Exception):
    """Raised inside the training loop after SIGTERM/SIGINT, once a checkpoint is saved."""


EXIT_OK, EXIT_DISCREPANCY, EXIT_USAGE, EXIT_PREEMPTED, EXIT_NONFINITE = 0, 1, 2, 3, 4
