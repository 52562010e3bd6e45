"""The pilot grid writes loadable experiments that vary only size and budget, rounding stated."""

import shutil
from pathlib import Path

import pytest
import yaml

from runner.errors import RunnerError
from runner.planning.pilot_grid import llama_intermediate_size, parse_size, parse_tokens, round_budget, write_pilot_grid

REPO = Path(__file__).resolve().parents[2]


def test_parse_tokens_and_rounding():
    assert parse_tokens("300K") == 300_000
    assert parse_tokens("2.5M") == 2_500_000
    assert parse_tokens("1e9") == 10**9
    assert parse_tokens("1_000") == 1000
    with pytest.raises(RunnerError, match="--budgets"):
        parse_tokens("lots")
    assert round_budget(100_000, 2048) == 98_304  # 48 batches, 1,696 tokens dropped


def test_parse_size_forms():
    assert parse_size("llama-tiny@1").recipe == "llama-tiny@1"
    s = parse_size("hidden_size=128+n_layers=4")
    assert s.label == "h128-l4" and dict(s.overrides) == {"hidden_size": 128, "n_layers": 4}
    with pytest.raises(RunnerError, match="--sizes"):
        parse_size("width=3")
    for path in ("..@1", "../model/llama-tiny@1", "llama-tiny@x"):  # a recipe's file name, never a path
        with pytest.raises(RunnerError, match="neither NAME@VERSION"):
            parse_size(path)
    assert llama_intermediate_size(4096) == 10928  # 8/3 * 4096 = 10922.7 -> multiple of 16


@pytest.fixture
def project(tmp_path):
    """A copy of the project's recipes and the cpu-tiny experiment, so pilots load for real."""
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    (tmp_path / "experiments").mkdir()
    shutil.copy(REPO / "experiments" / "cpu-tiny.yaml", tmp_path / "experiments")
    return tmp_path


def test_grid_loads_and_varies_only_size_and_budget(project):
    from runner.config.load import load_experiment

    base_path = project / "experiments" / "cpu-tiny.yaml"
    base = load_experiment(base_path, check_files=False).to_container()
    out = project / "experiments" / "pilots"
    files = write_pilot_grid(base_path, ["llama-tiny@1", "hidden_size=128+n_layers=3"], ["100K", "200000"], out)
    assert [f.name for f in files][-1] == "README.md" and len(files) == 5
    readme = (out / "README.md").read_text()
    assert "98,304" in readme and "1,696" in readme  # 100K rounded down, drop stated
    seen = set()
    for f in files[:-1]:
        exp = load_experiment(f, check_files=False).to_container()
        t = exp["train"]
        assert t["exposure_tokens"] % (16 * 128) == 0 and t["exposure_tokens"] == t["max_duration_tokens"]
        for section in ("tokenizer", "mixture", "eval", "optim", "hardware", "data"):
            assert exp[section] == base[section]
        assert (t["seq_len"], t["global_batch_sequences"]) == (128, 16)
        seen.add((exp["model"]["hidden_size"], exp["model"]["n_layers"], t["exposure_tokens"]))
    assert seen == {(64, 2, 98_304), (64, 2, 198_656), (128, 3, 98_304), (128, 3, 198_656)}
    big = yaml.safe_load(next(out.glob("*h128-l3-98p3K.yaml")).read_text())
    assert big["overrides"]["model"]["intermediate_size"] == llama_intermediate_size(128)
    assert "rounded down" in big["description"]


def test_copy_when_base_is_outside_experiments(project):
    from runner.config.load import load_experiment

    moved = project / "elsewhere.yaml"
    shutil.copy(project / "experiments" / "cpu-tiny.yaml", moved)
    files = write_pilot_grid(moved, ["llama-tiny@1"], ["40960"], project / "experiments" / "p")
    doc = yaml.safe_load(files[0].read_text())
    assert "base" not in doc and doc["recipes"]["tokenizer"] == "builtin-bpe-4k@1"
    assert load_experiment(files[0], check_files=False).config.train.exposure_tokens == 40960


def test_refusals(project):
    base_path = project / "experiments" / "cpu-tiny.yaml"
    out = project / "p"
    with pytest.raises(RunnerError, match="less than one global batch"):
        write_pilot_grid(base_path, ["llama-tiny@1"], ["1000"], out)
    with pytest.raises(RunnerError, match="warmup_tokens"):
        write_pilot_grid(base_path, ["llama-tiny@1"], ["20480"], out)
    with pytest.raises(RunnerError, match="not divisible by n_heads"):
        write_pilot_grid(base_path, ["llama-tiny@1", "hidden_size=90"], ["100K"], out)
    assert not out.exists() or not list(out.glob("*.yaml"))  # nothing half-written
    with pytest.raises(RunnerError, match="no model recipe"):
        write_pilot_grid(base_path, ["llama-huge@1"], ["100K"], out)


def test_cli_pilot_grid(project, capsys, monkeypatch):
    from runner.cli import main

    monkeypatch.chdir(project)
    assert (
        main(
            [
                "pilot-grid",
                "experiments/cpu-tiny.yaml",
                "--sizes",
                "llama-tiny@1,n_layers=4",
                "--budgets",
                "100K,400K",
                "--out",
                "experiments/pilots",
            ]
        )
        == 0
    )
    assert len(list((project / "experiments" / "pilots").glob("*.yaml"))) == 4
    assert "4 pilot experiments" in capsys.readouterr().out
    assert main(["pilot-grid", "experiments/cpu-tiny.yaml", "--sizes", "x", "--budgets", "1M"]) == 2


