"""What `runner launch` has imported when its first step begins: nothing a run without targets or
reports needs, nor MLflow (in a process of its own when the run tracks) (runner.training.targets imports pandas only to make a frame;
runner.training.hf_models keeps transformers' detection losses from importing scipy, and 5.17's
assisted-generation candidates from importing scikit-learn, which imports scipy, pandas and pyarrow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S
from trainfixtures import env, make_project

#: packages the launch path must not import before the first step (mlflow: in its own process, or none)
NOT_BEFORE_FIRST_STEP = ("pandas", "pyarrow", "pandera", "scipy", "sklearn", "matplotlib", "mlflow")

# `runner launch` as `python -m runner` runs it, stopped where its first step begins
_DRIVER = """
import json, os, sys
from runner.training import startup

def first_step_begins():
    import transformers.utils
    print(json.dumps({
        "present": sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1].split(","))),
        "scipy_probe": transformers.utils.is_scipy_available(),
        "sklearn_probe": transformers.utils.is_sklearn_available(),
    }), flush=True)
    os._exit(0)

startup.step_begins = first_step_begins
from runner.cli import main
sys.exit(main(["launch", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("tracking", [False, True])
def test_a_launch_reaches_its_first_step_without_pandas_scipy_or_mlflow(tmp_path, tracking):
    """With tracking, MLflow runs in its own process (runner.training.mlflow_child): the launch's
    process imports none of it, and that process has made the MLflow run before the first step."""
    exp = make_project(tmp_path, steps=2)
    run = tmp_path / "runs" / "r"
    flags = ["--run-dir", str(run)] + ([] if tracking else ["--no-tracking"])
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, ",".join(NOT_BEFORE_FIRST_STEP), str(exp), *flags],
        cwd=tmp_path,
        env=env(tmp_path),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["present"] == []
    # transformers' own probes are back once its model modules loaded: scipy is installed (the planner's
    # fits), and scikit-learn (lm-eval's, the eval extra; transformers 5.17 imports it with every model)
    assert seen["scipy_probe"] is True and seen["sklearn_probe"] is True
    assert bool(json.loads((run / "run.json").read_text())["mlflow"].get("run_id")) == tracking
