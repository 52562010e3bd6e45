"""Data read is data pinned: a launch hashes every shard it maps, once, before its first checkpoint."""

from __future__ import annotations

import json
import os
import time

import pytest
from trainfixtures import launch, make_project

from runner.data.integrity import CACHE_FILE, ShardVerifier
from runner.data.manifest import load_manifest
from runner.errors import RunnerError


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))  # same size: the manifest's size check passes


@pytest.mark.slow
def test_a_flipped_byte_fails_the_launch_before_its_first_checkpoint(tmp_path):
    exp = make_project(tmp_path, steps=8, checkpoint_every=2)
    shard = tmp_path / "data" / "b" / "train-00000.bin"
    _flip_a_byte(shard)
    run = tmp_path / "runs" / "x"
    proc = launch(tmp_path, exp, "--run-dir", run, "--no-tracking", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: data/b/train-00000.bin: sha256 is ")
    assert "but data/b/manifest.json pins" in errors[0]
    assert not list((run / "checkpoints").glob("step-*"))  # no checkpoint rests on it
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and "data/b/train-00000.bin" in info["error"]


@pytest.mark.slow
def test_verified_shards_are_cached_so_a_resume_hashes_nothing(tmp_path):
    exp = make_project(tmp_path, steps=8, checkpoint_every=2)
    run = tmp_path / "runs" / "c"
    first = launch(tmp_path, exp, "--run-dir", run, "--max-steps", 4, "--no-tracking")
    assert "data: 4 shards" in first.stderr and "4 hashed" in first.stderr
    assert (tmp_path / "runner-cache" / CACHE_FILE).exists()  # RUNNER_CACHE_DIR (conftest)
    second = launch(tmp_path, run, "--no-tracking")
    assert "0 hashed (0.0 MB" in second.stderr and "4 unchanged since verified" in second.stderr


def test_the_cache_never_vouches_for_a_file_written_since(tmp_path):
    exp = make_project(tmp_path, steps=4)
    manifest = load_manifest(tmp_path / "data" / "a" / "manifest.json")
    cache = tmp_path / "cache"
    first = ShardVerifier([manifest], cache).start()
    first.wait()
    assert first.shards_cached == 0 and first.bytes_hashed == first.bytes_total > 0
    again = ShardVerifier([manifest], cache).start()
    again.wait()
    assert again.shards_cached == len(again.items) and again.bytes_hashed == 0
    shard = manifest.shards[0].path
    stat = shard.stat()
    time.sleep(0.05)  # past the file system's coarse timestamp tick
    _flip_a_byte(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime set back: only the ctime tells
    edited = ShardVerifier([manifest], cache).start()
    with pytest.raises(RunnerError, match=r"sha256 is [0-9a-f]{64}, but .*manifest.json pins"):
        edited.wait()
    assert exp.exists()
