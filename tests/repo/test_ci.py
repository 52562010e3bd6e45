"""`.ci/run`: the device-version subset it names is real (each file exists and holds fast tests, so
its pytest never collects nothing: exit 5), and the pins are the GPU image's set (issue 21)."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / ".ci" / "run").read_text()


def _array(name: str) -> list[str]:
    body = re.search(rf"^{name}=\((.*?)\)$", SCRIPT, re.S | re.M)
    assert body, f".ci/run defines no {name}=(...)"
    return shlex.split(body.group(1))


def _is_slow(node: ast.AST) -> bool:
    return any("slow" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def test_the_device_subset_names_files_with_fast_tests():
    from conftest import HEAVY_FIXTURE_MODULES

    files = _array("DEVICE_TESTS")
    assert len(files) >= 8
    # the subset runs the quick tests and those of the heavy-fixture files the fast subset leaves out
    assert 'python -m pytest -m "not slow or device_subset" "${DEVICE_TESTS[@]}"' in SCRIPT
    assert set(HEAVY_FIXTURE_MODULES) <= set(files)
    for name in files:
        tree = ast.parse((ROOT / name).read_text())
        assert not any("pytestmark" in ast.unparse(n) and "slow" in ast.unparse(n) for n in tree.body), name
        fast = [
            n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_") and not _is_slow(n)
        ]
        assert fast, f"{name} has no test outside -m slow: the device-version run would skip it"
    # model, training, checkpoint, fetch and Hub code: the files the issue names are all in
    for must in (
        "training/test_model.py",
        "training/test_train.py",
        "training/test_checkpoint.py",
        "data/test_fetch.py",
    ):
        assert f"tests/{must}" in files
    assert "tests/training/test_loss.py" in files


def test_the_pins_are_the_gpu_images_versions():
    pins = dict(p.split("==") for p in _array("DEVICE_PINS"))
    assert pins["transformers"] == "5.17.0" and pins["huggingface_hub"] == "1.33.*"
    assert (pins["accelerate"], pins["tokenizers"], pins["safetensors"]) == ("1.15.0", "0.23.2", "0.8.0")
    assert "httpx" in pins  # what huggingface_hub 1.x speaks (2.x: httpx2, in the environment already)


def test_the_device_torch_is_the_one_the_device_ran():
    """The subset's torch is the build the H200 reported (its env.json), not the environment's."""
    pin = re.search(r"^DEVICE_TORCH=(\S+)$", SCRIPT, re.M)
    assert pin, ".ci/run defines no DEVICE_TORCH="
    image = json.loads((ROOT / "bench/measurements/h200-20261204-session2/call2/env.json").read_text())
    assert pin.group(1) == "torch==" + image["torch_version"].split("+")[0] == "torch==2.11.0"
    assert "PYTHONPATH=$overlay${PYTHONPATH:+:$PYTHONPATH} python -m pytest" in SCRIPT


def test_ci_runs_the_readme_command_in_a_fresh_environment_and_fails_on_either_run():
    assert 'rm -rf "$VENV"' in SCRIPT and '"$PY" -m venv "$VENV"' in SCRIPT
    assert "./install.sh && python -m pytest\n  main_rc=$?" in SCRIPT
    assert SCRIPT.rstrip().endswith('[ "$main_rc" -ne 0 ] && exit "$main_rc"\nexit "$device_rc"')


def test_ci_loads_the_skypilot_task_with_the_extras_skypilot():
    """tests/cli/test_job.py's SkyPilot loader runs in a venv `.ci/run` makes with pyproject's `skypilot`
    extra's pin, named in RUNNER_SKYPILOT_PYTHON before the README's command (named, the test fails
    rather than skips where it cannot import sky)."""
    pin = re.search(r'^skypilot = \["(skypilot==[^"]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert pin and f"SKY_PIN={pin.group(1)}\n" in SCRIPT
    named = SCRIPT.index("export RUNNER_SKYPILOT_PYTHON=$SKY/bin/python\n")
    assert named < SCRIPT.index("./install.sh && python -m pytest\n  main_rc=$?")
    assert '"$PY" -m venv "$SKY.partial"' in SCRIPT  # its own venv: not the environment the suite tests
