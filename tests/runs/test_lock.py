"""One process owns a run folder: a second launch (or sync, or report) is refused naming the holder,
and a holder that died, SIGKILL included, never blocks the next launch."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from trainfixtures import env, launch, make_project

from runner.errors import RunnerError
from runner.runs.lock import OWNER_FILE, RunLock


def _wait_for_training(proc: subprocess.Popen, journal) -> None:
    deadline = time.monotonic() + 600  # generous: a loaded 2-core machine starts torch slowly
    while not (journal.exists() and journal.read_text().count("\n") >= 2):
        assert proc.poll() is None, "the first launch ended before the test could hold it"
        assert time.monotonic() < deadline, "the first launch never started training"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fcntl", "file"])
def test_second_launch_is_refused_naming_the_holder_and_a_killed_holder_blocks_nothing(tmp_path, method):
    exp = make_project(tmp_path, steps=40, checkpoint_every=10, keep_last=2)
    run = tmp_path / "runs" / "one"
    first = subprocess.Popen(
        [sys.executable, "-m", "runner", "launch", str(exp), "--run-dir", str(run), "--no-tracking"],
        cwd=tmp_path,
        env=env(tmp_path, RUNNER_LOCK=method),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_training(first, run / "journal" / "processed.jsonl")
        os.kill(first.pid, signal.SIGSTOP)  # holds the folder for as long as the test needs
        second = launch(tmp_path, run, "--no-tracking", check=False, RUNNER_LOCK=method)
        sync = subprocess.run(
            [sys.executable, "-m", "runner", "sync", str(run)],
            cwd=tmp_path,
            env=env(tmp_path, RUNNER_LOCK=method),
            capture_output=True,
            text=True,
        )
    finally:
        first.kill()  # SIGKILL: no clean-up of its own runs
        first.wait()
    for proc in (second, sync):
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr
        assert lines[0].startswith(f"error: {run.relative_to(tmp_path)}: in use by runner launch")
        assert f"pid {first.pid} on host {socket.gethostname()}" in lines[0]
    # Only the first launch trained: the refused one wrote nothing into the journal after it.
    attempts = {json.loads(x)["attempt"] for x in (run / "journal" / "processed.jsonl").read_text().splitlines()}
    assert attempts == {1}

    third = launch(tmp_path, run, "--no-tracking", RUNNER_LOCK=method)
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["committed_steps"] == 40
    counters = json.loads((run / "ledger.json").read_text())["counters"]["total"]
    assert counters["exposure"] == 40 * 8 * 16
    if method == "file":  # the dead holder's file was taken over, and said so
        assert f"took over {(run / OWNER_FILE).relative_to(tmp_path)}" in third.stderr
        assert not (run / OWNER_FILE).exists()  # released at the end


def test_flock_is_exclusive_and_released_with_its_owner(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNNER_LOCK", raising=False)
    with (
        RunLock(tmp_path, "runner launch"),
        pytest.raises(RunnerError, match=rf"in use by runner launch .*pid {os.getpid()} on host"),
    ):
        RunLock(tmp_path, "runner sync").__enter__()
    with RunLock(tmp_path, "runner sync"):  # released: the next owner gets it
        pass
    record = json.loads((tmp_path / "lock").read_text())
    assert record["pid"] == os.getpid() and "released_at" in record


def test_lock_file_method_takes_over_a_dead_pid_and_names_another_host(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_LOCK", "file")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owner = tmp_path / OWNER_FILE
    owner.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "command": "runner launch (x)"}))
    with RunLock(tmp_path) as lock:
        assert json.loads(owner.read_text())["pid"] == os.getpid()
        assert any(f"pid {dead.pid}" in w and "which is gone" in w for w in lock.warnings)
        with pytest.raises(RunnerError, match=f"pid {os.getpid()}"):  # alive: refused
            RunLock(tmp_path).__enter__()
    assert not owner.exists()

    owner.write_text(json.dumps({"host": "node-7", "pid": 4242, "command": "runner launch (y)", "since": "then"}))
    with pytest.raises(RunnerError) as refused:
        RunLock(tmp_path).__enter__()
    message = str(refused.value)
    assert "pid 4242 on host node-7" in message and f"remove {tmp_path / OWNER_FILE}" in message
    assert json.loads(owner.read_text())["host"] == "node-7"  # never taken from another host


def test_storage_without_fcntl_locks_falls_back_to_the_lock_file(tmp_path, monkeypatch):
    import fcntl

    monkeypatch.delenv("RUNNER_LOCK", raising=False)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with RunLock(tmp_path):
        assert json.loads((tmp_path / OWNER_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(RunnerError, match="in use by"):
            RunLock(tmp_path).__enter__()
    assert not (tmp_path / OWNER_FILE).exists()
