"""Two CPU processes (torchrun, gloo) train the same run as one process: same ledger, same losses."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from safetensors.torch import load_file

from runner.fsio import read_jsonl
from trainfixtures import env, launch, make_project


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_two_processes_match_one(tmp_path):
    exp = make_project(tmp_path, steps=6, checkpoint_every=3, eval_every=3)
    launch(tmp_path, exp, "--run-dir", "runs/one", "--no-tracking")
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "runner", "launch", str(exp),
                           "--run-dir", "runs/two", "--no-tracking"], cwd=tmp_path, env=env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = tmp_path / "runs" / "one", tmp_path / "runs" / "two"
    info = json.loads((two / "run.json").read_text())
    assert info["world_size"] == 2
    # The recipe plans 1 device; the run held 2: that is what run.json, MFU and cost count.
    assert info["devices"] == 2 and info["conventions"]["devices_counted"] == 2
    assert proc.stderr.count("warning: running on 2 devices (world size)") == 1
    assert json.loads((one / "ledger.json").read_text()) == json.loads((two / "ledger.json").read_text())
    for name in ("train.jsonl", "eval.jsonl"):
        a, b = read_jsonl(one / "metrics" / name), read_jsonl(two / "metrics" / name)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            key = "loss" if name == "train.jsonl" else "loss_nats"
            assert x[key] == pytest.approx(y[key], rel=1e-5)
    wa = load_file(str(one / "checkpoints" / "step-0000006" / "model.safetensors"))
    wb = load_file(str(two / "checkpoints" / "step-0000006" / "model.safetensors"))
    for k in wa:
        assert (wa[k] - wb[k]).abs().max() < 1e-4