def test_grid_refuses_a_budget_the_mixture_cannot_meet(project_with_data):
    from runner.errors import RunnerError
    from runner.planning.pilot_grid import write_pilot_grid

    out = project_with_data / "experiments/pilots"
    with pytest.raises(
        RunnerError, match=r"--budgets: budget 1M .*legal.*largest feasible budget at these ratios: 378,880"
    ):
        write_pilot_grid(project_with_data / "experiments/cpu-tiny.yaml", ["llama-tiny@1"], ["100K", "1M"], out)
    assert not out.exists() or not any(out.iterdir())


def test_cli_pilot_grid_says_how_to_launch_and_fit(project, capsys, monkeypatch):
    # Runs land in runs/<pilot name>/<run_id>/, so the fit command is not guessable from --out.
    from runner.cli import main

    monkeypatch.chdir(project)
    assert (
        main(
            ["pilot-grid", "experiments/cpu-tiny.yaml", "--sizes", "llama-tiny@1,n_layers=4", "--budgets", "100K,400K"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert 'next: for f in experiments/pilots/*.yaml; do runner launch "$f"; done' in out
    assert "runner fit runs/cpu-tiny-pilot-*/ --flops C" in out
    assert all(p.stem.startswith("cpu-tiny-pilot-") for p in (project / "experiments/pilots").glob("*.yaml"))


def test_grid_rewrites_only_what_an_earlier_grid_wrote(project):
    """`--out .` rewrote the project's README.md; a pilot-named YAML of the user's own was rewritten too.
    Refused before any file is written; an earlier grid's files are rewritten."""
    from runner.errors import RunnerError

    base_path = project / "experiments" / "cpu-tiny.yaml"
    (project / "README.md").write_text("# My project\n")
    with pytest.raises(RunnerError, match=r"--out: .*README.md is there and was not written by `runner pilot-grid`"):
        write_pilot_grid(base_path, ["llama-tiny@1"], ["100K"], project)
    assert (project / "README.md").read_text() == "# My project\n" and not list(project.glob("*.yaml"))
    out = project / "pilots"
    first = write_pilot_grid(base_path, ["llama-tiny@1"], ["100K"], out)
    assert write_pilot_grid(base_path, ["llama-tiny@1"], ["100K"], out) == first  # a rerun
    first[0].write_text("name: mine\n")
    with pytest.raises(RunnerError, match=f"{first[0].name} is there and was not written"):
        write_pilot_grid(base_path, ["llama-tiny@1"], ["100K"], out)
    assert first[0].read_text() == "name: mine\n"


def test_each_pilot_is_written_once(project):
    """`--sizes h64,h64` or `--budgets 1e5,99000` (both 48 global batches) listed one pilot twice in
    README.md ("2 pilot experiments", one file); `--sizes n_layers=3,n_layers=3+n_heads=4` (the base's
    n_heads) wrote two files of one model, and `hidden_size=128+hidden_size=64` one of hidden size 64; `--budgets 1001472,1003520` (both "1M") wrote one file
    twice, the second over the first, while README.md listed both. Each is one line, nothing written."""
    base_path = project / "experiments" / "cpu-tiny.yaml"
    out = project / "experiments" / "pilots"
    cases = [
        (["hidden_size=64", " hidden_size=64"], ["100K"], r"--sizes: 'hidden_size=64' is given twice"),
        (["llama-tiny@1"], ["100K", "100K"], r"--budgets: '100K' is given twice"),
        (["llama-tiny@1"], ["1e5", "99000"], r"--budgets: '1e5' and '99000' are the same pilot: both round to 98,304"),
        (
            ["llama-tiny@1"],
            ["1001472", "1003520"],
            r"--budgets: .* would both be written to cpu-tiny-pilot-llama-tiny-1M",
        ),
        (
            ["hidden_size=128+n_layers=3", "n_layers=3+hidden_size=128"],
            ["100K"],
            r"--sizes: 'hidden_size=128\+n_layers=3' and 'n_layers=3\+hidden_size=128' are the same pilot",
        ),
        # one resolved model, named two ways: the base's own n_heads given, or its recipe given as a shape
        (["n_layers=3", "n_layers=3+n_heads=4"], ["100K"], r"--sizes: 'n_layers=3' and 'n_layers=3\+n_heads=4' are"),
        (["llama-tiny@1", "hidden_size=64"], ["100K"], r"--sizes: 'llama-tiny@1' and 'hidden_size=64' are the same"),
        (["hidden_size=128+hidden_size=64"], ["100K"], r"--sizes: size .*: hidden_size is given twice: give it once"),
    ]
    for sizes, budgets, message in cases:
        with pytest.raises(RunnerError, match=message):
            write_pilot_grid(base_path, sizes, budgets, out)
        assert not out.exists()
    files = write_pilot_grid(base_path, ["llama-tiny@1", "hidden_size=128"], ["100K", "1003520"], out)
    assert len(set(files)) == len(files) == 5
