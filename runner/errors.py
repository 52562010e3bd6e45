"""User-facing errors. Owns the one-line message format; never prints or exits itself."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any


def display_path(path: Any) -> str:
    """A path as the user would type it: relative to the current folder when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError, TypeError):
        return str(path)


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)` for a message, cut to `limit` characters with the length said: a 3,000-character
    string in a numeric field is one readable line, not 3,000 characters of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text):,} characters)"


class RunnerError(Exception):
    """Bad input a user can act on: `file: dotted.key: message`. The CLI exits 2 on it."""

    def __init__(self, message: str, *, file: str | Path | None = None, key: str | None = None):
        shown = display_path(file) if file else None
        parts = [p for p in (shown, key) if p]
        self.file, self.key, self.detail = shown, key, message
        super().__init__(": ".join(parts + [message]))


class MixtureInfeasible(RunnerError):
    """A mixture that cannot meet its target ratios within the budget and repetition caps."""


class Problems:
    """Collects every problem in a file so the user sees all of them at once."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, file: Any, key: str, message: str) -> None:
        file = display_path(file)
        self.add_line(f"{file}: {key}: {message}" if key else f"{file}: {message}")

    def add_line(self, line: str) -> None:
        """A line as `add` makes it (one found before, replayed): each said once."""
        if line not in self.lines:
            self.lines.append(line)

    def raise_if_any(self) -> None:
        if self.lines:
            raise RunnerError("\n".join(self.lines))


def did_you_mean(word: str, options) -> str:
    """' (did you mean 'x'?)' for the closest option, else ''."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def join_key(prefix: str, key: str) -> str:
    """A dotted key: `join_key("train", "seq_len")` -> "train.seq_len"."""
    return f"{prefix}.{key}" if prefix else str(key)


#: Exit codes of the `runner` command.
EXIT_OK = 0
EXIT_DISCREPANCY = 1  #: ran on good input and found a problem: an audit failed, a smoke run differed, data is pending
EXIT_USAGE = 2  #: unusable input (a RunnerError), or a path the system refused (an OSError naming it)
EXIT_PREEMPTED = 3  #: a run stopped by a signal after saving a checkpoint (resume it)
EXIT_NONFINITE = 4  #: a run stopped at a non-finite loss, the step not committed
EXIT_UNVERIFIED = 5  #: `runner audit`: consistent, but named checks could not run (`--require-verified` makes it 1)
EXIT_IN_PROGRESS = 6  #: `runner audit RUN`: a launch (or sync, report) holds the run folder; nothing was audited
