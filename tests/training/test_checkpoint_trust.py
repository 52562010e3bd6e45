"""A resume trusts the files the checkpoint writer hashed while writing them (runner.hashcache's rule,
the data cache's): it hashes none of them again while each keeps its path, size, mtime, ctime, inode
and device; a file changed since is hashed again, and a forged one is refused; the audit's
verification hashes every file whatever the cache says."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from trainfixtures import launch, make_project

from runner.runs import checkpoints
from runner.runs.checkpoints import FILES, verified_state
from runner.training.checkpoint import Checkpointer, gather_full_state

BIG = ("model.safetensors", "optimizer.safetensors")


@pytest.fixture()
def hashed(monkeypatch) -> list[str]:
    """The names of the files checkpoint verification hashes, in order."""
    seen: list[str] = []
    real = checkpoints.sha256_file

    def spy(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(checkpoints, "sha256_file", spy)
    return seen


def _write(run: Path, *steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    writer = Checkpointer(run, interval_steps=2, interval_minutes=0, keep_last=3)
    for step in steps:
        model_state, optim_state = gather_full_state(model, opt)
        writer.save(step, model_state, optim_state, {"counts": np.arange(3, dtype=np.uint8)}, {"fingerprint": "f"})


def _resume(run: Path, said: list[str] | None = None):
    """What a resume does in a process of its own: a new Checkpointer finds the newest that verifies."""
    return Checkpointer.reader(run).latest_valid(report=(said if said is not None else []).append)


def test_a_resume_hashes_none_of_the_files_its_writer_hashed_and_the_audit_hashes_them_all(tmp_path, hashed):
    _write(tmp_path, 2)
    assert _resume(tmp_path).step == 2
    assert hashed == ["state.json"]  # against the seal; no file state.json lists
    hashed.clear()
    state, problem = verified_state(tmp_path / "checkpoints" / "step-0000002")  # the audit's, export's
    assert problem is None and state is not None
    assert set(hashed) == {"state.json", *FILES}


def test_a_file_touched_since_is_hashed_again_and_a_forged_one_refused(tmp_path, hashed):
    _write(tmp_path, 2, 4)
    newest = tmp_path / "checkpoints" / "step-0000004"
    time.sleep(0.05)  # past the file system's coarse timestamp tick
    os.utime(newest / "model.safetensors")  # same bytes, new mtime and ctime
    assert _resume(tmp_path).step == 4
    assert [n for n in hashed if n in FILES] == ["model.safetensors"]  # only the touched file

    hashed.clear()
    forged = newest / "optimizer.safetensors"
    stat = forged.stat()
    data = bytearray(forged.read_bytes())
    data[-1] ^= 0xFF  # a flipped byte of a tensor: same size
    time.sleep(0.05)
    forged.write_bytes(bytes(data))
    os.utime(forged, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # size and mtime as sealed: only the ctime tells
    said: list[str] = []
    assert _resume(tmp_path, said).step == 2  # refused; the previous checkpoint, still vouched for
    assert said == ["checkpoint step-0000004 unusable (optimizer.safetensors sha256 mismatch); trying the previous one"]
    assert "optimizer.safetensors" in hashed


def test_a_checkpoint_this_machine_did_not_write_is_hashed_whole(tmp_path, hashed, monkeypatch):
    _write(tmp_path, 2)
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "another-machine"))  # its own, empty, cache
    assert _resume(tmp_path).step == 2
    assert set(hashed) == {"state.json", *FILES}


def test_a_launch_resumed_from_its_checkpoint_reads_no_large_file_to_verify_it(tmp_path, hashed):
    exp = make_project(tmp_path, steps=4, checkpoint_every=2, eval_every=4)
    run = tmp_path / "runs" / "r"
    launch(tmp_path, exp, "--run-dir", run, "--no-tracking", "--max-steps", "2")
    hashed.clear()
    resumed = launch(tmp_path, run, "--no-tracking")
    assert "resuming from step-0000002" in resumed.stderr
    assert not [n for n in hashed if n in BIG]
