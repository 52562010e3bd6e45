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
    assert got.format == 3 and "0.weight" in got.optimizer_state()["state"]  # keyed by name, not index


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
    state.pop("tied")
    state["files"] = {name: sha256_file(path / name) for name in state["files"]}
    (path / "state.json").write_text(json.dumps(state))
    (path / "COMPLETE").write_text(state["files"]["model.safetensors"] + "\n")  # the marker then held this
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
    from runner.training.collectives import check_same_checkpoint

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


# ---- integrity of state.json, pruning that never loses work (issue 12, items 3 and 4) ---------


def _edit_state(path: Path, reseal: bool = False, **fields) -> None:
    state = json.loads((path / "state.json").read_text())
    state.update(fields)
    for key in [k for k, v in fields.items() if v is None]:
        state.pop(key)
    (path / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))  # still valid JSON
    if reseal:  # a consistent forgery: the seal recomputed too
        (path / "COMPLETE").write_text(json.dumps({"format": 3, "state.json": sha256_file(path / "state.json")}))


@pytest.mark.slow
def test_an_edited_state_json_is_refused_as_damaged_and_the_run_falls_back(tmp_path):
    exp = make_project(tmp_path, steps=8, checkpoint_every=2, keep_last=5)
    run = tmp_path / "runs" / "s"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 6, "--no-tracking")
    newest = run / "checkpoints" / "step-0000006"
    _edit_state(newest, step_seconds_total=1e6)  # would silently change MFU if trusted
    proc = launch(tmp_path, run, "--no-tracking")
    assert "checkpoint step-0000006 unusable (state.json sha256 mismatch" in proc.stderr
    assert "resuming from step-0000004 (step 4)" in proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and 0 < info["step_seconds_total"] < 1e6


def test_state_json_of_another_step_is_refused_even_in_an_unsealed_format_2_checkpoint(tmp_path):
    model, opt = _tiny_state()
    ck = Checkpointer(tmp_path, 1, 0, 5)
    for step in (99, 100):
        _save(ck, step, model, opt)
    path = tmp_path / "checkpoints" / "step-0000100"
    _edit_state(path, step=99)
    seen = []
    assert Checkpointer(tmp_path, 1, 0, 5).latest_valid(report=seen.append).step == 99
    assert "state.json sha256 mismatch" in seen[0]
    # A format-2 checkpoint (COMPLETE held the model's hash; state.json was not sealed) still loads,
    # and an edited step is still refused.
    _edit_state(path, step=100, format=2, tied=None)
    (path / "COMPLETE").write_text(json.loads((path / "state.json").read_text())["files"]["model.safetensors"] + "\n")
    assert Checkpointer(tmp_path, 1, 0, 5).latest_valid().step == 100
    _edit_state(path, step=99)
    seen = []
    assert Checkpointer(tmp_path, 1, 0, 5).latest_valid(report=seen.append).step == 99
    assert "state.json says step 99, the folder is step-0000100" in seen[0]


@pytest.mark.slow
def test_a_damaged_processed_journal_line_refuses_the_resume_in_one_line_and_loses_nothing(tmp_path):
    """The resume's replay of journal/processed.jsonl read `attempt: "x"` with int(): a traceback. One line
    naming the file, field and line, exit 2; with the line put back the run resumes and finishes."""
    exp = make_project(tmp_path, steps=4, checkpoint_every=2, eval_every=4)
    run = tmp_path / "runs" / "j"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 2, "--no-tracking")
    journal = run / "journal" / "processed.jsonl"
    good = journal.read_text()
    lines = good.splitlines()
    journal.write_text("\n".join([*lines[:-1], json.dumps({**json.loads(lines[-1]), "attempt": "x"})]) + "\n")
    proc = launch(tmp_path, run, "--no-tracking", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    shown = journal.relative_to(tmp_path)  # as the CLI names it, from the project's folder
    assert errors == [f'error: {shown}: attempt: line {len(lines)}: must be a whole number >= 0, got "x"'], proc.stderr
    journal.write_text(good)
    launch(tmp_path, run, "--no-tracking")
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_an_unexpected_error_leaves_status_failed_not_running(tmp_path):
    exp = make_project(tmp_path, steps=8, checkpoint_every=2, keep_last=5)
    run = tmp_path / "runs" / "f"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 4, "--no-tracking")
    _edit_state(run / "checkpoints" / "step-0000004", reseal=True, rng=None)  # verifies, cannot resume
    proc = launch(tmp_path, run, "--no-tracking", check=False)
    assert proc.returncode != 0 and "KeyError" in proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and info["error"].startswith("KeyError")


