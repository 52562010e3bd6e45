"""What this process may use of the machine it runs on. Imports nothing but the standard library."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's): the
    tokenizer processes are CPU-bound, so more add nothing, and `--workers 100000` started processes
    until the machine ran out of memory; `hardware.threads: 100000` crashed torch (a segmentation fault)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
