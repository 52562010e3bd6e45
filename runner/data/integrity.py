"""Data read is data pinned: every shard a launch maps is hashed once against its manifest.

Owns the launch-time shard verification (a background thread streams each shard through sha256
while training starts; the loop waits for it before the run's first checkpoint, so no checkpoint,
report or finished status ever rests on a shard that differs from its pin) and the cache of shards
already verified, so a resume, or another run over the same data, does not hash them again.

The cache is one JSON file per user and machine: `$RUNNER_CACHE_DIR/verified-shards.json`, by
default `$XDG_CACHE_HOME/runner/` (`~/.cache/runner/`). An entry holds a shard's resolved path,
size, mtime, ctime, inode and the sha256 it matched; it counts only while all of them still hold
and the manifest pins that same sha256. Any write to a file changes its ctime, which no user can
set back, so a shard edited after it was verified is hashed again. The cache is a speed-up, never
a record: losing it costs one more hash. Never decides what is trained and never reads tokens for
training.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runner.errors import RunnerError, display_path
from runner.fsio import fsync_dir

CACHE_FILE = "verified-shards.json"
_BLOCK_BYTES = 8 << 20  # 8 MiB reads: hashlib releases the GIL on blocks this size


def cache_dir() -> Path:
    """Where the verification cache lives (see the module docstring)."""
    if os.environ.get("RUNNER_CACHE_DIR"):
        return Path(os.environ["RUNNER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "runner"


@dataclass(frozen=True)
class _Item:
    path: Path
    sha256: str
    manifest: Path


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


class ShardVerifier:
    """Hashes every shard of `manifests` not already in the cache, in a daemon thread.

    `failure()` is the first mismatch found so far (non-blocking); `wait()` blocks until every shard
    is checked and raises that failure. `summary()` says what was verified and how."""

    def __init__(self, manifests: Iterable, cache: Path | None = None):
        self.cache_path = (cache_dir() if cache is None else Path(cache)) / CACHE_FILE
        items: dict[Path, _Item] = {}
        manifests_list = list(manifests)
        for m in manifests_list:
            for shard in (*m.shards, *m.validation_shards):
                items.setdefault(Path(shard.path).resolve(), _Item(Path(shard.path), shard.sha256, m.path))
        self.items = list(items.values())
        self.bytes_expected = sum(
            s.tokens * m.dtype.itemsize for m in manifests_list for s in (*m.shards, *m.validation_shards)
        )
        self.bytes_total = 0
        self.bytes_hashed = 0
        self.shards_cached = 0
        self.seconds = 0.0
        self.announced = False  # whether the launch has printed summary() yet
        self._failure: RunnerError | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> ShardVerifier:
        self._thread = threading.Thread(target=self._run, name="shard-verifier", daemon=True)
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def failure(self) -> RunnerError | None:
        return self._failure

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            raise self._failure

    def join(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds; whether every shard is checked (a mismatch included)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done()

    def progress(self) -> str:
        return (
            f"{self.bytes_total / 1e9:,.2f} of {self.bytes_expected / 1e9:,.2f} GB of shards checked "
            f"({self.bytes_hashed / 1e9:,.2f} GB hashed so far)"
        )

    def stop(self) -> None:
        """Stop after the current block (the run ended first), caching what was verified so far."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self) -> str:
        return (
            f"data: {len(self.items)} shards ({self.bytes_total / 1e6:,.1f} MB) match their manifests' sha256: "
            f"{len(self.items) - self.shards_cached} hashed ({self.bytes_hashed / 1e6:,.1f} MB in {self.seconds:.1f} s), "
            f"{self.shards_cached} unchanged since verified (cache {display_path(self.cache_path)})"
        )

    # ---- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        t0 = time.perf_counter()
        cache = _read_cache(self.cache_path)
        verified = {}
        try:
            for item in self.items:
                key = str(item.path.resolve())
                stat = item.path.stat()
                entry = cache.get(key)
                if entry == {"identity": _identity(stat), "sha256": item.sha256}:
                    self.shards_cached += 1
                    self.bytes_total += stat.st_size
                    continue
                actual = self._hash(item.path)
                if actual is None:  # stopped
                    return
                if actual != item.sha256:
                    self._failure = RunnerError(
                        f"sha256 is {actual}, but {display_path(item.manifest)} pins {item.sha256}: the shard "
                        "changed after prepare (restore it, or prepare the data again and pin the new manifest)",
                        file=str(item.path),
                    )
                    return
                verified[key] = {"identity": _identity(item.path.stat()), "sha256": actual}
                self.bytes_total += stat.st_size
        except OSError as e:
            self._failure = RunnerError(f"cannot read shard: {e.strerror}", file=e.filename)
        except Exception as e:  # fail closed: a verifier that died unverified must not read as a pass
            self._failure = RunnerError(f"shard verification stopped: {type(e).__name__}: {e}")
        finally:
            self.seconds = time.perf_counter() - t0
            if verified:
                _write_cache(self.cache_path, verified)

    def _hash(self, path: Path) -> str | None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_BLOCK_BYTES):
                if self._stop.is_set():
                    return None
                h.update(block)
                self.bytes_hashed += len(block)
        return h.hexdigest()


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or torn by a concurrent writer: hash again
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, verified: dict) -> None:
    """Merge `verified` into the cache (entries of files that are gone are dropped). Best effort:
    several processes may write at once, each through its own temp file, the last rename wins."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {k: v for k, v in _read_cache(path).items() if os.path.exists(k)}
        merged.update(verified)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(merged, indent=0, sort_keys=True))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError:
        return  # a read-only home: every launch hashes again, nothing else changes
