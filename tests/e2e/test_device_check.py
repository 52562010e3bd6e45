"""bench/device_check.sh --cpu-tiny: the device check's own code path, on a CPU, as CI runs it.

The device has no mlflow: the check runs here with mlflow made unimportable, so a phase that needs
it fails here too. The script bounds its own time (a budget, a cap per phase); this test only waits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.longest
@pytest.mark.slow
def test_device_check_runs_every_phase_on_cpu_without_mlflow(tmp_path):
    blocker = tmp_path / "blocker" / "mlflow"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("mlflow is not installed on the device")\n')
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(blocker.parent), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "device_check.sh"), "--cpu-tiny", "--python", sys.executable]
        + ["--out", str(out), "--work", str(work), "--budget-s", "1800"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    phases = {p["phase"]: p for p in map(json.loads, (work / "phases.jsonl").read_text().splitlines())}
    # the runner's own path: launched, SIGKILLed in step 8 (exit 137), resumed, audited
    assert phases["launch-killed"]["rc"] == 137, log[-3000:]
    # no MLflow on a device (--no-tracking): the audit is UNVERIFIED (exit 5) on its MLflow checks, never FAIL
    assert phases["resume"]["rc"] == 0 and phases["audit"]["rc"] in (0, 5), log[-3000:]
    assert phases["env"]["rc"] == 0 and phases["corpus"]["rc"] == 0 and phases["memory-probe"]["rc"] == 0
    assert phases["pytest-gpu"]["rc"] in (0, 5)  # every GPU test skipped here
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "finished" and run["lost_tokens"] > 0 and run["attempts"] == 2
    assert run["runtime"]["micro_batch_policy"] == "auto" and run["runtime"]["cross_entropy"] == "chunked"
    assert run["system"]["device_busy_samples"] >= 1
    probe = json.loads((out / "probe.json").read_text())
    assert all(abs(r["saved_error"]) < 0.01 for r in probe["rows"])
    table = (out / "table.md").read_text()
    assert "killed (SIGKILL) in step 8 and resumed: status **finished**" in table
    # the start of each attempt by part, and each checkpoint's stall (run.json t_startup, checkpoints)
    assert table.count("to the first step (") == 2 and "checkpoint stall (t_checkpoint) step 6:" in table
    assert len(run["t_startup"]["attempts"]) == 2
    # each attempt a `python -m runner` process: torch has its bytecode here, so Python's default (or yours) stands
    where = os.environ.get("PYTHONPYCACHEPREFIX") or "beside the sources"
    assert all(a["bytecode"]["cache"] == where for a in run["t_startup"]["attempts"])
    assert "Memory plan vs probe" in table and "What failed:" in table
    assert "vs bench (ratio" not in table  # the 3% bound is a device's check, not this CPU stand-in's
    # what comes back from a device run: at most 8 files, no folder below $OUT
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(p.parent == out for p in files), files
    env_facts = json.loads((out / "env.json").read_text())
    assert env_facts["torch_version"] and env_facts["packages"]["omegaconf"] != "missing"
    assert env_facts["packages"]["liger-kernel"] not in ("", None)  # a version, or why it does not load
    # what transformers 5.17 would pull into a launch, recorded (installed here: lm-eval's, the planner's)
    from importlib.metadata import version

    assert [env_facts["packages"][d] for d in ("scikit-learn", "scipy", "pandas")] == [
        version(d) for d in ("scikit-learn", "scipy", "pandas")
    ]
    assert f"scikit-learn {version('scikit-learn')}, scipy {version('scipy')}, pandas {version('pandas')}" in table
    # where the launch's import seconds go: torch first among the packages, CUDA's first use absent on a CPU
    imports = env_facts["imports"]
    assert phases["imports"]["rc"] == 0 and imports["torch_s"] > 0 and imports["cuda_init_s"] is None
    assert "torch" in imports["by_package"] and imports["modules"] > 100
    assert "Imports (`-X importtime` in a fresh process" in table
    # ... and why: bytecode (torch installed with it here: the runner caches nothing), memory, a second process
    assert (
        imports["bytecode"]["beside_the_sources"]["torch"] is True
        and imports["bytecode"]["runner_would_cache"] is False
    )
    assert imports["memory"]["total_gib"] > 0 and imports["repeat_s"] > 0
    assert "skipped" in imports["runner_cache"] and "Bytecode: beside the sources for torch" in table


@pytest.mark.slow
def test_every_phase_keeps_to_its_cap_and_one_killed_at_it_leaves_its_rows(tmp_path):
    """The budget table comes first (log and table), each phase ends by its cap, and bench-rest,
    killed at a cap it cannot meet (variants that time up to 100,000 steps), leaves bench.json whole:
    the decisive rows, and the table built from them. Only env and the two bench phases run (cheap)."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "device_check.sh"), "--cpu-tiny", "--python", sys.executable]
        + ["--out", str(out), "--work", str(work), "--budget-s", "1800", "--only", "env,bench-decisive,bench-rest"]
        + ["--cap", "bench-rest=20", "--bench-args", "--steps 100000"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert log.startswith("Budget: 1800 s in all (phase caps x3)")
    assert "| 3 | bench-rest | 20 |" in log.split("== device_check:")[0]  # before any phase ran
    phases = [json.loads(line) for line in (work / "phases.jsonl").read_text().splitlines()]
    assert [p["phase"] for p in phases] == ["env", "bench-decisive", "bench-rest"]
    for p in phases:  # timeout's TERM at the cap, its KILL 20 s later at the latest
        assert p["seconds"] <= p["cap"] + 20, p
    rest = phases[-1]
    assert rest["rc"] == 124 and rest["note"] == "killed at its cap", rest
    bench = json.loads((out / "bench.json").read_text())
    names = [r["variant"] for r in bench["rows"]]
    # the decisive rows: the 1p3b recipe, then the smoke experiment's settings (no Liger under whole-model compile)
    assert names[0] == "1p3b recipe mb2" and names[1].startswith("gpu-smoke-cpu settings mb")
    assert not any("liger" in n for n in names[:2]) and bench["matmul"]["best_tflops"] > 0
    table = (out / "table.md").read_text()
    assert "| 2 | bench-decisive | 660 |" in table and "Bench's share" in table
    assert "| 1p3b recipe mb2 |" in table and "phase bench-rest: exit 124 killed at its cap" in table
    # the runner's phases were not selected: the table says so (it printed "status None" before)
    assert "Runner: the runner's phases (launch-killed, resume, audit) did not run in this call." in table
    assert "status **None**" not in table
