"""run.json `t_startup`: process start to the first step, by part, in every attempt; the first step
beside it; counted in the attempt's wall (goodput); shown in report.md (runner.training.startup)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from trainfixtures import REPO, launch, make_project

from runner import bytecode
from runner.training import startup
from runner.training.model import build_model


def test_a_launch_and_its_resume_record_every_part_and_count_them_in_the_wall(tmp_path):
    exp = make_project(tmp_path, steps=4, checkpoint_every=2, eval_every=4)
    run = tmp_path / "runs" / "r"
    launch(tmp_path, exp, "--run-dir", run, "--no-tracking", "--max-steps", "2")
    launch(tmp_path, run, "--no-tracking")  # the resume: a second attempt, from the step-2 checkpoint
    info = json.loads((run / "run.json").read_text())
    t = info["t_startup"]
    assert [a["attempt"] for a in t["attempts"]] == [1, 2]
    for a in t["attempts"]:
        assert set(a["parts"]) == set(startup.PARTS)
        assert abs(sum(a["parts"].values()) - a["seconds"]) < 0.01  # consecutive parts: they sum to the total
        assert a["first_step_seconds"] is not None and a["first_step_seconds"] > 0
        assert a["parts"]["config"] > 0 and a["parts"]["model_build"] > 0 and a["parts"]["imports"] >= 0
        # before_first_step by piece, in the order they ran, summing to it ("rest": what no piece named)
        pieces = a["before_first_step_parts"]
        assert list(pieces) == ["compile_wrapping", "peak", "conventions", "system_metrics", "attempt_start", "rest"]
        assert abs(sum(pieces.values()) - a["parts"]["before_first_step"]) < 0.01 and min(pieces.values()) >= 0
        assert a["bytecode"] == bytecode.state()  # launched in this process: where its bytecode came from
    first, resumed = t["attempts"]
    assert first["parts"]["checkpoint_load"] < resumed["parts"]["checkpoint_load"]  # verified and loaded
    assert t["seconds"] == round(first["seconds"] + resumed["seconds"], 3)
    # the attempts' wall starts at their start: it holds the startup and every step
    assert info["wall_seconds"] >= t["seconds"] + info["step_seconds_total"] - 0.01
    report = (run / "report" / "report.md").read_text()
    assert "Startup (t_startup, process start to the first step" in report and "over 2 attempts" in report


def test_the_clock_of_a_process_started_for_runner_begins_at_the_process_start():
    code = (
        "import time, sys; time.sleep(0.5); sys.argv[0] = 'runner'\n"
        "from runner.training import startup\n"
        "startup.begin_launch(); c = startup.current()\n"
        "print(c.parts['process_to_launch'], time.time() - startup.process_start_time())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    before_launch, since_start = map(float, out.split())
    assert since_start >= 0.45 and before_launch >= 0.45  # the sleep before the CLI's code is in the startup
    # a host calling the CLI in process (this test) starts the clock at the call instead
    startup.begin_launch()
    assert startup.current().parts["process_to_launch"] < 0.45


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the kernel's record is Linux's /proc")
def test_the_process_start_lies_between_the_moments_before_and_after_its_spawn():
    # an order, not a duration: true on a busy machine too. The start is read in clock ticks (10 ms,
    # truncated); the boot's epoch in whole seconds (/proc/stat btime) put it up to 1 s early
    tick = 1 / os.sysconf("SC_CLK_TCK")
    code = "from runner.training import startup; print(repr(startup.process_start_time()))"
    for _ in range(3):
        before = time.time()
        child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
        after = time.time()  # Popen returns once the child has been made and has exec'd
        started = float(child.communicate()[0])
        assert before - tick - 0.002 <= started <= after + 0.002, (before, started, after)


def test_the_model_is_built_where_the_device_context_says():
    from gpufixtures import tiny_cfg

    with startup.on_device(torch.device("meta")):  # any device but the CPU: every parameter made there
        model = build_model(tiny_cfg("cuda"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert (
        startup.load_device(torch.device("cuda", 0)) == "cuda:0" and startup.load_device(torch.device("cpu")) == "cpu"
    )


def test_merged_keeps_every_attempt_and_sums_them():
    a = {"attempt": 1, "seconds": 2.0, "parts": {}, "first_step_seconds": 1.0}
    b = {"attempt": 2, "seconds": 3.0, "parts": {}, "first_step_seconds": None}
    rec = startup.merged(startup.merged(None, a), b)
    assert (rec["seconds"], rec["first_step_seconds"], len(rec["attempts"])) == (5.0, 1.0, 2)
    assert startup.merged(rec, {**b, "seconds": 4.0})["seconds"] == 6.0  # an attempt rewritten, not added
    assert startup.report_lines({}) == [] and startup.report_lines({"t_startup": rec})


def test_the_pieces_of_before_first_step_are_split_from_the_last_mark_and_sum_to_it(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(startup.time, "time", lambda: now[0])
    clock = startup.StartupClock(origin=100.0)
    now[0] = 101.0
    clock.mark("checkpoint_load")  # before_first_step opens here
    now[0] = 101.5
    clock.split("compile_wrapping")
    now[0] = 103.5
    clock.split("peak")
    now[0] = 104.0
    clock.split("compile_wrapping")  # a piece met again adds up
    now[0] = 104.25
    clock.first_step_begins()
    rec = clock.record(1)
    assert rec["parts"]["before_first_step"] == 3.25 and rec["seconds"] == 4.25
    assert rec["before_first_step_parts"] == {"compile_wrapping": 1.0, "peak": 2.0, "rest": 0.25}
    unfinished = startup.StartupClock(origin=100.0)
    unfinished.split("peak")  # no first step: no pieces recorded (before_first_step never closed)
    assert "before_first_step_parts" not in unfinished.record(1)
