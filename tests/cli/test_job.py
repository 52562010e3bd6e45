"""`runner job EXPERIMENT --slurm | --skypilot`: job files from the hardware recipe, checked by the engines' own tools.

The SkyPilot task is loaded by SkyPilot's task loader (`sky.Task.from_yaml`, the `skypilot` test
extra) with the network refused and an empty HOME: no cloud credentials, catalog or API server.
skypilot pins click<=8.1.8, which huggingface-hub 2.x refuses, so it may live in a Python of its
own: RUNNER_SKYPILOT_PYTHON names it (default: this Python; `.ci/run` makes one, and where it is named
the test fails rather than skips). The Slurm script is checked by bash
and run for real in tests/e2e/test_multinode.py (its torchrun line, with Slurm's variables, on two nodes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S
from trainfixtures import REPO, run_in_process

from runner.cli.job import FSDP2_ENV
from runner.config.load import load_experiment
from runner.planning.plan import build_plan

SKY_PYTHON = os.environ.get("RUNNER_SKYPILOT_PYTHON", sys.executable)
LOAD = textwrap.dedent(
    """
    import json, socket, sys
    def refuse(*args, **kwargs):
        raise OSError("network refused: the task loader must not need it")
    socket.socket.connect = socket.socket.connect_ex = socket.create_connection = socket.getaddrinfo = refuse
    import sky
    task = sky.Task.from_yaml(sys.argv[1])
    (res,) = task.resources
    print(json.dumps({"name": task.name, "num_nodes": task.num_nodes, "accelerators": res.accelerators,
                      "envs": task.envs, "storage": {k: v.name for k, v in task.storage_mounts.items()},
                      "run": task.run, "setup": task.setup}))
    """
)


def job(*args: str):
    proc = run_in_process(REPO, ["job", *args], dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_slurm_script_from_the_hardware_recipe():
    script = job("experiments/1p3b-4x8-fsdp.yaml", "--slurm", "--run-dir", "runs/1p3b/main")
    sbatch = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)", script, re.M))
    assert sbatch["nodes"] == "4" and sbatch["gpus-per-node"] == "8" and sbatch["ntasks-per-node"] == "1"
    assert "requeue" in sbatch  # preempted: back in the queue, and the fixed RUN_DIR resumes
    assert "RUN_DIR=runs/1p3b/main " in script
    srun = script[script.index("srun ") :]
    assert 'torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --max-restarts 1 --rdzv-backend c10d' in srun
    assert '--rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID"' in srun
    assert '-m runner launch experiments/1p3b-4x8-fsdp.yaml --run-dir "$RUN_DIR"' in srun
    exports = dict(kv.split("=") for kv in re.search(r"^export (.*)$", script, re.M).group(1).split())
    restart = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # torchrun's restart needs it (test_multinode)
    assert exports == {"ACCELERATE_MIXED_PRECISION": "bf16", **restart, **FSDP2_ENV}  # docs/MULTI_NODE.md's list
    exp = load_experiment(REPO / "experiments" / "1p3b-4x8-fsdp.yaml", check_files=False)
    cost = build_plan(exp.config, root=exp.project_root)["time"]["assumed"]["cost_usd"]
    assert f"x $3.50/device-h = ${cost:,.0f}" in script
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    ddp = job("experiments/1p3b-1x8-ddp.yaml", "--slurm")
    assert "FSDP" not in ddp and "export ACCELERATE_MIXED_PRECISION=bf16 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in ddp
    assert "--gpus-per-node" not in job("experiments/cpu-tiny-fsdp.yaml", "--slurm")  # a CPU recipe books no GPU
    wrong = run_in_process(REPO, ["job", "experiments/1p3b.yaml", "--slurm", "--bucket", "b"], dict(os.environ))
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr == "error: --bucket: only a SkyPilot task mounts a bucket (--skypilot)\n"


def _load(tmp_path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "task.yaml"
    path.write_text(text)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return subprocess.run(
        [SKY_PYTHON, "-c", LOAD, str(path)],
        env={"PATH": os.environ["PATH"], "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


@pytest.mark.slow
def test_skypilot_task_loads_in_skypilots_own_loader_offline(tmp_path):
    import json

    try:
        importable = subprocess.run([SKY_PYTHON, "-c", "import sky"], capture_output=True).returncode == 0
    except OSError:  # no such Python
        importable = False
    if not importable:
        named = "RUNNER_SKYPILOT_PYTHON" in os.environ  # .ci/run names its own: there, a skip would prove nothing
        (pytest.fail if named else pytest.skip)(
            f"skypilot is not importable by {SKY_PYTHON}: see pyproject's `skypilot` extra"
        )
    text = job("experiments/1p3b-4x8-fsdp.yaml", "--skypilot", "--bucket", "my-runs")
    proc = _load(tmp_path, text)
    assert proc.returncode == 0, proc.stderr[-3000:]
    task = json.loads(proc.stdout.splitlines()[-1])
    assert task["name"] == "1p3b-4x8-fsdp" and task["num_nodes"] == 4 and task["accelerators"] == {"H200": 8}
    assert task["storage"] == {"/runner-store": "my-runs"}
    assert task["envs"]["RUN_DIR"].startswith("/runner-store/runs/1p3b-4x8-fsdp/")  # on the shared bucket
    assert task["envs"]["FSDP_VERSION"] == "2" and task["setup"].strip() == "./install.sh"
    assert (
        "--nnodes $SKYPILOT_NUM_NODES --nproc-per-node 8 --max-restarts 1" in task["run"]
        and "$SKYPILOT_NODE_IPS" in task["run"]
    )
    mi = json.loads(_load(tmp_path, job("experiments/1p3b-mi300x.yaml", "--skypilot")).stdout.splitlines()[-1])
    assert mi["accelerators"] == {"MI300X": 1} and mi["num_nodes"] == 1
    # The loader is a real check: a task it cannot read is refused.
    broken = _load(tmp_path, text.replace("num_nodes: 4", "num_nodes: four"))
    assert broken.returncode != 0 and "num_nodes" in broken.stderr
