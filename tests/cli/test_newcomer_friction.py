"""What a newcomer tripped on (issue 27, "Newcomer friction"): the demo's small-validation warning
said once, not once per experiment; validate's summary after its errors when piped; the audit's
MLflow line a line, not 2,000 characters of keys; no `hfu recomputed PASS nan` on a run without
recomputation; the throughput and repetition plots readable."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import matplotlib
import pytest
from runfixtures import make_run

from runner.cli import main
from runner.data.manifest import said_once
from runner.reports import tables as rpt
from runner.reports.audit.run import audit
from runner.reports.audit.tracked import key_groups


def test_the_demos_small_validation_warning_is_said_once(project_with_data, capsys, monkeypatch):
    monkeypatch.chdir(project_with_data)
    assert main(["validate", *(f"experiments/{n}.yaml" for n in ("cpu-tiny", "cpu-tiny-lr", "cpu-tiny-fsdp"))]) == 0
    out = capsys.readouterr().out
    legal = [line for line in out.splitlines() if "domain 'legal' is validated on 2 samples" in line]
    assert len(legal) == 1, out  # it was one line per experiment built on the demo data: 11 in check-pr
    assert (
        legal[0].startswith("warning: data.manifests.legal: ")
        and "(in 3 experiments: experiments/cpu-tiny.yaml, " in legal[0]
    )
    assert out.splitlines()[-1].endswith("valid, 0 invalid")


def test_said_once_keeps_a_single_warning_as_it_was_and_groups_the_rest():
    one = "experiments/a.yaml: data.manifests.x: small"
    assert said_once([one]) == [one]
    many = [f"experiments/{n}.yaml: data.manifests.x: small" for n in "abcde"]
    assert said_once([*many, "experiments/a.yaml: data.manifests.y: other"]) == [
        "data.manifests.x: small (in 5 experiments: experiments/a.yaml, experiments/b.yaml, experiments/c.yaml "
        "and 2 more)",
        "experiments/a.yaml: data.manifests.y: other",
    ]


def test_validates_summary_comes_after_its_errors_when_piped_together(project, tmp_path):
    bad = project / "experiments" / "bad.yaml"
    bad.write_text("base: cpu-tiny@2\nname: bad\nversion: 1\ndescription: x\ntrain: {seq_len: -1}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "validate", "experiments/cpu-tiny.yaml", "experiments/bad.yaml"],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe, as `2>&1 | less` reads it
        text=True,
        env=installed_env(),
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 2 and lines[-1] == "1 valid, 1 invalid", proc.stdout
    assert lines[0].startswith("ok  experiments/cpu-tiny.yaml") and lines[-2].startswith("error: experiments/bad.yaml")


def installed_env() -> dict[str, str]:
    """The environment as a user's shell has it: without PYTHONPATH where the package is installed (as
    ./install.sh does, editable). The project copy holds runner/builtin/assets/, a `runner/` folder without
    __init__.py in the working directory, which an editable install's finder lets shadow the package's
    __init__ (CI caught `runner.STARTED` missing there while a PYTHONPATH run passed)."""
    env = dict(os.environ)
    try:
        importlib.metadata.distribution("runner")
    except importlib.metadata.PackageNotFoundError:
        return env  # run from a source tree on PYTHONPATH: keep it
    env.pop("PYTHONPATH", None)
    return env


def test_a_runner_folder_in_the_working_directory_does_not_break_the_command(project):
    assert (project / "runner").is_dir() and not (project / "runner/__init__.py").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "data", "builtin"],  # a verb that says its whole wall time
        cwd=project,
        capture_output=True,
        text=True,
        env=installed_env(),
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "runner data: " in proc.stderr and " s in all, start-up included" in proc.stderr, proc.stderr


def test_uncompared_mlflow_keys_are_said_by_family():
    keys = [f"system/gpu_{i}_utilization" for i in range(40)] + [f"target.t{i}.value" for i in range(30)]
    said = key_groups([*keys, "loss", "lr", "grad_norm", "step/hfu"])
    assert said == "system/* (40 keys), target.* (30 keys), grad_norm, loss, lr, step/hfu"
    assert len(key_groups([f"k{i}" for i in range(500)])) < 80  # a line, however many
    assert key_groups([]) == "none"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("friction"))
    return rpt.write_report(run)


def test_a_run_without_recomputation_has_no_hfu_check_passing_on_nan(report):
    checks = {c.name: c for c in audit(report, check_mlflow=False).checks}
    assert "hfu recomputed" not in checks
    assert checks["hfu"].status == "INFO" and checks["hfu"].detail.startswith("none: the run recomputes no activations")


def test_throughput_legend_names_tokens_per_second_and_repetition_counts_are_integers_on_log_y(report, monkeypatch):
    saved = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: saved.__setitem__(path.name, fig))
    rpt.write_plots(rpt.read_tables(report), report)
    speed, share = saved["throughput.png"].axes  # two panels: MFU is tokens/s x a constant (issue 38 item 10)
    assert speed.get_ylabel() == "processed tokens / s" and share.get_ylabel() == "% of peak"
    assert [t.get_text() for t in share.get_legend().get_texts()] == ["MFU (step time)", "goodput MFU (wall time)"]
    legend = share.get_legend().get_window_extent()  # under the axes, covering no data
    assert legend.y1 <= share.get_window_extent().y0
    (rep,) = saved["repetition.png"].axes
    assert rep.get_yscale() == "log"
    assert all(float(t).is_integer() for t in rep.get_xticks())


def test_the_builtin_build_leaves_the_small_legal_domain_to_the_launch_s_one_warning(tmp_path, capsys):
    """Issue 38, item 9: the README's first command warns about the demo's `legal` domain once (its launch)."""
    assert main(["data", "builtin", "--out", str(tmp_path / "builtin")]) == 0
    printed = capsys.readouterr()
    assert "validated on" not in printed.out + printed.err
    assert (tmp_path / "builtin" / "legal" / "datacard.json").exists()  # what the domain is, for the card