@pytest.mark.slow
def test_pruning_after_a_fall_back_keeps_the_checkpoint_it_resumed_from(tmp_path):
    # The scenario: keep_last 1, the newest checkpoint damaged, saves that do not land on it.
    exp = make_project(tmp_path, steps=8, checkpoint_every=3, keep_last=2)
    run = tmp_path / "runs" / "p"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 6, "--no-tracking")
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-0000003", "step-0000006"]
    damaged = root / "step-0000006" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    cfg = (run / "experiment.yaml").read_text()
    (run / "experiment.yaml").write_text(
        cfg.replace("interval_steps: 3", "interval_steps: 4").replace("keep_last: 2", "keep_last: 1")
    )
    # Resumes from 3, saves 4 (which verifies), then dies in step 6: 3 may go, 6 is not yet replaced.
    proc = launch(tmp_path, run, "--kill-at-step", 6, "--no-tracking", check=False)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004", "step-0000006"]
    proc = launch(tmp_path, run, "--no-tracking")
    assert "step-0000006 unusable (model.safetensors sha256 mismatch)" in proc.stderr
    assert "resuming from step-0000004 (step 4)" in proc.stderr  # not from 0
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert counters(run)["total"]["exposure"] == 8 * 8 * 16


def test_only_verified_checkpoints_count_toward_keep_last(tmp_path):
    model, opt = _tiny_state()
    said = []
    ck = Checkpointer(tmp_path, interval_steps=2, interval_minutes=0, keep_last=2, report=said.append)
    for step in (2, 4, 6):
        _save(ck, step, model, opt)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004", "step-0000006"]
    (root / "step-0000006" / "optimizer.json").write_text("{}")  # damaged, marker present
    _save(ck, 8, model, opt)
    # 6 does not verify, so it does not count: 8 and 4 are the two kept, not 8 and 6.
    assert sorted(p.name for p in root.iterdir()) == ["step-0000004", "step-0000008"]
    assert said == ["checkpoint step-0000006 removed: it does not verify (optimizer.json sha256 mismatch)"]


def test_a_run_that_starts_over_a_folder_of_damaged_checkpoints_says_so_loudly(tmp_path):
    model, opt = _tiny_state()
    ck = Checkpointer(tmp_path, 1, 0, 3)
    for step in (1, 2):
        _save(ck, step, model, opt)
    for step in (1, 2):
        (tmp_path / "checkpoints" / f"step-{step:07d}" / "ledger.safetensors").write_bytes(b"x")
    seen = []
    assert Checkpointer(tmp_path, 1, 0, 3).latest_valid(report=seen.append) is None
    assert seen[-1].startswith("WARNING: none of the 2 checkpoints in ")
    assert "step-0000002, step-0000001" in seen[-1] and "starts again from step 0" in seen[-1]


def test_keep_last_below_one_is_refused():
    from runner.errors import RunnerError

    with pytest.raises(RunnerError, match="train.checkpoint.keep_last: must be >= 1"):
        Checkpointer(Path("."), 1, 0, 0)


# ---- tied embeddings stored once (issue 13, item 10) ------------------------------------------


@pytest.mark.slow
def test_tied_embeddings_are_stored_once_and_the_plan_matches_the_file(tmp_path):
    from safetensors import safe_open

    from runner.config.load import load_experiment
    from runner.planning.plan import build_plan
    from runner.training.checkpoint import Checkpoint
    from runner.training.model import build_model

    exp_path = make_project(tmp_path, steps=4, checkpoint_every=4)
    run = tmp_path / "runs" / "t"
    launch(tmp_path, exp_path, "--run-dir", run, "--no-tracking")
    path = run / "checkpoints" / "step-0000004"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    state = json.loads((path / "state.json").read_text())
    assert state["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    exp = load_experiment(exp_path)
    planned = build_plan(exp.config, root=tmp_path)["storage"]["checkpoint_bytes"]
    written = sum((path / name).stat().st_size for name in ("model.safetensors", "optimizer.safetensors"))
    assert abs(written - planned) / planned < 0.01, (written, planned)  # headers and AdamW step counters
    # Loaded back, the tie is a tie again (one Parameter), with the trained values.
    ckpt = Checkpointer(run, 1, 0, 1).latest_valid()
    fresh = build_model(exp.config)
    ckpt.load_into(fresh, torch.optim.AdamW(fresh.parameters()))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, Checkpoint(path, 4, state).model_state()["lm_head.weight"])


def test_an_older_checkpoint_holding_the_tied_matrix_twice_still_loads(tmp_path):
    from safetensors.torch import save_file

    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    tied = torch.nn.ModuleDict({"emb": emb, "head": head})
    topt = torch.optim.AdamW(tied.parameters(), lr=0.1)
    head(emb(torch.tensor([1, 2]))).sum().backward()
    topt.step()
    path = _save(Checkpointer(tmp_path, 1, 0, 1), 1, tied, topt)
    # As format 2 wrote it: both names, the matrix copied; no `tied` record, COMPLETE = model sha256.
    save_file(
        {"emb.weight": emb.weight.detach().clone(), "head.weight": emb.weight.detach().clone()},
        str(path / "model.safetensors"),
    )
    _edit_state(path, format=2, tied=None)
    _edit_state(
        path,
        files=dict(
            json.loads((path / "state.json").read_text())["files"],
            **{"model.safetensors": sha256_file(path / "model.safetensors")},
        ),
    )
    (path / "COMPLETE").write_text(sha256_file(path / "model.safetensors") + "\n")
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    fresh["head"].weight = fresh["emb"].weight
    got = Checkpointer(tmp_path, 1, 0, 1).latest_valid()
    assert got.format == 2
    got.load_into(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert torch.equal(fresh["emb"].weight, emb.weight) and fresh["head"].weight is fresh["emb"].weight
