"""Running a verb in this process with a bound on its time, and reading its one error line."""

from __future__ import annotations

import signal
from contextlib import contextmanager

from runner.cli import main


@contextmanager
def time_limit(seconds: float):
    """Fail instead of hanging: SIGALRM interrupts the code under test."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(capsys, *argv: str, seconds: float = 60) -> tuple[int, str, str]:
    capsys.readouterr()
    with time_limit(seconds):
        code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]
