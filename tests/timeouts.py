"""How long tests wait for subprocesses: generous bounds that catch a hang, not a slow machine.

A tiny `runner launch` takes ~10 s on a quiet 2-core machine; with eight test suites sharing those
cores one took over 120 s, so no bound here is near what a busy machine needs. Multiply them all
with RUNNER_TEST_TIMEOUT_SCALE on a machine slower still.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("RUNNER_TEST_TIMEOUT_SCALE", "1"))
SUBPROCESS_TIMEOUT_S = 900 * SCALE  # one command: launch, torchrun, prepare, an mlflow server's start
TEST_TIMEOUT_S = 1800 * SCALE  # pytest-timeout's bound for a test that could hang (threads, servers, ranks)
