"""MLflow in a process of its own, for a launch's tracker: MLflow's import and its store's opening
(seconds of Python) run beside the launch's own imports of torch and transformers instead of after
them, and its requests never hold the training process's GIL.

Owns: starting that process (`prestart`, as soon as a launch knows it tracks, before it imports torch),
the line protocol (one JSON request per line on the process's stdin, one JSON answer per line on a
copy of its stdout; whatever else it prints goes to its stderr), starting it again when it died (the
call that found it dead fails as a failed request does: the entries stay journaled and are sent again)
and ending it. The process only runs runner.training.tracking.MlflowOps' calls; it opens a store at
its first call, never before, so a launch refused before tracking starts creates nothing. It ignores
SIGINT and SIGTERM (a stopped launch still delivers its last entries through it) and exits when its
stdin closes, which a launch killed outright closes too.
RUNNER_MLFLOW_PROCESS=0 keeps MLflow in the launch's own process (the delivery thread's), as a tracker
made without a child (`runner sync`) does.
Never: decides what is delivered or when (runner.training.tracking does), or imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.training.tracking import MlflowOps

ENV = "RUNNER_MLFLOW_PROCESS"  #: "0": MLflow in the launch's own process
CLOSE_WAIT_SECONDS = 5.0  #: how long `close` waits for the process to exit after its stdin closed


def wanted(tracking: bool) -> bool:
    """Whether a launch runs MLflow in a process of its own: it tracks, it is the rank that tracks
    (torchrun's other ranks never do) and RUNNER_MLFLOW_PROCESS is not 0."""
    return tracking and os.environ.get(ENV, "1") != "0" and os.environ.get("RANK", "0") == "0"


def prestart(tracking: bool) -> MlflowChild | None:
    """MLflow's process started now (None where `wanted` says no or it cannot start: MLflow then runs
    in the launch's process, as before)."""
    return MlflowChild.start() if wanted(tracking) else None


def _remote_error(name: str, message: str) -> Exception:
    """The child's exception, of a class of the same name (the tracker's warning names it as before)."""
    return type(name if name.isidentifier() else "MlflowError", (RuntimeError,), {})(message)


class MlflowChild:
    """MLflow's process, asked one call at a time (`call`), from any thread."""

    def __init__(self, proc: subprocess.Popen | None):
        self._proc = proc
        self._lock = threading.Lock()  # one request in flight
        self._seq = 0
        self.started = 1 if proc is not None else 0  #: processes started (a restart after one died adds one)

    @staticmethod
    def _spawn() -> subprocess.Popen:
        env = dict(os.environ)
        # The same runner package: wherever this one came from (the cwd of `python -m runner`, an
        # editable install), the child finds it; the caller's own path entries keep their order.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([*filter(None, [env.get("PYTHONPATH")]), root])
        return subprocess.Popen(
            [sys.executable, "-m", "runner.training.mlflow_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            env=env,
            start_new_session=True,  # out of the terminal's process group: Ctrl-C is the launch's to handle
        )

    @classmethod
    def start(cls) -> MlflowChild | None:
        try:
            return cls(cls._spawn())
        except OSError:
            return None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def call(self, uri: str, op: str, args: list, report: Callable[[str], None]) -> Any:
        """Run MlflowOps(uri).`op`(*args) in the process; its result, or its exception raised here."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self._reap(self._proc)
                self._proc = self._spawn()
                self.started += 1
            proc = self._proc
            self._seq += 1
            request = json.dumps({"id": self._seq, "uri": uri, "op": op, "args": args})
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(request + "\n")
                proc.stdin.flush()
                answer = proc.stdout.readline()
            except (OSError, ValueError):  # its pipe broken or closed by `close`
                answer = ""
            if not answer:
                self._reap(proc)
                self._proc = None if self._proc is proc else self._proc
                raise ConnectionError(f"MLflow's process (pid {proc.pid}) ended during {op} (exit {proc.returncode})")
            reply = json.loads(answer)
        for line in reply.get("said", []):
            report(line)
        if not reply["ok"]:
            raise _remote_error(reply["type"], reply["error"])
        return reply["result"]

    @staticmethod
    def _reap(proc: subprocess.Popen, wait: float = CLOSE_WAIT_SECONDS) -> None:
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the process (its stdin closed: it exits after a request in flight; killed after
        CLOSE_WAIT_SECONDS). A later `call` starts another."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._reap(proc)
        if self._lock.acquire(blocking=False):  # no call is reading its answers: close them
            try:
                if proc.stdout is not None:
                    proc.stdout.close()
            finally:
                self._lock.release()


# ---- the child's side -----------------------------------------------------------------------


def _warm() -> None:
    """What every first call needs, imported before the first request comes (nothing opened)."""
    try:
        import mlflow.entities  # noqa: F401, PLC0415
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401, PLC0415 - a SQLite store's, the default
        import mlflow.tracking  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001 - no mlflow, or a broken one: the first call says why
        pass


def serve(requests, answers) -> None:
    """Answer each request line of `requests` on `answers` until `requests` ends."""
    opened: dict[str, MlflowOps] = {}
    for line in requests:
        ask = json.loads(line)
        said: list[str] = []
        try:
            if ask["op"] not in MlflowOps.CALLS:
                raise ValueError(f"not an MLflow call of the runner: {ask['op']!r}")
            ops = opened.get(ask["uri"])
            if ops is None:
                ops = opened[ask["uri"]] = MlflowOps(ask["uri"], said.append)
            reply = {"id": ask["id"], "ok": True, "result": getattr(ops, ask["op"])(*ask["args"]), "said": said}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller, which retries
            reply = {"id": ask["id"], "ok": False, "type": type(e).__name__, "error": str(e), "said": said}
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launch ends tracking, after its last entries
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever else is printed goes to stderr, never among the answers
    _warm()
    try:
        serve(sys.stdin, answers)
    except BrokenPipeError:  # the launch is gone
        pass
    finally:
        with contextlib.suppress(OSError):
            answers.close()


if __name__ == "__main__":
    main()
