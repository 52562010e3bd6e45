"""Checkpoints written behind the loop: the state is copied to host memory at the step boundary, a thread
writes and hashes it while training goes on, the next checkpoint waits for it, run.json records what ran
(the loop's stop and the write's own time, and the thread that wrote), and a SIGKILL mid-write leaves the
previous checkpoint to resume from, bit-identically."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trainfixtures import env, launch, make_project

from runner.config.load import load_experiment
from runner.errors import RunnerError
from runner.fsio import sha256_file
from runner.planning.flops import params_of_config
from runner.planning.resources import host_gather_bytes
from runner.training import loop
from runner.training.checkpoint import (
    BackgroundWriter,
    Checkpointer,
    gather_full_state,
    host_copy,
    state_bytes,
    training_tensors,
)
from runner.training.model import build_model
from runner.training.schedule import make_optimizer

STEPS, EVERY = 6, 2  # checkpoints at 2 and 4 with steps after them, and at 6, the end
HELD = 0.2  # seconds a write behind the loop goes on after the next checkpoint began waiting for it
FILES = ("model.safetensors", "optimizer.safetensors", "ledger.safetensors")
REPO = Path(__file__).resolve().parents[2]


def _files(run: Path, step: int) -> dict[str, str]:
    return {name: sha256_file(run / "checkpoints" / f"step-{step:07d}" / name) for name in FILES}


class _Watch:
    """Sees, from inside Checkpointer.save, which thread writes and which steps the loop committed
    meanwhile. A write behind the loop holds its files back until the loop committed the next step
    (so training has changed every parameter the write is about to store)."""

    def __init__(self, monkeypatch):
        self.committed = 0
        self.advanced = threading.Condition()
        self.seen: dict[int, dict] = {}
        self.loop_waits = threading.Event()  # the loop's thread is waiting for the write in flight
        real_save, real_commit, real_wait = Checkpointer.save, loop._commit, BackgroundWriter.wait

        def wait(writer):
            if writer.busy and threading.current_thread() is threading.main_thread():
                self.loop_waits.set()
            return real_wait(writer)

        def commit(run, step, s):
            committed = real_commit(run, step, s)
            with self.advanced:
                self.committed = committed
                self.advanced.notify_all()
            return committed

        def save(checkpointer, step, *args, **kwargs):
            behind = threading.current_thread() is not threading.main_thread()
            if behind and step < STEPS:
                with self.advanced:
                    self.advanced.wait_for(lambda: self.committed > step, timeout=TEST_TIMEOUT_S)
                # ... and until the next checkpoint waits for it, then HELD s more: a disk slower than the
                # checkpoints come, which the next one's t_checkpoint_waited records
                assert self.loop_waits.wait(timeout=TEST_TIMEOUT_S)
                self.loop_waits.clear()
                time.sleep(HELD)
            committed_before = self.committed
            out = real_save(checkpointer, step, *args, **kwargs)
            self.seen[step] = {
                "written": "background" if behind else "foreground",
                "committed_meanwhile": committed_before - step,
            }
            return out

        monkeypatch.setattr(loop, "_commit", commit)
        monkeypatch.setattr(Checkpointer, "save", save)
        monkeypatch.setattr(BackgroundWriter, "wait", wait)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One experiment trained twice, its checkpoints written in the loop and behind it (watched)."""
    root = tmp_path_factory.mktemp("background")
    out = {}
    for mode in ("foreground", "background"):
        exp = make_project(
            root / mode,
            steps=STEPS,
            checkpoint_every=EVERY,
            keep_last=5,
            train_extra={"checkpoint": {"interval_steps": EVERY, "interval_minutes": 0, "keep_last": 5, "write": mode}},
        )
        with pytest.MonkeyPatch.context() as mp:
            watch = _Watch(mp)
            launch(root / mode, exp, "--run-dir", root / mode / "run", "--no-tracking")
        out[mode] = (root / mode, exp, root / mode / "run", watch.seen)
    return out


