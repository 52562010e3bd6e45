"""Bad input never hangs and never tracebacks: one `error: file: key: message` line, exit 2, nothing
written (issue 12, item 6). Each attack of the issue is reproduced here, plus a fuzz test."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from bad_input_helpers import one_error, run_cli, time_limit
from trainfixtures import REPO, env, launch, make_project

from runner.errors import RunnerError

BILLION_LAUGHS = "\n".join(
    ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
)


def experiment(project: Path, name: str, body: str) -> Path:
    path = project / "experiments" / f"{name}.yaml"
    path.write_text(f"base: cpu-tiny@2\nname: {name}\nversion: 1\ndescription: attack\n{body}")
    return path


# ---- YAML that would hang or recurse ------------------------------------------------------------


@pytest.mark.parametrize(
    "body, says",
    [
        (BILLION_LAUGHS, "expands to more than 100,000 nodes"),
        ("x: &x [*x]", "recursive alias"),
        ("x: " + "[" * 3000 + "]" * 3000, "nested deeper than 64 levels"),
    ],
)
def test_hostile_yaml_is_refused_at_once(project, capsys, monkeypatch, body, says):
    monkeypatch.chdir(project)
    path = experiment(project, "bomb", body)
    t0 = time.perf_counter()
    line = one_error(*run_cli(capsys, "validate", path, seconds=30)[::2])
    assert_refused(line, "experiments/bomb.yaml", says)
    assert time.perf_counter() - t0 < 10
    # The same file where a run folder keeps its resolved experiment (fsio.read_yaml): `show` of it.
    run = project / "runs" / "r"
    run.mkdir(parents=True)
    (run / "experiment.yaml").write_text(body)
    t0 = time.perf_counter()
    line = one_error(*run_cli(capsys, "show", run, seconds=30)[::2])
    assert_refused(line, "runs/r/experiment.yaml", says)
    assert time.perf_counter() - t0 < 10


def assert_refused(line: str, file: str, says: str) -> None:
    """The runner's own bound, or (for nesting) PyYAML's: from 6.0.4 its scanner refuses a flow
    collection nested too deep ("exceeded maximum nesting depth") before the runner's bound is
    reached. Either is one line naming the file."""
    if says.startswith("nested deeper") and "exceeded maximum nesting depth" in line:
        assert line.startswith(f"error: {file}: ") and "not valid YAML" in line, line
    else:
        assert line.startswith(f"error: {file}: refused: ") and says in line, line


def test_a_budget_of_10_to_the_18_tokens_is_refused_without_replaying_it(project_with_data, capsys, monkeypatch):
    from runner.data.mixture import plan_mixture
    from runner.errors import MixtureInfeasible

    monkeypatch.chdir(project_with_data)
    path = experiment(project_with_data, "huge", "train: {exposure_tokens: 4611686018427387904}\n")  # 2**62
    line = one_error(*run_cli(capsys, "validate", path, seconds=30)[::2])
    assert "mixture infeasible: domain 'legal'" in line and "largest feasible budget at these ratios: 378,880" in line
    path = experiment(project_with_data, "huger", "train: {exposure_tokens: 1000000000000000000000000000000}\n")
    line = one_error(*run_cli(capsys, "validate", path, seconds=30)[::2])
    assert "train.exposure_tokens: 1.000e+30 is out of range" in line
    with time_limit(10), pytest.raises(MixtureInfeasible, match="largest feasible budget"):
        plan_mixture({"a": 10, "b": 10}, {"a": 0.5, "b": 0.5}, {"a": 2.0, "b": 2.0}, 10**18, 8, 4)
    # Feasible, with caps that allow it: planned in closed form (the schedule's period), not per step.
    with time_limit(10):
        plan = plan_mixture({"a": 10, "b": 10}, {"a": 0.5, "b": 0.5}, {"a": 1e17, "b": 1e17}, 10**18, 8, 4)
    assert plan.domains["a"].exposure_samples == 10**18 // 8 // 2


# ---- values validation must refuse --------------------------------------------------------------


@pytest.mark.parametrize(
    "body, says",
    [
        ("overrides: {optim: {lr: .nan}}", "optim.lr: must be a finite number, got nan"),
        ("overrides: {optim: {lr: .inf}}", "optim.lr: must be a finite number, got inf"),
        (
            "overrides: {mixture: {domains: {legal: {max_repetition_ratio: .inf}}}}",
            "mixture.domains.legal.max_repetition_ratio: must be a finite number, got inf",
        ),
        ("seed: 1000000000000000000000000000", "seed: 1.000e+27 is out of range"),
        ("seed: 4294967296", "seed: must be in [0, 2**32 - 1]"),
        ("train: {checkpoint: {keep_last: 0}}", "train.checkpoint.keep_last: must be >= 1, got 0"),
        (
            "train: {checkpoint: {stop_timeout_seconds: 0}}",
            "train.checkpoint.stop_timeout_seconds: must be in (0, 86,400] (the seconds a stopping rank waits",
        ),
        # a wait past threading.TIMEOUT_MAX: the system-metrics sampler's thread printed an OverflowError
        # traceback and the run trained on without it; the stop deadline's would have on a stop signal
        (
            "train: {system_metrics_interval_seconds: 1.0e+300}",
            "train.system_metrics_interval_seconds: must be in [0, 86,400] (0 = off), got 1e+300",
        ),
        (
            "train: {checkpoint: {stop_timeout_seconds: 1.0e+12}}",
            "train.checkpoint.stop_timeout_seconds: must be in (0, 86,400]",
        ),
        (
            "overrides: {model: {hidden_size: 1000000000, n_heads: 8, n_kv_heads: 8}}",
            "model: 8,000,005,157,000,000,000 parameters need",
        ),
    ],
)
def test_absurd_values_are_one_line_at_validate_and_launch_writes_nothing(project, capsys, monkeypatch, body, says):
    monkeypatch.chdir(project)
    path = experiment(project, "absurd", body)
    line = one_error(*run_cli(capsys, "validate", path)[::2])
    assert line.startswith("error: experiments/absurd.yaml: ") and says in line, line
    line = one_error(*run_cli(capsys, "launch", path, "--no-tracking")[::2])
    assert says in line and not (project / "runs").exists()


def test_a_nan_in_a_run_folders_experiment_is_one_line_not_a_fingerprint_traceback(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    code, out, _ = run_cli(capsys, "show", "experiments/cpu-tiny.yaml", "--json")
    resolved = json.loads(out)["config"]
    resolved["optim"]["lr"] = float("nan")
    run = project / "runs" / "nan"
    run.mkdir(parents=True)
    (run / "experiment.yaml").write_text(yaml.safe_dump(resolved))
    line = one_error(*run_cli(capsys, "show", run)[::2])
    assert "optim.lr: must be a finite number" in line


def test_a_run_folder_or_its_resolved_copy_given_as_an_experiment_is_one_line(project, capsys, monkeypatch):
    """validate, plan and launch take an experiment file; a run's resolved experiment.yaml (every recipe
    section written out) is one line naming what to give, not a line per section; so is a folder to plan."""
    monkeypatch.chdir(project)
    code, out, _ = run_cli(capsys, "show", "experiments/cpu-tiny.yaml", "--json")
    run = project / "runs" / "cpu-tiny" / "r1"
    run.mkdir(parents=True)
    (run / "experiment.yaml").write_text(yaml.safe_dump(json.loads(out)["config"], sort_keys=False))
    before = sorted(p.relative_to(project) for p in (project / "runs").rglob("*"))
    for verb in (("validate",), ("plan",), ("launch", "--no-tracking")):
        line = one_error(*run_cli(capsys, verb[0], "runs/cpu-tiny/r1/experiment.yaml", *verb[1:])[::2])
        assert line == (
            "error: runs/cpu-tiny/r1/experiment.yaml: a run's resolved experiment (every recipe section "
            "written out), not an experiment file: give the experiment it was resolved from "
            "(experiments/cpu-tiny.yaml); `runner show` prints this copy"
        ), verb
        line = one_error(*run_cli(capsys, verb[0], "runs/cpu-tiny/r1", *verb[1:])[::2])
        if verb[0] == "validate":  # a folder: the .yaml files under it
            assert line.startswith("error: runs/cpu-tiny/r1/experiment.yaml: a run's resolved experiment"), line
        elif verb[0] == "launch":  # a folder: a run to resume
            assert line.startswith("error: runs/cpu-tiny/r1: not a run folder"), line
        else:
            assert line == (
                "error: runs/cpu-tiny/r1: a folder: give an experiment file (experiments/NAME.yaml); "
                "`runner show runs/cpu-tiny/r1` prints the resolved runs/cpu-tiny/r1/experiment.yaml"
            ), verb
    assert sorted(p.relative_to(project) for p in (project / "runs").rglob("*")) == before  # nothing written
    assert run_cli(capsys, "show", "runs/cpu-tiny/r1")[0] == 0  # what the lines point to works
    # another file of a run folder (run.json, ledger.json) was read as an experiment: a line per key
    (run / "run.json").write_text(json.dumps({"run_id": "r1", "segments": [], "status": "finished"}))
    for verb in ("validate", "plan", "launch", "show"):
        line = one_error(*run_cli(capsys, verb, "runs/cpu-tiny/r1/run.json")[::2])
        assert line == (
            "error: runs/cpu-tiny/r1/run.json: a file of the run folder runs/cpu-tiny/r1, not an experiment file: "
            "`runner launch runs/cpu-tiny/r1` resumes the run; `runner show runs/cpu-tiny/r1` prints the resolved "
            "runs/cpu-tiny/r1/experiment.yaml"
        ), verb


@pytest.mark.slow  # ~3.5 s: three whole `runner validate` runs
def test_validate_takes_folders_of_recipes_and_experiments(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    code, out, err = run_cli(capsys, "validate", "recipes/model", "experiments")
    files = sorted(project.glob("recipes/model/*.yaml")) + sorted(project.glob("experiments/**/*.yaml"))
    assert code == 0 and err == "", err
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("ok  ")] == [
        str(f.relative_to(project)) for f in files
    ]
    assert out.splitlines()[-1] == f"{len(files)} valid, 0 invalid"
    (project / "recipes" / "model" / "empty").mkdir()
    line = one_error(*run_cli(capsys, "validate", "recipes/model/empty")[::2])
    assert line == "error: recipes/model/empty: a folder with no recipe or experiment .yaml file under it"
    # the checkout and recipes/ as `runner validate` alone checks them (not recipes/hardware/accelerate)
    whole = run_cli(capsys, "validate")
    assert whole[0] == 0 and run_cli(capsys, "validate", ".") == whole
    recipes = [ln for ln in whole[1].splitlines() if ln.startswith("ok  recipes/")]
    code, out, _ = run_cli(capsys, "validate", "recipes")
    assert code == 0 and out.splitlines()[:-1] == recipes and out.splitlines()[-1] == f"{len(recipes)} valid, 0 invalid"


@pytest.fixture()
def fresh_accelerate():
    """accelerate's process-wide state reset around a launch run in this process: a launch refused after
    its Accelerator was made (bf16 for a GPU recipe) would leave it for the next test's launch."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_a_launch_or_smoke_refused_for_its_device_or_its_pins_writes_no_folder(
    project_with_data, capsys, monkeypatch, fresh_accelerate
):
    """A GPU recipe on another device, and a smoke of an experiment launch would refuse (its tokenizer
    unpinned), are one line each, before a run folder is written (the smoke wrote its two folders, then
    failed in its launches or with a traceback)."""
    project = project_with_data
    monkeypatch.chdir(project)
    monkeypatch.setenv("RUNNER_SIMULATE_DEVICE", "rocm:AMD Instinct MI300X:gfx942")
    says = "error: experiments/gpu-smoke.yaml: hardware.accelerator: recipe says cuda (H200 SXM), this process runs on rocm"
    for argv in (("launch", "experiments/gpu-smoke.yaml", "--no-tracking"), ("smoke", "experiments/gpu-smoke.yaml")):
        line = one_error(*run_cli(capsys, *argv)[::2])
        assert line.startswith(says), (argv, line)
        assert not (project / "runs").exists(), argv
    monkeypatch.setenv("RUNNER_SIMULATE_DEVICE", "cuda:NVIDIA H200")
    line = one_error(*run_cli(capsys, "smoke", "experiments/1p3b.yaml")[::2])
    assert line.startswith("error: recipes/tokenizer/gpt-neox-20b.yaml: sha256: not pinned: `runner pin "), line
    assert not (project / "runs").exists()
    # smoke empties its --out of an earlier smoke's two runs only: a folder of real runs is refused, kept
    monkeypatch.delenv("RUNNER_SIMULATE_DEVICE")
    mine = project / "runs" / "cpu-tiny"
    (mine / "reference").mkdir(parents=True)
    (mine / "reference" / "run.json").write_text("{}")
    (mine / "r1").mkdir()
    line = one_error(*run_cli(capsys, "smoke", "experiments/cpu-tiny.yaml", "--out", str(mine))[::2])
    assert line == (
        f"error: --out: {mine} holds r1: smoke empties its --out of an earlier smoke's reference/ and resumed/ "
        "runs only; give a new folder"
    )
    assert (mine / "reference" / "run.json").read_text() == "{}"


