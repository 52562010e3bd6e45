"""`runner job EXPERIMENT --slurm | --skypilot`: job files from the hardware recipe, checked by the engines' own tools.

The SkyPilot task is loaded by SkyPilot's task loader (`sky.Task.from_yaml`, the `skypilot` test
extra) with the network refused and an empty HOME: no cloud credentials, catalog or API server.
skypilot pins click<=8.1.8, which huggingface-hub 2.x refuses, so it may live in a Python of its
own: RUNNER_SKYPILOT_PYTHON names it (default: this Python; `.ci/run` makes one, and where it is named
the test fails rather than skips). The Slurm script is checked by bash
and run for real in tests/e2e/test_multinode.py (its torchrun line, with Slurm's variables, on two nodes).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml
from timeouts import SUBPROCESS_TIMEOUT_S
from trainfixtures import REPO, make_project, run_in_process

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


def job(*args: str, cwd=REPO):
    proc = run_in_process(cwd, ["job", *args], dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


PIN = {"sha256": "a" * 64, "commit": "0" * 40}


@pytest.fixture()
def pinned(tmp_path):
    """A copy of the project's recipes and experiments with the 1p3b family pinned (as `runner pin`
    leaves them after fetch and prepare; files are not checked by `runner job`): returns its root."""
    root = tmp_path / "project"
    shutil.copytree(REPO / "recipes", root / "recipes")
    shutil.copytree(REPO / "experiments", root / "experiments")
    base = root / "experiments" / "1p3b.yaml"
    body = yaml.safe_load(base.read_text())
    body["data"]["manifests"]["web"]["sha256"] = PIN["sha256"]
    body["overrides"] = {
        "tokenizer": {"sha256": PIN["sha256"], "hub": {"revision": PIN["commit"]}},
        "mixture": {"domains": {"web": {"source": {"revision": PIN["commit"]}}}},
    }
    base.write_text(yaml.safe_dump(body, sort_keys=False))
    return root


def test_slurm_script_from_the_hardware_recipe(pinned):
    script = job("experiments/1p3b-4x8-fsdp.yaml", "--slurm", "--run-dir", "runs/1p3b/main", cwd=pinned)
    sbatch = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)", script, re.M))
    assert sbatch["nodes"] == "4" and sbatch["gpus-per-node"] == "8" and sbatch["ntasks-per-node"] == "1"
    assert "requeue" in sbatch  # preempted: back in the queue, and the fixed RUN_DIR resumes
    assert "exclusive" in sbatch and sbatch["cpus-per-task"] == str(8 * (1 + 3))  # 8 ranks x (1 thread + 3)
    assert sbatch["signal"] == "B:TERM@120"  # to the batch shell, whose trap passes it to srun
    exp = load_experiment(pinned / "experiments" / "1p3b-4x8-fsdp.yaml", check_files=False)
    wall = build_plan(exp.config, root=exp.project_root)["time"]["assumed"]["wall_hours"]
    days, minutes = divmod(math.ceil(wall * 60 * 1.25), 24 * 60)
    assert sbatch["time"] == f"{days}-{minutes // 60:02d}:{minutes % 60:02d}:00"  # the plan's wall + 25%
    assert "partition" not in sbatch and "account" not in sbatch
    assert "RUN_DIR=runs/1p3b/main " in script
    srun = script[script.index("srun ") :]
    assert 'torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 --max-restarts 1 --rdzv-backend c10d' in srun
    assert '--rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID"' in srun
    assert '-m runner launch experiments/1p3b-4x8-fsdp.yaml --run-dir "$RUN_DIR" &' in srun
    exports = dict(kv.split("=") for kv in re.search(r"^export (.*)$", script, re.M).group(1).split())
    restart = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # torchrun's restart needs it (test_multinode)
    assert exports == {"ACCELERATE_MIXED_PRECISION": "bf16", **restart, **FSDP2_ENV}  # docs/MULTI_NODE.md's list
    cost = build_plan(exp.config, root=exp.project_root)["time"]["assumed"]["cost_usd"]
    assert f"x $3.50/device-h = ${cost:,.0f}" in script
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    flags = ("--time", "2-00:00:00", "--partition", "gpu-long", "--account", "proj.42", "--cpus-per-task", "96")
    chosen = job("experiments/1p3b-4x8-fsdp.yaml", "--slurm", *flags, "--shared", cwd=pinned)
    sbatch = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)", chosen, re.M))
    assert (sbatch["time"], sbatch["partition"], sbatch["account"], sbatch["cpus-per-task"]) == flags[1::2]
    assert "exclusive" not in sbatch
    ddp = job("experiments/1p3b-1x8-ddp.yaml", "--slurm", cwd=pinned)
    assert "FSDP" not in ddp and "export ACCELERATE_MIXED_PRECISION=bf16 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in ddp
    cpu = job("experiments/cpu-tiny-fsdp.yaml", "--slurm")
    assert "--gpus-per-node" not in cpu and "--exclusive" not in cpu  # a CPU recipe books no GPU, shares its node
    assert "#SBATCH --cpus-per-task=2\n" in cpu  # 2 processes x hardware.threads 1
    wrong = run_in_process(REPO, ["job", "experiments/cpu-tiny.yaml", "--slurm", "--bucket", "b"], dict(os.environ))
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr == "error: --bucket: only a SkyPilot task mounts a bucket (--skypilot)\n"


def _refused(cwd, *args) -> str:
    proc = run_in_process(cwd, ["job", *args], dict(os.environ))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    return lines[0]


def test_job_refuses_an_unpinned_experiment_and_flags_it_cannot_write_safely():
    line = _refused(REPO, "experiments/1p3b-4x8-fsdp.yaml", "--slurm")  # as shipped: nothing pinned yet
    assert line.startswith("error: experiments/1p3b-4x8-fsdp.yaml: not pinned (tokenizer.sha256, ")
    assert "runner pin experiments/1p3b-4x8-fsdp.yaml" in line
    exp = ("experiments/cpu-tiny.yaml", "--slurm")
    assert _refused(REPO, *exp, "--partition", "a;touch P").startswith("error: --partition: 'a;touch P' is not")
    assert _refused(REPO, *exp, "--account", "$(id)").startswith("error: --account: ")
    assert _refused(REPO, *exp, "--time", "1:00\ntouch P").startswith("error: --time: ")
    assert _refused(REPO, *exp, "--run-dir", "runs/x\ntouch P").startswith("error: --run-dir: ")
    for empty in ("", "  "):  # `--run-dir "$RUN"` with RUN unset took a new run folder silently
        assert _refused(REPO, *exp, "--run-dir", empty) == (
            "error: --run-dir: is empty: give the run folder, or leave --run-dir out for a new one"
        )
    assert _refused(REPO, *exp, "--cpus-per-task", "99999999999999") == (
        "error: --cpus-per-task: must be 1 to 4096 (more than any node has), got 99999999999999"
    )
    assert _refused(REPO, *exp, "--time", "99999999-00:00:00") == (  # sbatch refused it only at submission
        "error: --time: '99999999-00:00:00' is over 365 days: give the job's real limit"
    )
    sky = ("experiments/cpu-tiny.yaml", "--skypilot")
    assert _refused(REPO, *sky, "--bucket", "My Bucket").startswith("error: --bucket: ")
    assert _refused(REPO, *sky, "--tracking-uri", "http://x'; touch P").startswith("error: --tracking-uri: ")
    assert _refused(REPO, *exp, "--tracking-uri", "http://m:5000").startswith("error: --tracking-uri: a SkyPilot")
    assert not (REPO / "P").exists()


@pytest.mark.slow
def test_job_refuses_a_time_limit_the_run_could_not_train_in():
    """The job saves and requeues itself SIGNAL_SECONDS before its limit: under 10 minutes every attempt
    would resume and save without training, and 0 is Slurm's "no limit"."""
    from runner.cli.job import slurm_seconds

    assert [slurm_seconds(t) for t in ("10", "10:30", "1:00:00", "2-0", "1-02:03", "0-00:30:00")] == [
        600,
        630,
        3600,
        172800,
        93780,
        1800,
    ]
    exp = ("experiments/cpu-tiny.yaml", "--slurm")
    for short in ("0", "9", "9:59", "00:09:59", "0-00:05"):
        line = _refused(REPO, *exp, "--time", short)
        assert line.startswith(f"error: --time: {short!r} is under 10 minutes"), line
    assert "no limit" in _refused(REPO, *exp, "--time", "0")
    for ok in ("10", "0-00:10", "1-0"):
        proc = run_in_process(REPO, ["job", *exp, "--time", ok, "--run-dir", "runs/cpu-tiny/t"], dict(os.environ))
        assert proc.returncode == 0 and f"#SBATCH --time={ok}\n" in proc.stdout, proc.stderr