@pytest.mark.slow  # two launches (~6 s on a loaded core), shared with the SIGKILL test
def test_a_background_write_lets_training_go_on_and_run_json_records_what_ran(runs):
    *_, fg_run, fg_seen = runs["foreground"]
    *_, bg_run, bg_seen = runs["background"]
    for run, seen, mode in ((fg_run, fg_seen, "foreground"), (bg_run, bg_seen, "background")):
        info = json.loads((run / "run.json").read_text())
        assert info["runtime"]["checkpoint_write"] == mode and info["status"] == "finished"
        # beside it, how the loop's copy was taken and why (a CPU: the pageable host copy)
        assert info["runtime"]["checkpoint_copy"] == "pageable"
        assert info["runtime"]["checkpoint_copy_note"].startswith("pageable: the device is the host")
        entries = {c["step"]: c for c in info["checkpoints"]}
        assert sorted(entries) == sorted(seen) == [2, 4, 6]
        for step, entry in entries.items():
            assert entry["checkpoint_write"] == seen[step]["written"] == mode  # recorded = the thread that wrote
            assert entry["t_checkpoint"] > 0 and entry["t_checkpoint_write"] > 0
    # In the loop, nothing trains while a checkpoint is written and the loop's stop holds the write;
    # behind it, the next step was committed before the files were written, outside the loop's stop.
    fg = {c["step"]: c for c in json.loads((fg_run / "run.json").read_text())["checkpoints"]}
    bg = {c["step"]: c for c in json.loads((bg_run / "run.json").read_text())["checkpoints"]}
    for step in (2, 4):
        assert fg_seen[step]["committed_meanwhile"] == 0 and fg[step]["t_checkpoint"] >= fg[step]["t_checkpoint_write"]
        assert bg_seen[step]["committed_meanwhile"] >= 1
    # the first one waited for no earlier write: its stop is the copy, shorter than a step and the write
    assert bg[2]["t_checkpoint"] < bg[2]["t_checkpoint_write"] and bg[2]["t_checkpoint_waited"] == 0
    # the next ones waited for the write before them (held HELD s past their start): part of their stop,
    # recorded apart; in the loop there is never a write in flight to wait for
    for step in (4, 6):
        assert HELD <= bg[step]["t_checkpoint_waited"] <= bg[step]["t_checkpoint"], bg[step]
    assert all(c["t_checkpoint_waited"] == 0 for c in fg.values())
    # ... and still wrote the state of its own step: the host copy, not the parameters training moved on.
    for step in (2, 4, 6):
        assert _files(bg_run, step) == _files(fg_run, step)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sigkill_mid_background_write_leaves_the_previous_checkpoint_and_resumes_bit_identically(runs):
    root, exp, reference, _ = runs["background"]
    run = root / "killed"
    # The write of step 4 dies after its model file, once training moved on to step 5 (a real SIGKILL).
    driver = root / "kill_mid_write.py"
    driver.write_text(KILL_MID_WRITE_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(driver), "launch", str(exp), "--run-dir", str(run), "--no-tracking"],
        cwd=root,
        env=env(root),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ckpts = run / "checkpoints"
    assert [p.name for p in ckpts.glob(".tmp-step-0000004-*")] and not (ckpts / "step-0000004").exists()
    info = json.loads((run / "run.json").read_text())
    assert info["committed_steps"] == 2 and [c["step"] for c in info["checkpoints"]] == [2]  # sealed ones only
    resumed = launch(root, run, "--no-tracking")
    assert "resuming from step-0000002 (step 2)" in resumed.stderr
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    weights = ("model.safetensors", "optimizer.safetensors")
    assert [_files(run, STEPS)[f] for f in weights] == [_files(reference, STEPS)[f] for f in weights]
    ours, ref = (json.loads((r / "ledger.json").read_text())["counters"]["total"] for r in (run, reference))
    assert {k: ours[k] for k in ("exposure", "useful", "unique")} == {
        k: ref[k] for k in ("exposure", "useful", "unique")
    }
    assert ours["lost"] > 0  # steps 3-5 trained twice: the killed attempt's work after step 2 is counted as lost


