"""The lock of a run folder: one process writes it at a time (RunLock), and reading who holds it.

A launch, `runner sync` and `runner report` take it; readers (audit, status) only ask who holds it.
Never reads or writes the run's records themselves (runner.runs.folder does).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
from pathlib import Path

from runner.errors import RunnerError, display_path


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ---- the lock: one process owns a run folder -----------------------------------------------------

LOCK_FILE = "lock"  #: flock(2)ed for the life of the owner; holds its record (host, pid, command, since)
OWNER_FILE = "lock.owner"  #: the lock-file method, where fcntl locks are unavailable (created O_EXCL)
#: errors of flock(2) on storage that has no working locks (NFS without lockd, some FUSE/Lustre mounts)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class RunLock:
    """Exclusive ownership of a run folder by one process: `runner launch` (its rank 0 under
    torchrun/accelerate), `runner sync` and `runner report`, the verbs that write into it.

    The method is flock(2) on `<run>/lock`: the kernel drops it when the owner exits in any way,
    SIGKILL included, so a crashed launch never blocks the next. Where the storage has no working
    fcntl locks (flock fails) or `RUNNER_LOCK=file` says its locks are not shared between hosts, the
    method is a lock file created exclusively, `<run>/lock.owner`, naming host and pid: one left by a
    dead process of this host is taken over; one from another host is named, for the user to remove
    once that process is gone. A second owner is refused with a RunnerError naming the holder."""

    def __init__(self, run_dir: Path, command: str = "runner launch"):
        self.run_dir = Path(run_dir)
        self.command = command
        self._fd: int | None = None
        self._owner: Path | None = None
        self.warnings: list[str] = []  # things the owner should print (a lock taken over)

    def record(self) -> dict:
        argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": f"{self.command} ({argv})",
            "since": _now(),
        }

    def __enter__(self) -> RunLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only or missing mount, a file in the way, no permission
            raise RunnerError(f"cannot create the run folder: {e.strerror}", file=str(self.run_dir)) from None
        if os.environ.get("RUNNER_LOCK", "fcntl") == "file":
            self._take_owner_file()
        else:
            self._take_flock()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def held(self) -> dict:
        """The record this owner wrote (host, pid, since): what every rank must read in the folder."""
        if self._fd is not None:
            return _read_fd(self._fd)
        return self._read(self._owner) if self._owner is not None else {}

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                _write_record(self._fd, dict(_read_fd(self._fd), released_at=_now()))
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        if self._owner is not None:
            if self._read(self._owner).get("pid") == os.getpid():
                with contextlib.suppress(OSError):
                    self._owner.unlink()
            self._owner = None

    def _take_flock(self) -> None:
        path = self.run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use(self._read(path), path) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_FLOCK:
                raise
            self._take_owner_file()  # no fcntl locks on this storage
            return
        before = _read_fd(fd)  # through this descriptor: on NFS, closing another one would drop the lock
        if before.get("host") not in (None, socket.gethostname()) and "released_at" not in before:
            self.warnings.append(
                f"warning: {display_path(self.run_dir)}: the previous owner, {_holder(before)}, never released it "
                "(killed?); if it is still running there, this storage does not share fcntl locks between hosts: "
                "stop this launch and use RUNNER_LOCK=file"
            )
        _write_record(fd, self.record())
        self._fd = fd

    def _take_owner_file(self) -> None:
        owner = self.run_dir / OWNER_FILE
        for _attempt in range(3):
            try:
                fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                held = self._read(owner)
                if held.get("host") != socket.gethostname() or _alive(held.get("pid")):
                    raise self._in_use(held, owner) from None
                grave = owner.with_name(f"{OWNER_FILE}.stale-{os.getpid()}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(owner, grave)  # atomic: of two launches taking it over, one moves it
                    if self._read(grave) != held:  # moved a fresh owner's file: give it back
                        os.rename(grave, owner)
                        raise self._in_use(self._read(owner), owner) from None
                    grave.unlink()
                    self.warnings.append(f"note: took over {display_path(owner)} from {_holder(held)}, which is gone")
                continue
            try:
                _write_record(fd, self.record())
            finally:
                os.close(fd)
            self._owner = owner
            return
        raise RunnerError("another process keeps taking the lock over; retry", file=str(owner))

    def _in_use(self, held: dict, path: Path) -> RunnerError:
        how = (
            f"; if no runner process runs there any more, remove {display_path(path)}"
            if path.name == OWNER_FILE and held.get("host") != socket.gethostname()
            else ""
        )
        return RunnerError(
            f"in use by {_holder(held)}: one process writes a run folder at a time; wait for it to end, "
            f"or stop it{how}",
            file=str(self.run_dir),
        )

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            data = json.loads(path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def lock_holder(run_dir: Path) -> dict | None:
    """The record of the process that holds a run folder now (a launch, sync or report writing it), or
    None. Read only: the lock is never taken. A record released, or left by a dead process of this
    host, holds nothing; one of another host (or not written yet) is asked of flock(2) itself, a shared
    lock tried and dropped at once."""
    run_dir = Path(run_dir)
    owner = RunLock._read(run_dir / OWNER_FILE)
    if owner and (owner.get("host") != socket.gethostname() or _alive(owner.get("pid"))):
        return owner
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None  # never locked
    try:
        record = _read_fd(fd)
        if "released_at" in record:
            return None
        if record.get("host") == socket.gethostname():
            return record if _alive(record.get("pid")) else None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return record
        except OSError:
            return None  # no fcntl locks on this storage: the lock-file method was read above
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holder_text(record: dict) -> str:
    """`runner launch (...), pid P on host H since T`: who holds a run folder, in words."""
    return _holder(record)


def lock_records(run_dir: Path) -> list[dict]:
    """The owners' records as a reader sees them in `run_dir` (either method's file; none: [])."""
    return [RunLock._read(Path(run_dir) / name) for name in (LOCK_FILE, OWNER_FILE) if (Path(run_dir) / name).exists()]


def _holder(record: dict) -> str:
    if not record.get("pid"):
        return "another process (its record is not readable yet)"
    return f"{record.get('command', 'a runner process')}, pid {record['pid']} on host {record.get('host')} since {record.get('since')}"


def _read_fd(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_record(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True
