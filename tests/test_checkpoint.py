"""Checkpoints: atomic and verified files, fallback past a corrupt one, bit-identical resume after SIGKILL."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from timeouts import TEST_TIMEOUT_S
from trainfixtures import env, launch, make_project

from runner.fsio import read_jsonl, sha256_file
from runner.training.checkpoint import (
    Checkpointer,
    flatten_optimizer,
    gather_full_state,
    rng_state,
    set_rng_state,
    unflatten_optimizer,
)

STEPS = 16
COUNTS = ("exposure", "useful", "unique")


def final_weights(run: Path, step: int) -> str:
    return sha256_file(run / "checkpoints" / f"step-{step:07d}" / "model.safetensors")


def counters(run: Path) -> dict:
    return json.loads((run / "ledger.json").read_text())["counters"]


def _tiny_state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(ck, step, model, opt):
    model_state, optim_state = gather_full_state(model, opt)
    return ck.save(step, model_state, optim_state, {"counts": np.arange(3, dtype=np.uint8)}, {"fingerprint": "f"})


def test_optimizer_and_rng_roundtrip_without_pickle():
    model, opt = _tiny_state()
    tensors, index = flatten_optimizer(opt.state_dict())
    json.dumps(index)  # the index is plain JSON
    back = unflatten_optimizer(tensors, index)
    for pid, entry in opt.state_dict()["state"].items():
        for k, v in entry.items():
            assert torch.equal(back["state"][pid][k], v)
    state = json.loads(json.dumps(rng_state()))
    a = (torch.rand(3), np.random.rand(), random.random())
    set_rng_state(state)
    b = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_save_verify_prune_and_skip_unfinished(tmp_path):
    model, opt = _tiny_state()
    ck = Checkpointer(tmp_path, interval_steps=2, interval_minutes=0, keep_last=2)
    assert ck.due(4) and not ck.due(3)
    for step in (2, 4, 6):
        _save(ck, step, model, opt)
    assert [p.name for p in ck.candidates()] == ["step-0000006", "step-0000004"]  # last 2 kept
    (tmp_path / "checkpoints" / "step-0000006" / "COMPLETE").unlink()  # killed before the marker
    seen = []
    got = ck.latest_valid(report=seen.append)
    assert got.step == 4 and seen == ["checkpoint step-0000006 unusable (no COMPLETE marker); trying the previous one"]
    restored, restored_opt = _tiny_state(seed=1)
    got.load_into(restored, restored_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))
    for a, b in zip(opt.state.values(), restored_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert got.ledger_state()["counts"].tolist() == [0, 1, 2]
    assert got.format == 2 and "0.weight" in got.optimizer_state()["state"]  # keyed by name, not index


def test_tied_weights_are_written_and_read_back(tmp_path):
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight  # tied, as llama-tiny's embeddings
    tied = torch.nn.ModuleDict({"emb": emb, "head": head})
    topt = torch.optim.AdamW(tied.parameters(), lr=0.1)
    head(emb(torch.tensor([1, 2]))).sum().backward()
    topt.step()
    path = _save(Checkpointer(tmp_path, 1, 0, 1), 1, tied, topt)
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    fresh["head"].weight = fresh["emb"].weight
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    Checkpointer(tmp_path, 1, 0, 1).latest_valid().load_into(fresh, fopt)
    assert path.name == "step-0000001" and torch.equal(fresh["emb"].weight, emb.weight)
    assert fresh["head"].weight is fresh["emb"].weight


def test_format_1_checkpoints_of_older_runs_still_load(tmp_path):
    from safetensors.torch import save_file, save_model

    model, opt = _tiny_state()
    path = _save(Checkpointer(tmp_path, 1, 0, 1), 1, model, opt)
    # Rewrite it as the previous release did: save_model, optimizer keyed by parameter index, no format.
    save_model(model, str(path / "model.safetensors"))
    tensors, index = flatten_optimizer(opt.state_dict())
    save_file(tensors, str(path / "optimizer.safetensors"))
    (path / "optimizer.json").write_text(json.dumps(index))
    state = json.loads((path / "state.json").read_text())
    state.pop("format")
    state["files"] = {name: sha256_file(path / name) for name in state["files"]}
    (path / "state.json").write_text(json.dumps(state))
    got = Checkpointer(tmp_path, 1, 0, 1).latest_valid()
    restored, restored_opt = _tiny_state(seed=1)
    got.load_into(restored, restored_opt)
    assert got.format == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], restored_opt.state[restored[0].weight]["exp_avg"])


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    exp = make_project(tmp_path, steps=8, checkpoint_every=2, keep_last=5)
    run = tmp_path / "runs" / "c"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 6, "--no-tracking")
    newest = run / "checkpoints" / "step-0000006" / "optimizer.safetensors"
    newest.write_bytes(newest.read_bytes()[:-10])  # truncated
    proc = launch(tmp_path, run, "--no-tracking")
    assert "step-0000006 unusable (optimizer.safetensors sha256 mismatch)" in proc.stderr
    assert "resuming from step-0000004" in proc.stderr
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sigkill_anywhere_then_resume_is_bit_identical(tmp_path):
    ref = tmp_path / "runs" / "ref"
    exp = make_project(tmp_path, steps=STEPS, checkpoint_every=1, keep_last=3)
    launch(tmp_path, exp, "--run-dir", ref, "--no-tracking")
    run = tmp_path / "runs" / "k"
    # A kill in the middle of a step (after a micro batch was processed, before its commit) ...
    proc = launch(tmp_path, exp, "--run-dir", run, "--kill-at-step", 3, "--no-tracking", check=False)
    assert proc.returncode == -signal.SIGKILL
    # ... then kills at random moments (mid-step, mid-checkpoint-write, mid-eval).
    rng = random.Random(0)
    journal = run / "journal" / "processed.jsonl"
    for _ in range(2):
        before = journal.read_text().count("\n")
        p = subprocess.Popen(
            [sys.executable, "-m", "runner", "launch", str(run), "--no-tracking"],
            cwd=tmp_path,
            env=env(tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while p.poll() is None and journal.read_text().count("\n") == before:
            time.sleep(0.01)  # training of this attempt has started
        time.sleep(rng.uniform(0.0, 0.4))
        p.kill()
        p.wait()
    launch(tmp_path, run, "--no-tracking")
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert final_weights(run, STEPS) == final_weights(ref, STEPS)
    a, b = counters(ref), counters(run)
    for d in a:
        assert {k: a[d][k] for k in COUNTS} == {k: b[d][k] for k in COUNTS}
    assert b["total"]["processed"] > a["total"]["processed"]  # the killed step's work was spent...
    assert b["total"]["lost"] == b["total"]["processed"] - b["total"]["exposure"] > 0  # ...and lost
    journal = read_jsonl(run / "journal" / "processed.jsonl")
    assert sum(sum(e["processed"].values()) for e in journal) == b["total"]["processed"]


def test_save_removes_incomplete_and_temporary_folders(tmp_path):
    model, opt = _tiny_state()
    ck = Checkpointer(tmp_path, interval_steps=2, interval_minutes=0, keep_last=2)
    for step in (2, 4, 6):
        _save(ck, step, model, opt)
    root = tmp_path / "checkpoints"
    (root / "step-0000006" / "COMPLETE").unlink()  # lost its marker: a resume falls back past it
    (root / ".tmp-step-0000010-12345").mkdir()  # left by a kill mid-write
    assert ck.latest_valid(report=lambda m: None).step == 4
    _save(ck, 8, model, opt)
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004", "step-0000008"]


@pytest.mark.slow
def test_step_time_of_lost_work_is_counted_so_mfu_is_not_overstated(tmp_path):
    # Checkpoints only at the end: a kill at step 6 loses five committed steps and part of the sixth.
    exp = make_project(tmp_path, steps=8, checkpoint_every=100)
    run = tmp_path / "runs" / "k"
    proc = launch(tmp_path, exp, "--run-dir", run, "--kill-at-step", 6, "--no-tracking", check=False)
    assert proc.returncode == -signal.SIGKILL
    lost_attempt = read_jsonl(run / "journal" / "processed.jsonl")
    spent_before_kill = max(e["step_seconds_total"] for e in lost_attempt)
    step_rows = read_jsonl(run / "metrics" / "train.jsonl")
    assert spent_before_kill >= sum(r["step_seconds"] for r in step_rows) > 0
    launch(tmp_path, run, "--no-tracking")
    info = json.loads((run / "run.json").read_text())
    retrained = [r for r in read_jsonl(run / "metrics" / "train.jsonl")][len(step_rows) :]
    # The run's step time is the lost attempt's plus every step of the resumed one.
    assert info["step_seconds_total"] >= spent_before_kill + sum(r["step_seconds"] for r in retrained) - 1e-3
    c = counters(run)["total"]
    assert c["lost"] > 0
    expected = (
        info["flops_per_token"]
        * c["processed"]
        / (info["step_seconds_total"] * info["conventions"]["peak_tflops"] * 1e12 * info["devices"])
    )
    assert info["mfu"] == __import__("pytest").approx(expected, rel=1e-9)


def test_ranks_that_see_different_checkpoints_are_refused_naming_them(tmp_path):
    from runner.errors import RunnerError
    from runner.training.loop import check_same_checkpoint

    check_same_checkpoint([40, 40, 40, 40], tmp_path)
    check_same_checkpoint([-1], tmp_path)
    # Node 2 (ranks 2-3) holds its own copy of the run folder, without the newest checkpoints.
    try:
        check_same_checkpoint([40, 40, -1, -1], tmp_path)
    except RunnerError as e:
        assert "rank 0: step 40, rank 1: step 40, rank 2: none, rank 3: none" in str(e)
        assert "storage every node shares" in str(e) and str(tmp_path) in str(e)
    else:
        raise AssertionError("different checkpoints across ranks must be refused")
