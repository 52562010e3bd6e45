"""Step time on the device's clock (read after the device finished the step, one sync per optimizer step)
and what each checkpoint cost (t_checkpoint)."""

from __future__ import annotations

import json

import pytest
from trainfixtures import launch, make_project

from runner.fsio import read_jsonl
from runner.training import loop
from runner.training.accelerator import StepClock


@pytest.mark.slow  # a launch: ~8 s on a loaded core
def test_step_time_is_read_on_the_device_clock_once_per_optimizer_step(tmp_path, monkeypatch):
    device = {"now": 0.0, "syncs": 0}

    def sync():  # an asynchronous device: its queued work (the optimizer's too) takes 0.25 s to finish
        device["syncs"] += 1
        device["now"] += 0.25

    monkeypatch.setattr(loop, "step_clock", lambda d: StepClock(d, sync=sync, now=lambda: device["now"]))
    exp = make_project(tmp_path, steps=3, checkpoint_every=3, eval_every=3)  # 2 micro batches per step
    launch(tmp_path, exp, "--run-dir", tmp_path / "run", "--no-tracking")
    assert device["syncs"] == 3  # once per optimizer step, never per micro batch
    rows = read_jsonl(tmp_path / "run" / "metrics" / "train.jsonl")
    assert [r["step_seconds"] for r in rows] == [0.25, 0.25, 0.25]
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["step_seconds_total"] == 0.75
    assert info["conventions"]["step_clock"] == "device" and info["conventions"]["time_basis"] == "step"
    assert "step_clock" not in info["conventions_goodput"]  # wall time has no step clock
    # what each checkpoint cost the loop (host clock: the copy to host memory; the write runs behind it)
    assert [(c["step"], c["attempt"]) for c in info["checkpoints"]] == [(3, 1)] and info["checkpoints"][0][
        "t_checkpoint"
    ] > 0