INJECTION = "cpu\ntouch P\n#"  # issue 37, item 3: the adversary's hardware recipe


def test_a_recipe_string_cannot_inject_a_line_into_a_job_file(tmp_path):
    """A control character in any recipe string is refused at validation, naming the file and key;
    and should one reach the writer, the comment stays one line and the YAML stays what it was."""
    import dataclasses

    from runner.cli.job import skypilot_task, slurm_script

    exp_path = make_project(tmp_path, steps=2)
    hw = tmp_path / "recipes" / "hardware" / "cpu.yaml"
    hw.write_text(hw.read_text().replace("device_name: cpu", f"device_name: {json.dumps(INJECTION)}"))
    for verb in (["validate", str(exp_path)], ["job", str(exp_path), "--slurm"], ["job", str(exp_path), "--skypilot"]):
        proc = run_in_process(tmp_path, verb, dict(os.environ))
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error")]
        assert proc.returncode == 2 and "touch" not in proc.stdout and len(errors) == 1, (verb, proc.stderr)
        assert errors[0].startswith("error: recipes/hardware/cpu.yaml: device_name: 'cpu\\ntouch P\\n#' holds a ")
        assert "control character (U+000A)" in errors[0]
    hw.write_text(hw.read_text().replace(json.dumps(INJECTION), "cpu"))
    exp = load_experiment(exp_path, check_files=False)
    cfg = exp.config
    forged = dataclasses.replace(
        cfg,
        name="t\ntouch P",
        hardware=dataclasses.replace(cfg.hardware, device_name=INJECTION),
    )
    exp = dataclasses.replace(exp, config=forged)
    script = slurm_script(exp, "exp.yaml; touch P", "runs/a b")
    assert "touch P" not in [x.strip() for x in script.splitlines()]
    assert all(x.startswith(("#", "set ", "cd ", "RUN_DIR=")) for x in script.splitlines()[:20] if "touch P" in x)
    assert "#SBATCH --job-name=t_touch_P\n" in script and "launch 'exp.yaml; touch P'" in script
    assert "RUN_DIR='runs/a b'" in script
    task_text = skypilot_task(exp, "exp.yaml", "runs/a", "b-runner")
    task = yaml.safe_load(task_text)
    assert task["name"] == "t\ntouch P" and task["num_nodes"] == 1  # a value, quoted by the YAML writer
    assert all(x.startswith("#") for x in task_text.splitlines()[:2])


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


