"""The run clock (runner.training.clock) without torch: step and wall time across attempts of
different world sizes, the journal's replay after a kill, checkpoint state and run.json read back."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from runner.errors import RunnerError
from runner.runs.recorded import device_seconds_or, recorded_times
from runner.training.clock import RunClock


class FakeTime:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeDevice:
    """A device clock whose queued work takes `lag` seconds to finish at each synchronize."""

    basis = "device"

    def __init__(self, host: FakeTime, lag: float):
        self.host, self.lag = host, lag

    def now(self) -> float:
        return self.host.t

    def seconds_since(self, t0: float) -> float:
        self.host.t += self.lag
        return self.host.t - t0


def _attempt(world: int, journal: list[dict], steps: int, step_seconds: float, state: dict | None = None):
    """One attempt of `steps` steps of 2 micro batches each; returns its clock and journal lines."""
    host = FakeTime()
    clock = RunClock(world, FakeDevice(host, step_seconds / 2), host_now=host)
    if state is not None:
        clock.load_state_dict(state)
    spent = clock.replay(journal, ["a", "b"])
    out = io.StringIO()
    out.close = lambda: None  # read after end_attempt
    clock.start_attempt(out)
    for step in range(steps):
        clock.begin_step()
        for m in range(2):
            host.t += step_seconds / 4
            clock.journal_micro(step, m, {"a": 8, "b": 8})
        clock.end_step()
    host.t += 1.0  # after the last step: evaluation, checkpoint
    clock.end_attempt()
    return clock, spent, [json.loads(line) for line in out.getvalue().splitlines()]


def test_step_and_wall_time_count_each_attempt_with_its_own_world_size():
    first, spent, lines = _attempt(world=2, journal=[], steps=3, step_seconds=1.0)
    assert spent == {"a": 0, "b": 0} and first.attempt == 1
    assert first.step_seconds_total == pytest.approx(3.0)
    assert first.device_step_seconds_total == pytest.approx(6.0)
    assert first.wall_seconds() == pytest.approx(4.0) and first.device_wall_seconds() == pytest.approx(8.0)
    assert [(e["step"], e["micro"]) for e in lines if "step" in e] == [(s, m) for s in range(3) for m in range(2)]
    assert lines[-1]["processed"] == {} and lines[-1]["wall_seconds"] == pytest.approx(4.0)

    # killed before a checkpoint: the next attempt, on 4 devices, continues from the journal alone
    second, spent, _ = _attempt(world=4, journal=lines, steps=1, step_seconds=0.5, state=None)
    assert spent == {"a": 48, "b": 48}  # 3 steps x 2 micro batches x 8 positions, lost work included
    assert second.attempt == 2
    assert second.prior_wall_seconds == pytest.approx(4.0) and second.prior_device_wall_seconds == pytest.approx(8.0)
    assert second.step_seconds_total == pytest.approx(3.5)
    assert second.device_step_seconds_total == pytest.approx(6.0 + 0.5 * 4)
    assert second.wall_seconds() == pytest.approx(4.0 + 1.5)
    assert second.device_wall_seconds() == pytest.approx(8.0 + 1.5 * 4)


def test_a_kill_mid_step_loses_no_wall_time_and_keeps_the_larger_step_total():
    _, _, lines = _attempt(world=1, journal=[], steps=2, step_seconds=1.0)
    torn = [e for e in lines if "step" in e and (e["step"], e["micro"]) != (1, 1)]  # killed in step 1: no end line
    clock = RunClock(1, host_now=FakeTime())
    clock.load_state_dict({"step_seconds_total": 1.0, "device_step_seconds_total": 1.0, "world_size": 1})
    clock.replay(torn, ["a", "b"])
    assert clock.step_seconds_total == pytest.approx(1.25)  # the journal saw half of step 1 spent
    assert clock.prior_wall_seconds == pytest.approx(1.25)


def test_checkpoint_state_round_trips_and_old_states_read_as_seconds_times_world():
    clock = RunClock(3, host_now=FakeTime())
    clock.step_seconds_total, clock.device_step_seconds_total = 2.0, 5.5
    again = RunClock(3, host_now=FakeTime())
    again.load_state_dict(clock.state_dict())
    assert again.state_dict() == {"step_seconds_total": 2.0, "device_step_seconds_total": 5.5, "world_size": 3}
    old = RunClock(8, host_now=FakeTime())
    old.load_state_dict({"step_seconds_total": 2.0, "world_size": 2})  # before device-seconds were recorded
    assert old.device_step_seconds_total == 4.0
    old.replay([{"attempt": 1, "processed": {}, "wall_seconds": 3.0, "step_seconds_total": 2.5}], ["a"])
    assert old.device_step_seconds_total == 2.5 * 8  # a journal before "world": this attempt's world
    assert old.prior_device_wall_seconds == 3.0 * 8


def test_recorded_times_prefer_run_json_and_fall_back_to_the_train_rows():
    rows = [
        {"step": 2, "step_seconds": 0.5, "wall_seconds": 1.5},
        {"step": 4, "step_seconds": 0.25, "wall_seconds": 2.5},
    ]  # log_interval_steps 2: each row stands for two steps
    times = recorded_times({}, 2, rows)
    assert (times.wall_seconds, times.step_seconds_total) == (2.5, 1.5)
    assert (times.device_wall_seconds, times.device_step_seconds) == (5.0, 3.0)
    run = {"wall_seconds": 9.0, "step_seconds_total": 7.0, "device_wall_seconds": 30.0}
    times = recorded_times(run, 4, rows)
    assert (times.wall_seconds, times.step_seconds_total, times.device_wall_seconds) == (9.0, 7.0, 30.0)
    assert times.device_step_seconds == 28.0
    assert device_seconds_or(0.0, 5.0, 2) == 0.0  # a recorded zero is a figure, not a missing one
    with pytest.raises(RunnerError, match="no wall_seconds"):
        recorded_times({}, 1, [])


def test_the_clock_imports_without_torch():
    code = "import sys, runner.training.clock; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_attempt_s_end_is_one_reading_for_run_json_the_cost_and_the_next_replay():
    """A busy machine between the journal's last line and run.json's summary: the clock stopped at
    end_attempt, so run.json's device-seconds, the cost computed from them and the journal's sum (what
    the next resume and the test of the elastic run add up) are one figure, exactly (issue 38, item 1)."""
    from runner.planning.hardware import run_efficiency

    journal: list[dict] = []
    for world, steps in ((2, 2), (2, 1), (1, 3)):  # the process count changes between attempts
        clock, _, lines = _attempt(world=world, journal=journal, steps=steps, step_seconds=0.3337)
        clock.host_now.t += 7.25  # a loaded machine: _finish reads the clock long after the journal's end
        journal += lines
    by_attempt: dict[int, tuple[float, int]] = {}
    for e in journal:
        by_attempt[e["attempt"]] = (max(by_attempt.get(e["attempt"], (0.0, 0))[0], e["wall_seconds"]), e["world"])
    held = sum(wall * world for wall, world in by_attempt.values())
    assert clock.device_wall_seconds() == held
    assert clock.wall_seconds() == sum(wall for wall, _ in by_attempt.values())
    useful, price = 1_234_567, 0.1
    eff = run_efficiency(1e6, None, 2 * useful, useful, clock.device_step_seconds_total, held, 1.0, price)
    assert eff.cost_per_billion_useful_tokens == price * held / 3600 / (useful / 1e9)
    again = RunClock(1, host_now=FakeTime())
    again.replay(journal, ["a", "b"])
    assert again.prior_device_wall_seconds == clock.device_wall_seconds()


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("attempt", "x", 'attempt: line 2: must be a whole number >= 0, got "x"'),  # int('x'): a traceback
        ("world", None, "world: line 2: must be a whole number >= 1, got null"),
        ("wall_seconds", [1], "wall_seconds: line 2: must be a finite number of seconds >= 0, got [1]"),
        ("step_seconds_total", float("inf"), "step_seconds_total: line 2: must be a finite number of seconds"),
        ("processed", {"code": -5}, "processed: line 2: must be a mapping of domains to whole numbers >= 0"),
    ],
)
def test_a_processed_journal_line_of_another_shape_is_one_line_naming_it(tmp_path, field, value, says):
    """A resume replays journal/processed.jsonl into its clock and ledger: a line edited or damaged there
    was int()'s or float()'s traceback in the launch, an infinite step total went into the run's MFU, and
    -5 processed tokens into its ledger. The launch refuses in one line naming the file, field and line
    (it stays resumable once the line is put back: tests/training/test_checkpoint.py)."""
    from runner.runs.folder import RunFolder

    line = {"attempt": 1, "world": 1, "step": 0, "micro": 0, "processed": {"code": 64}, "wall_seconds": 1.5}
    line |= {"step_seconds_total": 0.5, "device_step_seconds_total": 0.5}
    journal = tmp_path / "journal" / "processed.jsonl"
    journal.parent.mkdir()
    journal.write_text(json.dumps(line) + "\n" + json.dumps({**line, "micro": 1, field: value}) + "\n")
    with pytest.raises(RunnerError) as err:
        RunFolder(tmp_path).journal_entries()
    assert str(err.value).startswith(f"{journal}: {says}"), str(err.value)
    journal.write_text(json.dumps(line) + "\n" + json.dumps({**line, "micro": 1}) + '\n{"attempt": 1, "wor')
    assert len(RunFolder(tmp_path).journal_entries()) == 2  # a line torn by a kill is still skipped
