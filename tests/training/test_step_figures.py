"""A new per-step figure is one source in one place (`Options.step_figures`, runner.training.attempt):
the loop puts its {name: value} into the step's record, so metrics/train.jsonl holds it and MLflow logs
it at the step, with no other edit (README: "A new per-step figure")."""

from __future__ import annotations

import functools

from trainfixtures import launch, make_project, step_record

import runner.training.loop as loop
from runner.fsio import read_jsonl
from runner.training.callbacks import TrackingCallback


def lr_per_mille(run, committed: int) -> dict[str, float]:
    """The README's example: the learning rate the step trained with, x 1000."""
    return {"lr_per_mille": 1000 * run.optimizer.param_groups[0]["lr"]}


def test_a_step_figure_source_reaches_every_row_of_train_jsonl(tmp_path, monkeypatch):
    # what `runner launch` builds its Options with, given the one source
    monkeypatch.setattr(loop, "Options", functools.partial(loop.Options, step_figures=[lr_per_mille]))
    run = tmp_path / "run"
    launch(tmp_path, make_project(tmp_path, steps=2, eval_every=10**6), "--run-dir", run, "--no-tracking")
    rows = read_jsonl(run / "metrics" / "train.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["lr_per_mille"] for r in rows] == [1000 * r["lr"] for r in rows]


class _Sink:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step, timestamp_ms=None):
        self.logged.append((step, dict(metrics)))


def test_a_step_figure_is_logged_to_mlflow_at_its_step():
    sink = _Sink()
    counters = {"total": dict.fromkeys(("processed", "exposure", "useful", "unique", "lost"), 0)}
    TrackingCallback(sink, log_interval_steps=1).on_step(step_record(3, figures={"lr_per_mille": 0.5}), counters, {})
    (step, metrics), *_ = sink.logged
    assert step == 3 and metrics["lr_per_mille"] == 0.5
