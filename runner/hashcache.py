"""Files whose sha256 this machine has already taken, remembered so that a reader need not take it again.

Owns the per-user cache folder (`$RUNNER_CACHE_DIR`, by default `$XDG_CACHE_HOME/runner/`, i.e.
`~/.cache/runner/`), the one trust rule and the cache files' format, for every kind of file the
runner verifies by hash: a launch's data shards (runner.data.integrity, `verified-shards.json`) and
the checkpoints its writer hashed while writing them (runner.training.checkpoint,
`verified-checkpoints.json`).

The rule: an entry holds a file's resolved path, its identity (size, mtime, ctime, inode and device)
and the sha256 taken of it; it vouches for that sha256 only while the file at that path still has
that identity. Any write to a file changes its ctime, which no user can set back (`os.utime` sets
mtime, not ctime), so a file edited after it was hashed, even one whose size and mtime were put back,
is hashed again; a file copied or moved elsewhere is another path or inode, and is hashed again too.
A cache is a speed-up, never a record: losing it, or a torn one, costs one more hash. What must
prove a file independently (`runner audit`) never reads it.
Never: hashes a file itself, or decides what a mismatch means (its callers do).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from runner.fsio import fsync_dir


def cache_dir() -> Path:
    """Where the caches live (see the module docstring)."""
    if os.environ.get("RUNNER_CACHE_DIR"):
        return Path(os.environ["RUNNER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "runner"


def identity(stat: os.stat_result) -> list[int]:
    """What a cached sha256 holds for: size, mtime, ctime (ns), inode and device."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


class HashCache:
    """One cache file: `vouched(path)` is the sha256 it holds for the file as it is now (None when it
    holds none, or the file changed since); `remember({path: sha256})` records files as they are now.
    The file is read once, when first asked."""

    def __init__(self, name: str, folder: Path | None = None):
        self.path = (cache_dir() if folder is None else Path(folder)) / name
        self._entries: dict | None = None
        self._lock = threading.Lock()

    def entries(self) -> dict:
        with self._lock:
            if self._entries is None:
                self._entries = _read(self.path)
            return self._entries

    def vouched(self, path: Path) -> str | None:
        entry = self.entries().get(str(Path(path).resolve()))
        if not isinstance(entry, dict):
            return None
        try:
            now = identity(Path(path).stat())
        except OSError:
            return None
        digest = entry.get("sha256")
        return digest if entry.get("identity") == now and isinstance(digest, str) else None

    def remember(self, hashed: Mapping[Path, tuple[str, os.stat_result]]) -> None:
        """Record each file's sha256 with its identity as it was stat'ed when hashed (before the
        hashing, or once written by the process that hashed it while writing): a file changed since
        has another ctime and is never vouched for. Best effort (see `_merge`)."""
        verified = {
            str(Path(path).resolve()): {"identity": identity(stat), "sha256": digest}
            for path, (digest, stat) in hashed.items()
        }
        if verified:
            with self._lock:
                self._entries = None  # read again next time: other processes may have written since
            _merge(self.path, verified)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or torn by a concurrent writer: hash again
    return data if isinstance(data, dict) else {}


def _merge(path: Path, verified: dict) -> None:
    """Merge `verified` into the cache file (entries of files that are gone are dropped). Best effort:
    several processes may write at once, each through its own temp file, the last rename wins."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {k: v for k, v in _read(path).items() if os.path.exists(k)}
        merged.update(verified)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError:
        return  # a read-only home: every reader hashes again, nothing else changes
