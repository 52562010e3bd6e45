"""How long work shows progress: a bar on a terminal, a plain line now and then in a log file.

Owns the one policy every long command shares (`launch`, `data prepare`, the audit's replay): when
stderr is a terminal, a tqdm bar; otherwise a plain line at the first update, then every
LINE_INTERVAL_SECONDS, and at the end. Time, not a step count, sets the cadence because a step
takes milliseconds on cpu-tiny and tens of seconds on 1p3b: either way a log file gets about one
line a minute. Never decides what is counted; writes only to stderr.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable

from tqdm import tqdm

LINE_INTERVAL_SECONDS = 60.0
BAR_DELAY_SECONDS = 2.0  # work that ends sooner never shows a bar (tqdm's `delay`)


def interactive(stream=None) -> bool:
    """Whether `stream` (default stderr) is a terminal a bar can redraw in place."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced by an object without isatty
        return False


class LineCadence:
    """When a plain progress line is due: the first time asked, then every `interval_seconds`."""

    def __init__(self, interval_seconds: float = LINE_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.interval_seconds = interval_seconds
        self.clock = clock
        self.last: float | None = None

    def due(self) -> bool:
        now = self.clock()
        if self.last is None or now - self.last >= self.interval_seconds:
            self.last = now
            return True
        return False


def format_seconds(seconds: float) -> str:
    """A duration as `45s`, `12m05s`, `3h07m` or `2d04h`."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class _LineCounter:
    """tqdm's counting surface for a log file: a plain line when the cadence says so, and at close."""

    def __init__(self, desc: str, unit: str, total: int | None, stream, cadence: LineCadence):
        self.desc, self.unit, self.total, self.stream, self.cadence = desc, unit, total, stream, cadence
        self.n = 0
        self.postfix = ""
        self.t0 = time.monotonic()
        self.printed_n: int | None = None

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.cadence.due():
            self._line()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def _line(self) -> None:
        seconds = time.monotonic() - self.t0
        done = f"{self.n:,}" + (f"/{self.total:,}" if self.total else "")
        rate = f", {self.n / seconds:,.0f} {self.unit}/s" if seconds > 0 else ""
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {done} {self.unit}{rate}, {format_seconds(seconds)}{extra}", file=self.stream, flush=True)
        self.printed_n = self.n

    def close(self) -> None:
        if self.printed_n != self.n:
            self._line()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Silent:
    def update(self, n: int = 1) -> None: ...

    def set_postfix_str(self, text: str, refresh: bool = True) -> None: ...

    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None: ...


def counter(desc: str, unit: str, total: int | None = None, stream=None, enabled: bool | None = None):
    """A tqdm bar on a terminal, else plain lines; `enabled` False: nothing, True: a bar anyway.
    Each takes update(n), set_postfix_str(text) and close(), and is a context manager."""
    stream = sys.stderr if stream is None else stream
    if enabled is False:
        return _Silent()
    if enabled or interactive(stream):
        return tqdm(desc=desc, unit=unit, unit_scale=True, total=total, file=stream)
    return _LineCounter(desc, unit, total, stream, LineCadence())


def on_terminal(iterable: Iterable, desc: str, unit: str, total: int | None = None) -> Iterable:
    """`iterable`, with a bar on a terminal when it lasts over BAR_DELAY_SECONDS; silent in a log."""
    if not interactive():
        return iterable
    return tqdm(iterable, desc=desc, unit=unit, total=total, file=sys.stderr, delay=BAR_DELAY_SECONDS, leave=False)
