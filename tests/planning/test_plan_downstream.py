"""`runner plan`'s downstream evaluation cost (issue 22 item 7): the eval recipe's requests and
input positions, their forward FLOPs (a third of the training convention's per token) and time at
the assumed MFU, per scoring and over the run at eval.downstream_interval_steps."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from runner.config.load import load_experiment
from runner.planning.downstream_cost import downstream_cost, scorings
from runner.training.downstream.builtin_task import builtin_documents
from runner.training.downstream.cost import task_positions
from runner.training.downstream.tasks import subset

REPO = Path(__file__).resolve().parents[2]


def _derived(tmp_path: Path, base: str, name: str, interval: int, limit: int | None = None) -> Path:
    task = "{format: builtin}" if limit is None else f"{{format: builtin, limit: {limit}}}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nversion: 1\ndescription: a plan of the downstream cost\nbase: {base}\n"
        f"overrides:\n  eval:\n    tasks:\n      builtin: {task}\n    downstream_interval_steps: {interval}\n"
    )
    return path


@pytest.mark.parametrize(("steps", "interval", "n"), [(150, 25, 6), (150, 40, 4), (150, 0, 1), (150, 1000, 1)])
def test_scorings_are_every_interval_and_the_end_once(steps, interval, n):
    assert scorings(steps, interval) == n


def test_cost_is_positions_times_a_third_of_the_training_flops_per_token():
    cost = downstream_cost(
        {"a": {"requests": 8, "positions": 600}, "b": {"requests": 4, "positions": 400}},
        training_flops_per_token=6000.0,
        tokens_per_second=1000.0,
        total_steps=100,
        interval_steps=30,
        wall_seconds=400.0,
    )
    assert cost["requests"] == 12 and cost["positions_per_scoring"] == 1000
    assert cost["flops_per_scoring"] == pytest.approx(1000 * 2000.0)
    assert cost["seconds_per_scoring"] == pytest.approx(1000 / 3000)  # a forward token: 1/3 of a training token
    assert cost["scorings"] == 4 and cost["seconds_total"] == pytest.approx(4 / 3)
    assert cost["share_of_wall"] == pytest.approx(4 / 3 / 400)


def test_positions_are_the_tokenized_windows(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    exp = load_experiment(_derived(tmp_path, "cpu-tiny@2", "ds-plan", 50, limit=20), check_files=False)
    got = task_positions(exp)["builtin"]
    tok = Tokenizer.from_file(str(REPO / "runner/builtin/assets/tokenizer.json"))
    seq_len = exp.config.train.seq_len
    docs = subset(builtin_documents()[0], 20, 0)
    windows = [
        (tok.encode(r.context).ids, tok.encode(r.context + r.continuation).ids) for d in docs for r in d.requests
    ]
    assert all(len(whole) <= seq_len + 1 for _, whole in windows)  # no window cut: each input is whole[:-1]
    alone = sum(len(whole) - 1 for _, whole in windows)
    # sdpa: the requests of one context share a row, the context once, then each continuation's inputs
    widths: dict[tuple, int] = {}
    for c, whole in windows:
        widths[tuple(c)] = widths.get(tuple(c), len(c)) + len(whole) - 1 - len(c)
    want = sum(widths.values())
    assert want < alone  # builtin's contexts recur as other documents' choices
    basis = "tokenized (the run's tokenizer); a context once for its choices"
    assert got == {"requests": 80, "documents": 20, "positions": want, "basis": basis}


def test_plan_prints_the_cost_and_estimates_tokens_without_the_tokenizer(tmp_path, monkeypatch, capsys):
    from runner.cli import main

    monkeypatch.chdir(REPO)
    assert main(["plan", str(_derived(tmp_path, "1p3b@2", "big", 1000))]) == 0
    out = capsys.readouterr().out
    block = out[out.index("downstream evaluation") :]
    assert block.startswith("downstream evaluation (604 requests, every 1,000 steps and at the end: 25 scorings)")
    assert "estimated: UTF-8 bytes / 4.2 bytes per token" in block and "of the wall clock (t_eval)" in block
    assert main(["plan", "experiments/cpu-tiny.yaml"]) == 0
    assert "downstream evaluation: none (the eval recipe lists no tasks)" in capsys.readouterr().out