def test_skypilot_task_keeps_what_outlives_the_cluster_and_installs_the_runtime_only(pinned):
    task = yaml.safe_load(job("experiments/1p3b-4x8-fsdp.yaml", "--skypilot", "--bucket", "my-runs", cwd=pinned))
    assert task["file_mounts"] == {"/runner-store": {"name": "my-runs", "mode": "MOUNT_CACHED"}}
    assert task["envs"]["MLFLOW_TRACKING_URI"] == "sqlite:////runner-store/mlflow.db"  # on the bucket
    assert task["setup"].splitlines()[-1] == 'python -m pip install --quiet -e ".[gpu]"'  # no dev, no eval
    uri = ("--tracking-uri", "http://mlflow.internal:5000")
    served = yaml.safe_load(job("experiments/1p3b-4x8-fsdp.yaml", "--skypilot", *uri, cwd=pinned))
    assert served["envs"]["MLFLOW_TRACKING_URI"] == uri[1]
    cpu = yaml.safe_load(job("experiments/cpu-tiny.yaml", "--skypilot"))
    assert cpu["setup"].splitlines()[-1] == "python -m pip install --quiet -e ."
    assert cpu["file_mounts"]["/runner-store"]["name"] == "cpu-tiny-runner"
    # the run folder is on the bucket: a relative --run-dir under it (in the workdir it went with the cluster)
    assert cpu["envs"]["RUN_DIR"].startswith("/runner-store/runs/cpu-tiny/")
    on = yaml.safe_load(job("experiments/cpu-tiny.yaml", "--skypilot", "--run-dir", "runs/cpu-tiny/main"))
    assert on["envs"]["RUN_DIR"] == "/runner-store/runs/cpu-tiny/main"
    for off in ("/scratch/runs/x", "../x", "runs/../../x"):
        line = _refused(REPO, "experiments/cpu-tiny.yaml", "--skypilot", "--run-dir", off)
        assert line.startswith(f"error: --run-dir: {off!r} is not under the bucket mounted at /runner-store"), line


@pytest.mark.slow
def test_skypilot_task_loads_in_skypilots_own_loader_offline(tmp_path, pinned):
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
    text = job("experiments/1p3b-4x8-fsdp.yaml", "--skypilot", "--bucket", "my-runs", cwd=pinned)
    proc = _load(tmp_path, text)
    assert proc.returncode == 0, proc.stderr[-3000:]
    task = json.loads(proc.stdout.splitlines()[-1])
    assert task["name"] == "1p3b-4x8-fsdp" and task["num_nodes"] == 4 and task["accelerators"] == {"H200": 8}
    assert task["storage"] == {"/runner-store": "my-runs"}
    assert task["envs"]["RUN_DIR"].startswith("/runner-store/runs/1p3b-4x8-fsdp/")  # on the shared bucket
    assert task["envs"]["FSDP_VERSION"] == "2" and task["setup"].strip().endswith('-e ".[gpu]"')
    assert task["envs"]["MLFLOW_TRACKING_URI"] == "sqlite:////runner-store/mlflow.db"
    assert (
        "--nnodes $SKYPILOT_NUM_NODES --nproc-per-node 8 --max-restarts 1" in task["run"]
        and "$SKYPILOT_NODE_IPS" in task["run"]
    )
    mi = job("experiments/1p3b-mi300x.yaml", "--skypilot", cwd=pinned)
    mi = json.loads(_load(tmp_path, mi).stdout.splitlines()[-1])
    assert mi["accelerators"] == {"MI300X": 1} and mi["num_nodes"] == 1
    # The loader is a real check: a task it cannot read is refused.
    broken = _load(tmp_path, text.replace("num_nodes: 4", "num_nodes: four"))
    assert broken.returncode != 0 and "num_nodes" in broken.stderr