@pytest.mark.parametrize(
    "text, tokens",
    [
        ("614400", 614400),
        ("614_400", 614400),
        ("6.144e5", 614400),
        ("614.4K", 614400),
        ("26B", 26 * 10**9),
        ("0.5t", 5 * 10**11),
        ("9223372036854775807", 2**63 - 1),
    ],
)
def test_extend_to_takes_a_token_count_as_people_write_it(text, tokens):
    from runner.cli import build_parser

    assert build_parser().parse_args(["launch", "runs/x", "--extend-to", text]).extend_to == tokens


@pytest.mark.parametrize(
    "argv, says",
    [
        (("--extend-to", "100x"), "argument --extend-to: not a positive whole number of tokens"),
        (("--extend-to", "2.5"), "argument --extend-to: not a positive whole number of tokens"),
        (("--extend-to", "1e999"), "argument --extend-to: not a positive whole number of tokens up to 2**63 - 1"),
        (("--extend-to", "nan"), "argument --extend-to: not a positive whole number of tokens"),
        (("--max-steps", "0"), "argument --max-steps: must be >= 1, got 0"),
        (("--max-steps", "two"), "argument --max-steps: must be a whole number >= 1, got 'two'"),
        (("--run-name", "../../evil"), "argument --run-name: a run name is one folder name"),  # out of runs/
        (("--run-name", "a/b"), "argument --run-name: a run name is one folder name"),
        (("--run-name", "-x"), "argument --run-name: expected one argument"),
        (("--run-name", ".hidden"), "argument --run-name: a run name is one folder name"),
    ],
)
def test_launch_options_out_of_range_are_one_line_before_anything_runs(project, capsys, monkeypatch, argv, says):
    from runner.cli import main

    monkeypatch.chdir(project)
    with pytest.raises(SystemExit) as e:
        main(["launch", "experiments/cpu-tiny.yaml", "--no-tracking", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"runner launch: error: {says}" in err, err
    assert "Traceback" not in err and not (project / "runs").exists()


def test_a_run_folder_that_cannot_be_made_is_one_line(project_with_data, capsys, monkeypatch, fresh_accelerate):
    monkeypatch.chdir(project_with_data)
    (project_with_data / "blocker").write_text("a file where the run folder's parent would be\n")
    line = one_error(
        *run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--no-tracking", "--run-dir", "blocker/run")[::2]
    )
    assert line == "error: blocker/run: cannot create the run folder: Not a directory", line
    # a folder of other files is not made a run folder (`--run-dir .` mixed the run into the project)
    listing = sorted(p.name for p in project_with_data.iterdir())
    line = one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--no-tracking", "--run-dir", ".")[::2])
    assert line.startswith(
        "error: .: --run-dir: holds blocker, data, experiments ... and no run: --run-dir names a new"
    ), line
    assert sorted(p.name for p in project_with_data.iterdir()) == listing
    line = one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--run-dir", "blocker")[::2])
    assert line == "error: blocker: exists and is not a folder: give a new folder for the run", line
    # --run-name of an existing run said "became a run while this launch started ... launch again", forever
    taken = project_with_data / "runs" / "cpu-tiny" / "taken"
    taken.mkdir(parents=True)
    (taken / "experiment.yaml").write_text("name: cpu-tiny\n")
    (taken / "run.json").write_text(json.dumps({"run_id": "taken", "status": "finished"}))
    line = one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--run-name", "taken")[::2])
    assert line == (
        "error: runs/cpu-tiny/taken: --run-name: already a run (finished): `runner launch runs/cpu-tiny/taken` "
        "resumes or extends it; give another --run-name for a new run"
    ), line
    (taken.parent / "notes").mkdir()
    (taken.parent / "notes" / "mine.txt").write_text("mine")
    line = one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--run-name", "notes")[::2])
    assert line.startswith("error: runs/cpu-tiny/notes: --run-name: holds mine.txt and no run"), line


def test_a_smoke_never_empties_the_folder_another_smoke_is_running_in(project_with_data, capsys, monkeypatch):
    """Two `runner smoke --out DIR` at once: the second emptied DIR/reference while the first trained in
    it, then both launches wrote one folder (a report's staged folder removed under the other: a
    traceback; the first smoke compared weights of runs that were not its own). Two default smokes of
    one second shared `runs/EXP/smoke-<second>` the same way. The smoke's folder is now locked for its
    whole run (a second is refused in one line, nothing removed) and a default one is made by the smoke
    that names it (`smoke-<second>-2` for the second)."""
    from runner.cli import train as train_cli
    from runner.runs.lock import RunLock
    from runner.training import launch as launching

    monkeypatch.chdir(project_with_data)

    def launched(run_dir, *extra):  # where the smoke's first launch would start: stop there
        raise RunnerError(f"launch of {run_dir}")

    monkeypatch.setattr(train_cli, "_launch_cmd", launched)
    out = project_with_data / "smoke-out"
    (out / "reference").mkdir(parents=True)
    (out / "reference" / "run.json").write_text('{"status": "running"}')
    with RunLock(out, "runner smoke"):  # another smoke's, running
        line = one_error(*run_cli(capsys, "smoke", "experiments/cpu-tiny.yaml", "--out", str(out))[::2])
    assert line.startswith("error: smoke-out: in use by runner smoke ("), line
    assert (out / "reference" / "run.json").read_text() == '{"status": "running"}'
    # once that smoke is done, its folder (its lock file included) is emptied and used again
    line = one_error(*run_cli(capsys, "smoke", "experiments/cpu-tiny.yaml", "--out", str(out))[::2])
    assert line == f"error: launch of {out / 'reference'}", line
    assert (out / "reference" / "run.json").read_text() != '{"status": "running"}'  # a new run's

    monkeypatch.setattr(launching, "timestamp", lambda: "20260101-000000")
    earlier = project_with_data / "runs" / "cpu-tiny" / "smoke-20260101-000000"
    (earlier / "reference").mkdir(parents=True)
    (earlier / "reference" / "run.json").write_text('{"status": "running"}')
    code, said, err = run_cli(capsys, "smoke", "experiments/cpu-tiny.yaml")
    assert f"x2 in {Path('runs/cpu-tiny/smoke-20260101-000000-2')}" in said, said
    assert err.strip() == f"error: launch of {Path('runs/cpu-tiny/smoke-20260101-000000-2/reference')}", err
    assert (earlier / "reference" / "run.json").read_text() == '{"status": "running"}'


@pytest.mark.slow  # one step trained
def test_launches_of_one_second_get_folders_of_their_own_and_a_refused_one_leaves_none(
    project_with_data, capsys, monkeypatch, fresh_accelerate
):
    """Two `runner launch experiments/cpu-tiny.yaml` started together both took runs/cpu-tiny/<second>:
    the second was refused ("in use by runner launch"). The default folder is made by the launch that
    names it (mkdir, never taken twice): the second gets `<second>-2`. One refused after naming its
    folder leaves no empty folder, nor the runs/ it made."""
    import contextlib

    from runner.training import launch as launching

    monkeypatch.chdir(project_with_data)
    monkeypatch.setattr(launching, "timestamp", lambda: "20260101-000000")
    with contextlib.ExitStack() as held:
        first = launching.new_timestamped_folder(Path("runs/x"), held)
        second = launching.new_timestamped_folder(Path("runs/x"), held)
        assert (first.name, second.name) == ("20260101-000000", "20260101-000000-2")
        (first / "run.json").write_text("{}")  # the first launch wrote its run; the second was refused
    assert first.is_dir() and not second.exists()

    taken = project_with_data / "runs" / "cpu-tiny" / "20260101-000000"  # a launch of this second made it
    taken.mkdir(parents=True)
    (taken / "experiment.yaml").write_text("name: cpu-tiny\n")
    (taken / "run.json").write_text(json.dumps({"run_id": taken.name, "status": "running"}))
    code, out, err = run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--no-tracking", "--max-steps", "1")
    assert code == 0 and "runs/cpu-tiny/20260101-000000-2" in out + err, err  # was: "became a run ..."
    assert json.loads((taken / "run.json").read_text())["status"] == "running"  # the other run untouched
    shutil.rmtree(project_with_data / "runs")

    def refused(cfg):
        raise RunnerError("refused after the folder was named", key="hardware")

    monkeypatch.setattr(launching, "check_device", refused)
    assert not (project_with_data / "runs" / "cpu-tiny").exists()
    line = one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--no-tracking")[::2])
    assert line == "error: experiments/cpu-tiny.yaml: hardware: refused after the folder was named", line
    assert not (project_with_data / "runs" / "cpu-tiny").exists()
    (project_with_data / "runs").write_text("a file where the runs folder would be\n")
    line = one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml", "--no-tracking")[::2])
    assert line == "error: runs/cpu-tiny/20260101-000000: cannot create the run folder: Not a directory", line


def test_the_cards_reproduce_line_names_a_run_as_launch_takes_it(monkeypatch):
    """`--run-name ID` where launch takes ID as a run name; a `--run-dir` folder's other name as that
    folder, quoted (a card's command stays one word per argument)."""
    from types import SimpleNamespace

    from runner.export import card

    seg = {"fingerprint": "f" * 64, "exposure_tokens": 614400}
    src = SimpleNamespace(
        run={},
        run_dir=Path("runs/x/r1"),
        final=True,
        exp=SimpleNamespace(config=SimpleNamespace(name="x"), fingerprint="f" * 64),
    )
    for run_id, first, then in [
        ("20261201-crash-resume", "--run-name 20261201-crash-resume", "runs/x/20261201-crash-resume"),
        ("my run; rm -rf ~", "--run-dir 'runs/x/my run; rm -rf ~'", "'runs/x/my run; rm -rf ~'"),
    ]:
        monkeypatch.setattr(card, "as_record", lambda run, i=run_id: SimpleNamespace(run_id=i, segments=[seg, seg]))
        assert card.reproduce_lines(src) == [
            f"runner launch experiments/x.yaml {first}   # fingerprint ffffffffffff",
            f"runner launch {then} --extend-to 614400   # fingerprint ffffffffffff",
        ]


def test_show_of_a_folder_that_is_no_run_says_what_it_takes(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    (project / "runs" / "cpu-tiny").mkdir(parents=True)
    line = one_error(*run_cli(capsys, "show", "runs/cpu-tiny")[::2])
    assert line == (
        "error: runs/cpu-tiny: a folder without experiment.yaml: give an experiment file "
        "(experiments/NAME.yaml) or a run folder (runs/NAME/RUN_ID)"
    )


# ---- files that are not what they claim --------------------------------------------------------


def test_a_tokenizer_path_that_is_a_folder(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    recipe = project / "recipes" / "tokenizer" / "builtin-bpe-4k.yaml"
    recipe.write_text(recipe.read_text().replace("assets/tokenizer.json", "assets"))
    line = one_error(*run_cli(capsys, "validate", "experiments/cpu-tiny.yaml")[::2])
    assert line == (
        "error: experiments/cpu-tiny.yaml: tokenizer.path: runner/builtin/assets is a folder: "
        "name the tokenizer.json file in it"
    )
    assert one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml")[::2]) == line
    assert not (project / "runs").exists()
    code, _, err = run_cli(
        capsys, "data", "prepare", "--domain", "d", "--tokenizer", "runner/builtin/assets", "--input", ".", "--out", "o"
    )
    assert one_error(code, err) == "error: runner/builtin/assets: is a folder: name the tokenizer.json file in it"
    assert not (project / "o").exists()


def test_a_parquet_text_column_of_integers_is_refused_before_anything_is_written(project, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(project)
    pq.write_table(pa.table({"id": ["a", "b"], "text": [1, 2]}), project / "ints.parquet")
    out = project / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # a previous prepare's: must survive the refusal
    code, _, err = run_cli(
        capsys,
        "data",
        "prepare",
        "--domain",
        "web",
        "--tokenizer",
        "runner/builtin/assets/tokenizer.json",
        "--input",
        "ints.parquet",
        "--out",
        "out",
    )
    assert one_error(code, err) == "error: ints.parquet: text: `text` column holds int64, not strings"
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize("shard_path", ["../escape.bin", "/etc/hostname", "sub/../../escape.bin"])
def test_manifest_shard_paths_that_leave_its_folder_are_refused(tmp_path, capsys, shard_path):
    from runner.data.manifest import load_manifest, manifest_sha256

    make_project(tmp_path)
    path = tmp_path / "data" / "a" / "manifest.json"
    data = json.loads(path.read_text())
    data["shards"][0]["path"] = shard_path
    data["manifest_sha256"] = manifest_sha256(data)  # consistently re-sealed: only the path is wrong
    path.write_text(json.dumps(data))
    with pytest.raises(RunnerError, match=r"shards\.0\.path: .* leaves the manifest's folder"):
        load_manifest(path)
    line = one_error(*run_cli(capsys, "data", "verify", path)[::2])
    assert "shards.0.path" in line and "leaves the manifest's folder" in line


def test_a_manifest_nested_a_hundred_thousand_deep_is_one_line(tmp_path, capsys):
    path = tmp_path / "manifest.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    line = one_error(*run_cli(capsys, "data", "verify", path)[::2])
    assert line == f"error: {path}: refused: nested too deeply"


# ---- a full disk in the middle of a checkpoint --------------------------------------------------

# A write that fails for real, from the kernel: for the second checkpoint only, files may not grow past
# 4 KB (RLIMIT_FSIZE, SIGXFSZ ignored), so safetensors' own write of model.safetensors fails mid-file.
WRITE_FAILS_DRIVER = """
import resource, signal, sys
import runner.training.checkpoint as ck

real_save, calls = ck.Checkpointer.save, []
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # here: the save runs in the checkpoint writer's thread

def save_on_a_disk_that_fills_up_the_second_time(self, *args, **kwargs):
    calls.append(1)
    if len(calls) != 2:
        return real_save(self, *args, **kwargs)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        return real_save(self, *args, **kwargs)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

ck.Checkpointer.save = save_on_a_disk_that_fills_up_the_second_time
from runner.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_write_failing_mid_checkpoint_is_one_line_and_the_run_resumes(tmp_path):
    from runner.fsio import sha256_file
    from runner.runs.checkpoints import verify

    exp = make_project(tmp_path, steps=8, checkpoint_every=2, keep_last=3)
    reference = tmp_path / "runs" / "ref"
    launch(tmp_path, exp, "--run-dir", reference, "--no-tracking")
    run = tmp_path / "runs" / "full"
    driver = tmp_path / "disk_fills_up.py"
    driver.write_text(WRITE_FAILS_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(driver), "launch", str(exp), "--run-dir", str(run), "--no-tracking"],
        cwd=tmp_path,
        env=env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: runs/full/checkpoints: cannot write checkpoint step-0000004: File too large;")
    assert "the previous checkpoints are untouched" in errors[0]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "failed" and "cannot write checkpoint step-0000004" in info["error"]
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002"] and verify(root / "step-0000002") is None
    launch(tmp_path, run, "--no-tracking")
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    final = "checkpoints/step-0000008/model.safetensors"
    assert sha256_file(run / final) == sha256_file(reference / final)  # resumed as if nothing happened


def test_no_space_left_is_said_as_such(tmp_path, monkeypatch):
    import torch
    from safetensors import SafetensorError

    import runner.training.checkpoint as ck

    def disk_full(tensors, filename, *args, **kwargs):  # safetensors' writer
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def disk_full_hashed(tensors, path, *args, **kwargs):  # the runner's one-pass writer: Python's OSError
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "save_file", disk_full)
    monkeypatch.setattr(ck, "save_safetensors_hashed", disk_full_hashed)
    with pytest.raises(RunnerError) as err:
        ck.Checkpointer(tmp_path, 1, 0, 1).save(1, {"w": torch.zeros(2)}, {"state": {}, "param_groups": []}, {}, {})
    assert str(err.value).endswith(
        "checkpoints: cannot write checkpoint step-0000001: No space left on device; free some space; "
        "the previous checkpoints are untouched and the run resumes from the newest of them"
    )
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no temporary left behind


@pytest.mark.parametrize(
    "table, drop, says",
    [
        ("validation", "bpb", "validation.parquet: bpb: column missing"),
        ("run_summary", "params", "run_summary.parquet: params: column missing"),
        ("validation", "loss_nats=text", "validation.parquet: loss_nats: must hold numbers"),
    ],
)
def test_fit_over_a_report_folder_missing_a_column_is_one_line(tmp_path, capsys, monkeypatch, table, drop, says):
    import pandas as pd

    monkeypatch.chdir(tmp_path)
    rep = tmp_path / "r1" / "report"
    rep.mkdir(parents=True)
    frames = {
        "run_summary": pd.DataFrame(
            [{"run_id": "r1", "params": 1000, "params_counted": "non_embedding", "exposure_tokens": 64000}]
        ),
        "validation": pd.DataFrame([{"step": 10, "domain": "web", "loss_nats": 4.0, "bpb": 1.0, "tokens": 64}]),
    }
    column, _, value = drop.partition("=")
    edited = frames[table].assign(**{column: value}) if value else frames[table].drop(columns=[column])
    for name, df in {**frames, table: edited}.items():
        df.to_parquet(rep / f"{name}.parquet")
    line = one_error(*run_cli(capsys, "fit", "r1", "--out", "fit")[::2])
    assert line.startswith(f"error: r1/report/{says}"), line
    frames["run_summary"].to_parquet(rep / "run_summary.parquet")
    (rep / "validation.parquet").write_bytes(b"PAR1 torn")
    assert "validation.parquet: unreadable parquet" in one_error(*run_cli(capsys, "fit", "r1", "--out", "fit")[::2])


# ---- fuzz: recipe values and YAML shapes --------------------------------------------------------

# key -> the kind of value it holds; the fuzz mostly gives each key values of its kind (so that the
# rules behind the type checks are reached), sometimes anything at all.
KEYS = {
    "seed": int,
    "train.seq_len": int,
    "train.global_batch_sequences": int,
    "train.micro_batch_sequences": int,
    "train.exposure_tokens": int,
    "train.max_duration_tokens": int,
    "train.hard_stop_tokens": int,
    "train.log_interval_steps": int,
    "train.checkpoint.keep_last": int,
    "train.checkpoint.interval_steps": int,
    "train.checkpoint.interval_minutes": float,
    "train.checkpoint.stop_timeout_seconds": float,
    "overrides.optim.lr": float,
    "overrides.optim.eps": float,
    "overrides.optim.min_lr_ratio": float,
    "overrides.optim.decay_fraction": float,
    "overrides.optim.betas": list,
    "overrides.optim.warmup_tokens": int,
    "overrides.optim.schedule": str,
    "overrides.model.hidden_size": int,
    "overrides.model.n_layers": int,
    "overrides.model.n_heads": int,
    "overrides.model.n_kv_heads": int,
    "overrides.model.intermediate_size": int,
    "overrides.model.pad_vocab_multiple": int,
    "overrides.model.rope_theta": float,
    "overrides.mixture.domains.legal.target_ratio": float,
    "overrides.mixture.domains.code.target_ratio": float,
    "overrides.mixture.domains.code.max_repetition_ratio": float,
    "overrides.mixture.domains.legal.max_repetition_ratio": float,
    "overrides.mixture.domains": dict,
    "overrides.tokenizer.path": str,
    "overrides.tokenizer.vocab_size": int,
    "overrides.tokenizer.eos_id": int,
    "overrides.tokenizer.token_dtype": str,
    "overrides.hardware.memory_gib": float,
    "overrides.hardware.devices_per_node": int,
    "overrides.hardware.nodes": int,
    "overrides.hardware.peak_tflops": float,
    "overrides.hardware.price_per_device_hour_usd": float,
    "overrides.eval.samples_per_domain": int,
    "overrides.eval.interval_steps": int,
    "overrides.eval.micro_batch_sequences": int,
    "data.manifests.code.path": str,
    "data.manifests.code.sha256": str,
    "data.manifests.extra": dict,
    "recipes.model": str,
    "base": str,
    "name": str,
    "plan.raw_bytes_per_token": float,
    "surprise": str,
}


def _fuzz_strategies():
    from hypothesis import strategies as st

    ints = st.one_of(
        st.integers(min_value=-3, max_value=5000),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([0, 1, 2, 16, 128, 2048, 307200, 2**31, 2**32, 2**63 - 1, 2**63, 10**27]),
    )
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=2))
    strings = st.one_of(
        st.text(max_size=20),
        st.sampled_from(
            [
                "${train.seq_len}",
                "${oc.env:HOME}",
                "???",
                "cpu-tiny@2",
                "llama-tiny@1",
                "data/builtin/code/manifest.json",
            ]
            + ["runner/builtin/assets", "/etc/passwd", "../../x", "uint16", "uint32", "wsd", "a" * 64]
        ),
    )
    scalar = st.one_of(ints, floats, strings, st.booleans(), st.none())
    wild = st.recursive(
        scalar,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=6,
    )
    typed = {
        int: ints,
        float: st.one_of(floats, ints),
        str: strings,
        list: st.lists(st.one_of(floats, ints), max_size=3),
        dict: st.dictionaries(st.sampled_from(["code", "prose", "legal", "x"]), wild, max_size=3),
    }
    change = st.sampled_from(sorted(KEYS)).flatmap(
        lambda k: st.tuples(st.just(k), st.one_of(typed[KEYS[k]], typed[KEYS[k]], typed[KEYS[k]], wild))
    )
    changes = st.lists(change, min_size=1, max_size=3)
    yaml_text = st.text(alphabet=st.sampled_from(list("ab:- &*[]{},'\"!\n#%|>?.0123456789e+")), max_size=80)
    return changes, yaml_text


def _document(changes) -> dict:
    doc = {"base": "cpu-tiny@2", "name": "fuzz", "version": 1, "description": "fuzz"}
    for key, value in changes:
        node = doc
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return doc


@pytest.mark.slow
def test_fuzzed_recipes_and_yaml_exit_0_or_2_without_traceback_or_hang(project_with_data, capsys, monkeypatch):
    from hypothesis import HealthCheck, given, settings

    monkeypatch.chdir(project_with_data)
    path = project_with_data / "experiments" / "fuzz.yaml"
    changes, yaml_text = _fuzz_strategies()

    def check(text: str) -> None:
        path.write_text(text)
        for argv in (("validate", path), ("show", path), ("plan", path)):
            code, _, err = run_cli(capsys, *argv, seconds=20)
            assert code in (0, 2), (argv, text, err)
            if code == 2:
                assert err.strip() and all(line.startswith("error: ") for line in err.strip().splitlines()), err

    # RUNNER_FUZZ_EXAMPLES=1000 for a longer hunt; CI's default keeps the suite inside its minutes.
    examples = int(os.environ.get("RUNNER_FUZZ_EXAMPLES", "60"))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(changes)
    def values(change_list):
        check(yaml.safe_dump(_document(change_list), allow_unicode=True))

    @settings(max_examples=max(examples // 2, 1), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(yaml_text)
    def shapes(text):
        check("base: cpu-tiny@2\nname: fuzz\nversion: 1\ndescription: fuzz\n" + text)

    values()
    shapes()


# ---- fuzz: fetch records --------------------------------------------------------------------------


def _record_edit_strategy(good: dict):
    """A fetch record with one key deleted or given any value (the file entries' keys included), or
    a JSON document of any shape."""
    from hypothesis import strategies as st

    wild = st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**65), 2**65),
            st.floats(),
            st.text(max_size=12),
            st.sampled_from(["../../x", "/etc/passwd", "0" * 40, "0" * 64, "runner-fetch/1"]),
        ),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=5,
    )
    keys = [(k,) for k in good] + [("files", i, k) for i, f in enumerate(good["files"]) for k in f]
    keys += [("files", 0, "identity", 0), ("files", 9), ("extra",)]

    def apply(where, value, delete):
        doc = json.loads(json.dumps(good))
        node = doc
        for part in where[:-1]:
            node = node[part]
        last = where[-1]
        if delete and isinstance(node, dict):
            node.pop(last, None)
        elif isinstance(node, list) and isinstance(last, int) and last >= len(node):
            node.append(value)
        else:
            node[last] = value
        return doc

    edited = st.builds(apply, st.sampled_from(keys), wild, st.booleans())
    return st.one_of(edited, edited, edited, wild)


@pytest.mark.slow
def test_fuzzed_fetch_records_exit_0_or_2_without_traceback(project, tmp_path, capsys, monkeypatch):
    from hubfixtures import _exp, serving_hub, use_hub
    from hypothesis import HealthCheck, given, settings

    from runner.data.fetch import fetch_experiment

    with serving_hub(tmp_path) as hub:
        use_hub(project, hub, monkeypatch)
        fetch_experiment(_exp(project), say=lambda _: None)
    assert run_cli(capsys, "data", "prepare", "experiments/tiny-hub.yaml")[0] == 0
    path = project / "data/raw/tiny-fineweb/.runner-fetch.json"
    good = json.loads(path.read_text())
    examples = int(os.environ.get("RUNNER_FUZZ_EXAMPLES", "60")) // 3

    @settings(max_examples=max(examples, 1), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_record_edit_strategy(good))
    def records(doc):
        path.write_text(json.dumps(doc))
        for argv in (
            ("data", "prepare", "experiments/tiny-hub.yaml"),
            ("pin", "--dry-run", "experiments/tiny-hub.yaml"),
        ):
            code, _, err = run_cli(capsys, *argv, seconds=60)
            assert code in (0, 2), (argv, doc, err)
            if code == 2:
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), (argv, doc, err)

    records()


def test_a_key_set_twice_is_refused_naming_the_file_key_and_both_lines(project, capsys, monkeypatch, tmp_path):
    """Issue 37 item 7: YAML keeps the last of two equal keys silently (`seed: 1` then `seed: 2`
    trained with seed 2); a recipe, an experiment and a claims file refuse it in one line."""
    monkeypatch.chdir(project)
    path = experiment(project, "twice", "seed: 1\nseed: 2\n")
    line = one_error(*run_cli(capsys, "validate", path)[::2])
    assert line == (
        "error: experiments/twice.yaml: seed: duplicate key: lines 5 and 6 both set it (YAML keeps the last "
        "silently): keep one"
    ), line
    recipe = project / "recipes/optim/adamw-tiny.yaml"
    recipe.write_text(recipe.read_text().replace("grad_clip: 1.0\n", "grad_clip: 1.0\nbetas: [0.9, 0.99]\n"))
    line = one_error(*run_cli(capsys, "validate", project / "experiments/cpu-tiny.yaml")[::2])
    assert line.startswith("error: recipes/optim/adamw-tiny.yaml: betas: duplicate key: lines 6 and 9 "), line
    nested = experiment(project, "nested", "train:\n  seq_len: 128\n  seq_len: 64\n")
    line = one_error(*run_cli(capsys, "validate", nested)[::2])
    assert "experiments/nested.yaml: train.seq_len: duplicate key: lines 6 and 7" in line, line
    claims = tmp_path / "claims.yaml"
    claims.write_text("claims:\n  - name: a\n    model_params: 1.0e+9\n    model_params: 2.0e+9\n")
    line = one_error(*run_cli(capsys, "audit-claims", claims)[::2])
    assert "error: claims.yaml: claims[0].model_params: duplicate key: lines 3 and 4" in line, line


def test_a_folder_where_a_json_or_yaml_file_is_read_is_one_line(tmp_path, capsys):
    """`runner plan X --fit FOLDER` ended in an IsADirectoryError traceback (fsio.read_json)."""
    line = one_error(*run_cli(capsys, "plan", str(REPO / "experiments/cpu-tiny.yaml"), "--fit", str(tmp_path))[::2])
    assert line == f"error: {tmp_path}: is a folder, not a JSON file"
    line = one_error(*run_cli(capsys, "audit-claims", str(tmp_path))[::2])
    assert line == f"error: {tmp_path}: is a folder, not a YAML file"


def test_an_output_path_that_is_a_folder_or_under_a_file_is_one_line_and_nothing_is_written(
    tmp_path, capsys, monkeypatch
):
    """check-pr's and compare's --markdown FOLDER or FILE/x.md and fit's --out FILE ended in tracebacks
    (IsADirectoryError from the write, FileExistsError from mkdir), check-pr's after the whole review."""
    monkeypatch.chdir(tmp_path)  # not a git checkout: check-pr names --markdown before it looks for one
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("mine")
    reports = [str(REPO / "reports" / e / "20261201-crash-resume") for e in ("cpu-tiny", "cpu-tiny-moe")]
    cases = [
        (["check-pr", "--base", "HEAD", "--markdown", "d"], "--markdown: d is a folder: give the file to write"),
        (
            ["check-pr", "--base", "HEAD", "--markdown", "f/x.md"],
            "--markdown: f/x.md cannot be written: f is a file, not a folder",
        ),
        (
            ["compare", *reports, "--markdown", "f/x.md"],
            "--markdown: f/x.md cannot be written: f is a file, not a folder",
        ),
        (["compare", *reports, "--out", "f/x"], "--out: f/x cannot be made: f is a file, not a folder"),
        (["fit", reports[0], "--out", "f"], "--out: f exists and is not a folder: give a folder"),
        (["fit", reports[0], "--out", "f/g"], "--out: f/g cannot be made: f is a file, not a folder"),
    ]
    for argv, says in cases:
        assert one_error(*run_cli(capsys, *argv)[::2]) == f"error: {says}", argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]
    assert (tmp_path / "f").read_text() == "mine" and not any((tmp_path / "d").iterdir())


def test_an_os_error_naming_a_path_is_one_line_and_one_naming_none_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    """The CLI's last net: a path the system refused that no check of the verb named (here a folder read
    as a file) is `error: PATH: reason`, exit 2; an OSError naming no path is no user's input: raised."""
    import runner.cli as cli

    monkeypatch.setattr(cli, "_cmd_show", lambda args: Path(args.experiment).read_text())
    assert one_error(*run_cli(capsys, "show", str(tmp_path))[::2]) == f"error: {tmp_path}: Is a directory"
    for var, value in (("RANK", "3"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4")):  # a path one rank alone fails on
        monkeypatch.setenv(var, value)
    assert one_error(*run_cli(capsys, "show", str(tmp_path))[::2]) == f"error: rank 3: {tmp_path}: Is a directory"

    def no_path(args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cli, "_cmd_show", no_path)
    with pytest.raises(OSError, match="Input/output error"):
        cli.main(["show", "x"])


def test_report_of_a_run_folder_refuses_dest_which_it_would_not_use(tmp_path, capsys):
    """`runner report RUN_DIR --dest X` wrote RUN_DIR/report and said nothing of X (--dest is where an
    MLflow run's artifacts are downloaded): refused, nothing written."""
    run = tmp_path / "run"
    run.mkdir()
    line = one_error(*run_cli(capsys, "report", str(run), "--dest", str(tmp_path / "x"))[::2])
    assert line == f"error: --dest: is for an MLflow run id: a run folder's report is written to {run / 'report'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not any(run.iterdir())


def test_a_report_folder_is_never_taken_for_the_run_it_reports_on(tmp_path, capsys, monkeypatch):
    """A report folder holds copies of run.json and experiment.yaml, so it passed for a run folder:
    `runner launch reports/X/Y --extend-to N` wrote a segment, a lock and fingerprint.txt into a published
    report and failed; `runner report` of it left a lock file there. Each verb is one line, the copy untouched."""
    import shutil

    report = tmp_path / "report"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", report)
    before = {p.relative_to(report): p.read_bytes() for p in report.rglob("*") if p.is_file()}
    monkeypatch.chdir(tmp_path)
    says = (
        "error: report: a report folder (its run.json and experiment.yaml are copies), not a run folder: "
        "give the run folder it reports on (runs/<experiment>/<run_id>)"
    )
    for argv in (
        ["launch", "report", "--extend-to", "378880", "--no-tracking"],
        ["launch", "report"],
        ["sync", "report"],
        ["export", "report", "--out", "out"],
        ["eval", "report"],
    ):
        assert one_error(*run_cli(capsys, *argv)[::2]) == says, argv
    line = one_error(*run_cli(capsys, "report", "report")[::2])
    assert line.startswith("error: report: a report folder: `runner report` rebuilds a report from its run folder")
    assert {p.relative_to(report): p.read_bytes() for p in report.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_run_name_with_a_run_to_resume_is_refused_not_ignored(tmp_path, capsys, monkeypatch):
    """`runner launch RUN --run-name x` (or `--run-dir RUN --run-name x`) resumed RUN under its own id and
    said nothing of x: refused in one line; the run's own id is taken."""
    run = tmp_path / "runs" / "cpu-tiny" / "r1"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "r1", "experiment": "cpu-tiny"}))
    from runner.config.load import load_experiment, to_yaml

    (run / "experiment.yaml").write_text(to_yaml(load_experiment(REPO / "experiments/cpu-tiny.yaml").config))
    monkeypatch.chdir(tmp_path)
    says = "--run-name: names a new run; runs/cpu-tiny/r1 is run r1, resumed or extended under that name"
    assert one_error(*run_cli(capsys, "launch", "runs/cpu-tiny/r1", "--run-name", "x")[::2]).endswith(says)
    argv = ["launch", str(REPO / "experiments/cpu-tiny.yaml"), "--run-dir", "runs/cpu-tiny/r1", "--run-name", "x"]
    assert one_error(*run_cli(capsys, *argv)[::2]).endswith(says)


@pytest.mark.parametrize("version", ["0", "-3"])
def test_an_experiment_version_below_1_is_refused_as_a_recipes_is(project, capsys, monkeypatch, version):
    """An experiment's version is an integer >= 1 (README, as every recipe's); 0 and -3 were valid."""
    monkeypatch.chdir(project)
    path = project / "experiments" / "vzero.yaml"
    path.write_text(f"base: cpu-tiny@2\nname: vzero\nversion: {version}\ndescription: attack\n")
    line = one_error(*run_cli(capsys, "validate", path)[::2])
    assert line == f"error: experiments/vzero.yaml: version: must be an integer >= 1, got {version}", line


def test_a_broken_base_experiment_is_said_once_not_once_per_experiment_built_on_it(project, capsys, monkeypatch):
    """validate (and check-pr, through the same loads) found a base file's problem again through each
    experiment built on it and printed the same line once per experiment."""
    monkeypatch.chdir(project)
    experiment(project, "za", "train: {seq_len: [}\n")
    for name in ("zb", "zc"):
        (project / "experiments" / f"{name}.yaml").write_text(
            f"base: za@1\nname: {name}\nversion: 1\ndescription: on za\n"
        )
    code, out, err = run_cli(capsys, "validate", *(f"experiments/{n}.yaml" for n in ("za", "zb", "zc")))
    assert code == 2 and out.strip().splitlines()[-1] == "0 valid, 3 invalid", out
    assert err.splitlines() == [
        "error: experiments/za.yaml: line 5: not valid YAML: did not find expected node content"
    ]


@pytest.mark.parametrize("change", [{"domain": None}, {"loss_nats": "x"}], ids=["no-domain", "loss-text"])
def test_the_launchs_closing_summary_never_fails_a_run_that_trained(tmp_path, capsys, change):
    """After the loop, the launch prints the counters and each domain's last validation loss from
    metrics/eval.jsonl: a row without its domain (KeyError) or with a loss of text (a format error) was a
    traceback after the run had trained and its report had been refused in one line. The summary leaves
    the validation line out (the report's line said why) and prints the rest."""
    from runfixtures import make_run

    from runner.cli.train import _print_summary

    run = make_run(tmp_path)
    path = run / "metrics" / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[-1] = {k: v for k, v in {**rows[-1], **change}.items() if v is not None}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    _print_summary(run)
    out = capsys.readouterr().out
    assert "  tokens: processed " in out and "validation loss" not in out, out
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    _print_summary(run)
    assert "  validation loss nats / bpb: " in capsys.readouterr().out
