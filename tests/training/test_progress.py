"""Progress a user can see: a bar on a terminal, a plain line now and then in a log file."""

from __future__ import annotations

import io
import json

from datafixtures import documents, make_tokenizer, write_jsonl
from trainfixtures import step_record

from runner import progress
from runner.training.callbacks import TrainingProgress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_a_line_at_first_then_once_per_interval():
    clock = Clock()
    cadence = progress.LineCadence(interval_seconds=60, clock=clock)
    due = []
    for second in range(0, 181, 5):
        clock.now = float(second)
        due.append(cadence.due())
    assert [s for s, d in zip(range(0, 181, 5), due) if d] == [0, 60, 120, 180]


def test_durations_read_in_a_fitting_unit():
    assert [progress.format_seconds(s) for s in (0.4, 45, 725, 3 * 3600 + 7 * 60, 2 * 86400 + 4 * 3600)] == [
        "0s",
        "45s",
        "12m05s",
        "3h07m",
        "2d04h",
    ]


def _record(step: int):
    return step_record(
        step, loss=5.0 - step / 100, tokens_per_second=1234.5, mfu=0.0412, exposure_tokens=step * 2048, step_seconds=0.1
    )


def test_training_progress_in_a_log_file_names_step_tokens_speed_mfu_and_both_etas():
    stream = io.StringIO()
    cb = TrainingProgress(start_step=50, segment_end_step=150, hard_stop_step=100, stream=stream)
    for step in range(51, 56):
        cb.on_step(_record(step), {}, {})
    cb.on_end({"committed_steps": 55}, {}, {})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # the attempt's first step, then (the interval not yet over) its last
    assert lines[0].startswith("train: step 51/150 (34.0%) | exposure 104,448 tokens | loss 4.4900 | ")
    assert "1,234 tokens/s | MFU 4.1% (both smoothed, ~20 steps) | ETA segment end " in lines[0]
    assert lines[-1].startswith("train: step 55/150 (36.7%)") and "| hard stop (step 100) " in lines[-1]


def test_training_progress_on_a_terminal_is_one_bar():
    stream = Terminal()
    cb = TrainingProgress(start_step=0, segment_end_step=20, hard_stop_step=None, stream=stream)
    for step in range(1, 21):
        cb.on_step(_record(step), {}, {})
    cb.on_end({"committed_steps": 20}, {}, {})
    text = stream.getvalue()
    assert "train: step" not in text and "\r" in text  # redrawn in place, not a line per step
    assert "20/20" in text and "100%" in text and "MFU 4.1%" in text and "hard stop" not in text


def test_prepare_in_a_log_file_says_what_it_tokenized(tmp_path, capsys):
    from runner.data.prepare import prepare

    tok = make_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "a.jsonl", documents(200))
    path, _ = prepare("web", tok, tmp_path / "out", [src], workers=0, progress=None)
    manifest = json.loads(path.read_text())
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("prepare web: ")]
    assert lines, "no progress line on a log file"
    total = manifest["pool_tokens"] + manifest["validation_tokens"]
    assert lines[-1].startswith(f"prepare web: {total:,} tokens, ") and " tokens/s, " in lines[-1]
    assert prepare("web", tok, tmp_path / "quiet", [src], workers=0, progress=False)
    assert "prepare web" not in capsys.readouterr().err


def test_the_audit_replay_shows_a_bar_only_on_a_terminal_and_only_when_it_lasts(monkeypatch):
    items = list(range(5))
    assert progress.on_terminal(items, "replay", "step") is items  # a log file: untouched
    monkeypatch.setattr(progress, "interactive", lambda stream=None: True)
    bar = progress.on_terminal(items, "replay", "step")
    assert list(bar) == items and bar.delay == progress.BAR_DELAY_SECONDS


def test_the_progress_rate_is_smoothed_and_says_so():
    """Issue 38, item 9: one slow step on a busy machine does not swing the line; it says it is smoothed."""
    stream = io.StringIO()
    cb = TrainingProgress(start_step=0, segment_end_step=100, hard_stop_step=None, stream=stream)
    fast = dict(loss=5.0, tokens_per_second=2000.0, mfu=0.02, exposure_tokens=0, step_seconds=0.1)
    for step in range(1, 30):
        cb.fields(step_record(step, **fast))
    slow = cb.fields(step_record(30, **(fast | dict(tokens_per_second=500.0, mfu=0.005, step_seconds=0.4))))
    rate = float(slow[2].split(" tokens/s")[0].replace(",", ""))
    mfu = float(slow[3].split("MFU ")[1].split("%")[0])
    assert 1000 < rate < 2000 and 1.0 < mfu < 2.0  # the one slow step (500 tokens/s, 0.5%) pulls it, no more
    assert mfu == round(rate / 2000 * 2.0, 1)  # MFU is tokens/s times a constant: smoothed alike
    assert slow[3].endswith("(both smoothed, ~20 steps)")