# Kills its own process from the writer thread, in the write of step 4 after model.safetensors, once the
# loop committed step 5: a crash mid-write while training goes on.
KILL_MID_WRITE_DRIVER = """
import os, signal, sys, threading
import runner.training.checkpoint as ck
import runner.training.loop as loop

real_fsync, real_commit, state = ck.fsync_file, loop._commit, {"committed": 0}
advanced = threading.Condition()

def commit(run, step, s):
    committed = real_commit(run, step, s)
    with advanced:
        state["committed"] = committed
        advanced.notify_all()
    return committed

def fsync_file(path):
    real_fsync(path)
    if ".tmp-step-0000004" in str(path) and str(path).endswith("model.safetensors"):
        with advanced:
            advanced.wait_for(lambda: state["committed"] >= 5)
        os.kill(os.getpid(), signal.SIGKILL)

loop._commit, ck.fsync_file = commit, fsync_file
from runner.cli import main
sys.exit(main(sys.argv[1:]))
"""


# ---- the parts, without a launch --------------------------------------------------------------------


def _trained(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = make_optimizer(model, cfg, fused=False)
    ids = torch.randint(0, cfg.tokenizer.vocab_size, (2, 8))
    model(input_ids=ids, loss_targets=ids, loss_mask=torch.ones_like(ids)).backward()
    optimizer.step()
    return model, optimizer


def test_the_host_copy_is_the_steps_state_and_what_validate_counts():
    cfg = load_experiment(REPO / "experiments" / "cpu-tiny.yaml", check_files=False).config
    model, optimizer = _trained(cfg)
    gathered = gather_full_state(model, optimizer)
    live = training_tensors(model, optimizer)
    model_state, optim_state = host_copy(*gathered, live)
    owned = {t.untyped_storage().data_ptr() for t in live}
    copied = [t for t in model_state.values()] + [
        v for entry in optim_state["state"].values() for v in entry.values() if torch.is_tensor(v)
    ]
    assert not any(t.untyped_storage().data_ptr() in owned for t in copied)  # none is training's memory
    before = {k: v.clone() for k, v in model_state.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on
    for group in optimizer.param_groups:
        group["lr"] = 123.0
    assert all(torch.equal(before[k], model_state[k]) for k in before)
    assert all(g["lr"] != 123.0 for g in optim_state["param_groups"])
    # a tied matrix is copied once, and the copy is what validate refuses a host for (12 B/param)
    assert model_state["lm_head.weight"].data_ptr() == model_state["model.embed_tokens.weight"].data_ptr()
    held = state_bytes(model_state, optim_state)
    assert params_of_config(cfg).all == sum(p.numel() for p in model.parameters())
    assert host_gather_bytes(cfg) <= held <= host_gather_bytes(cfg) * 1.001  # + AdamW's step counters


def test_host_copy_keeps_what_the_gather_already_copied():
    private = {"w": torch.randn(4, 4)}  # the gather's own copy (cpu_offload): copying it again doubles the host
    out, _ = host_copy(private, {"state": {}, "param_groups": []}, live=[torch.zeros(1)])
    assert out["w"].data_ptr() == private["w"].data_ptr()  # the same memory, not a second copy


def test_a_failed_background_write_is_raised_where_the_loop_waits_and_foreground_writes_in_the_caller():
    writer = BackgroundWriter("background")
    threads = []

    def fail():
        threads.append(threading.current_thread())
        raise RunnerError("cannot write checkpoint step-0000002: No space left on device", file="checkpoints")

    writer.submit(fail)
    with pytest.raises(RunnerError, match="No space left"):
        writer.wait()
    assert threads[0] is not threading.main_thread() and writer.wait() == 0.0  # raised once
    writer.submit(fail)
    with pytest.raises(RunnerError):
        writer.submit(lambda: None)  # the next checkpoint waits for the previous one first
    inline = BackgroundWriter("foreground")
    inline.submit(lambda: threads.append(threading.current_thread()))
    assert threads[-1] is threading.main_thread()
    with pytest.raises(RunnerError, match="train.checkpoint.write"):
        BackgroundWriter("later")
