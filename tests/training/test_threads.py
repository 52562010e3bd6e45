"""hardware.threads (runner.training.threads): applied before the first step, recorded in run.json,
the CPU peak's cores, and kept on a resume (a recipe stating another count is refused in one line)."""

from __future__ import annotations

import json

import pytest
import yaml
from bad_input_helpers import one_error, run_cli
from trainfixtures import launch, make_project

from runner.errors import RunnerError
from runner.host import usable_cores
from runner.training import threads
from runner.training.threads import attempt_threads


def test_a_resume_computes_with_the_recorded_count_or_is_refused():
    assert attempt_threads(None, None) is None  # torch's default
    assert attempt_threads(3, None) == 3  # a first attempt: the recipe's
    assert attempt_threads(None, 2) == 2  # a resume: the run's, whatever OMP_NUM_THREADS says now
    assert attempt_threads(2, 2) == 2
    with pytest.raises(RunnerError) as err:
        attempt_threads(1, 2, file="experiments/x.yaml")
    line = str(err.value)
    assert "hardware.threads" in line and "computed with 2 thread(s)" in line and "\n" not in line


def test_more_threads_than_cores_is_refused_before_a_run_folder_is_written(project, capsys, monkeypatch):
    """`hardware.threads: 100000` was a segmentation fault in torch (1,024 on 2 cores ran 10x slower,
    4,096 never finished), and a CPU's peak counts the threads as cores: one line, exit 2, no folder."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    threads.check_threads(None)  # torch's default: its own count
    threads.check_threads(2)
    with pytest.raises(RunnerError, match=r"hardware.threads: 3 threads, but this process may use 2 core"):
        threads.check_threads(3)
    monkeypatch.chdir(project)
    path = project / "experiments" / "many.yaml"
    path.write_text(
        "base: cpu-tiny@2\nname: many\nversion: 1\ndescription: threads\noverrides: {hardware: {threads: 100000}}\n"
    )
    line = one_error(*run_cli(capsys, "launch", path, "--no-tracking")[::2])
    assert line.startswith("error: experiments/many.yaml: hardware.threads: 100,000 threads"), line
    assert not (project / "runs").exists()


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="computes with 2 threads: more than this process's cores")
def test_threads_are_applied_recorded_counted_in_the_peak_and_kept_on_resume(tmp_path):
    exp = make_project(tmp_path, steps=2, checkpoint_every=1, eval_every=2)  # 2 threads: slow on a busy machine
    hw = tmp_path / "recipes" / "hardware" / "cpu.yaml"
    body = yaml.safe_load(hw.read_text())
    for key in ("peak_tflops", "peak_source"):
        body.pop(key)
    body.update(cpu_peak="theoretical", threads=2)
    hw.write_text(yaml.safe_dump(body))
    run = tmp_path / "runs" / "t"
    launch(tmp_path, exp, "--run-dir", run, "--max-steps", 1, "--no-tracking")  # the fixture's env: 1 thread
    info = json.loads((run / "run.json").read_text())
    assert info["threads"] == 2 and info["runtime"]["torch_threads"] == 2
    assert info["conventions"]["peak_source"].startswith("theoretical: 2 cores x ")
    saved = (run / "experiment.yaml").read_text()
    assert "threads: 2" in saved
    (run / "experiment.yaml").write_text(saved.replace("threads: 2", "threads: 1"))  # operational: same fingerprint
    proc = launch(tmp_path, run, "--no-tracking", check=False)
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("warning: ")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {run}/experiment.yaml: hardware.threads: ") or lines[0].startswith(
        "error: runs/t/experiment.yaml: hardware.threads: "
    ), lines
    assert "computed with 2 thread(s)" in lines[0]
    (run / "experiment.yaml").write_text(saved.replace("threads: 2", "threads: null"))  # torch's default: 1 here
    launch(tmp_path, run, "--no-tracking")
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["threads"] == 2 and info["runtime"]["torch_threads"] == 2
