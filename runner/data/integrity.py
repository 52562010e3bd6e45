"""Data read is data pinned: every shard a launch maps is hashed once against its manifest.

Owns the launch-time shard verification (a background thread streams each shard through sha256
while training starts; the loop waits for it before the run's first checkpoint, so no checkpoint,
report or finished status ever rests on a shard that differs from its pin) and the cache of shards
already verified, so a resume, or another run over the same data, does not hash them again.

The cache is `verified-shards.json` in the runner's cache folder, under runner.hashcache's trust
rule (an entry holds a shard's resolved path, size, mtime, ctime, inode and device and the sha256
it matched, and vouches only while they all still hold): a shard counts as verified without hashing
when the cache vouches for the very sha256 its manifest pins. A shard edited after it was verified
is hashed again. Never decides what is trained and never reads tokens for training.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runner.errors import RunnerError, display_path
from runner.hashcache import HashCache

CACHE_FILE = "verified-shards.json"
_BLOCK_BYTES = 8 << 20  # 8 MiB reads: hashlib releases the GIL on blocks this size


@dataclass(frozen=True)
class _Item:
    path: Path
    sha256: str
    manifest: Path


class ShardVerifier:
    """Hashes every shard of `manifests` not already in the cache, in a daemon thread.

    `failure()` is the first mismatch found so far (non-blocking); `wait()` blocks until every shard
    is checked and raises that failure. `summary()` says what was verified and how."""

    def __init__(self, manifests: Iterable, cache: Path | None = None):
        self.cache = HashCache(CACHE_FILE, cache)
        self.cache_path = self.cache.path
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
        verified: dict[Path, tuple[str, os.stat_result]] = {}
        try:
            for item in self.items:
                stat = item.path.stat()  # before the hash: a write during it changes the ctime
                if self.cache.vouched(item.path) == item.sha256:
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
                verified[item.path] = (actual, stat)
                self.bytes_total += stat.st_size
        except OSError as e:
            self._failure = RunnerError(f"cannot read shard: {e.strerror}", file=e.filename)
        except Exception as e:  # fail closed: a verifier that died unverified must not read as a pass
            self._failure = RunnerError(f"shard verification stopped: {type(e).__name__}: {e}")
        finally:
            self.seconds = time.perf_counter() - t0
            if verified:
                self.cache.remember(verified)

    def _hash(self, path: Path) -> str | None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_BLOCK_BYTES):
                if self._stop.is_set():
                    return None
                h.update(block)
                self.bytes_hashed += len(block)
        return h.hexdigest()
