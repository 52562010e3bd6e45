"""`runner job --slurm`'s script under a signal, and under Slurm's own check where Slurm runs.

Slurm sends `--signal=B:TERM@120` to the batch shell alone: the script's trap must pass it to srun (and
srun to torchrun, torchrun to the ranks), the runner must save its SIGTERM checkpoint, and the job
must requeue itself so its next start resumes the run. Here the script runs under bash with `srun`
and `scontrol` stand-ins on PATH (srun runs its command; scontrol answers `show hostnames` and logs
`requeue`), and the test sends SIGTERM to bash only, as Slurm does. Where a loopback Slurm can start
(tests/slurmcluster.py: slurm-wlm installed, root), `sbatch --test-only` accepts the script with its
--time, --partition, --account and --cpus-per-task.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import slurmcluster
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trainfixtures import env, make_project, run_in_process

SRUN = '#!/bin/bash\nwhile [ "${1#-}" != "$1" ]; do shift; done  # srun\'s options\nexec "$@"\n'
SCONTROL = '#!/bin/bash\nif [ "$1" = show ]; then echo 127.0.0.1; else echo "$*" >> "$SCONTROL_LOG"; fi\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _script(root: Path, exp: Path, *flags: str) -> Path:
    proc = run_in_process(root, ["job", str(exp), "--slurm", "--run-dir", "runs/sig", *flags], env(root))
    assert proc.returncode == 0, proc.stderr
    path = root / "job.sbatch"
    path.write_text(proc.stdout)
    return path


def _job_env(root: Path) -> dict:
    shims = root / "shims"
    shims.mkdir(exist_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (shims / name).write_text(body)
        (shims / name).chmod(0o755)
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_SUBMIT_DIR": str(root)}
    return env(
        root,
        PATH=f"{shims}:{os.environ['PATH']}",
        SCONTROL_LOG=str(root / "scontrol.log"),
        MASTER_PORT=_free_port(),
        **slurm,
    )


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_slurm_s_signal_reaches_the_runner_which_saves_and_the_job_requeues(tmp_path):
    pools = {"a": (0.5, 200_000, 400), "b": (0.5, 200_000, 300)}  # 2,000 steps of 128 tokens: under 1 epoch
    exp = make_project(tmp_path, steps=2000, checkpoint_every=10_000, eval_every=10_000, pools=pools)
    script = _script(tmp_path, exp)
    run = tmp_path / "runs" / "sig"
    job_env = _job_env(tmp_path)
    proc = subprocess.Popen(
        ["bash", str(script)], cwd=tmp_path, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    rows = run / "metrics" / "train.jsonl"
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not (rows.exists() and rows.read_text().count("\n") >= 2) and proc.poll() is None:
        assert time.monotonic() < deadline, "no training step within the bound"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)  # the batch shell only (--signal=B:...)
    out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    said = [x for x in err.splitlines() if "stopped by signal at step" in x]
    assert len(said) == 1 and "checkpoint saved" in said[0], err[-3000:]
    step = int(said[0].split("stopped by signal at step ")[1].split(";")[0])
    assert 0 < step < 2000
    assert (run / "checkpoints" / f"step-{step:07d}").is_dir()
    assert json.loads((run / "run.json").read_text())["status"] == "preempted"
    assert "requeueing job 77 to resume it" in err
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
    # The requeued job resumes RUN_DIR: the script names it fixed (a launch of a run folder resumes it,
    # tests/training/test_train.py), so its next start is `resuming from step-...`.
    assert "RUN_DIR=runs/sig " in script.read_text()


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sbatch_test_only_accepts_the_script_on_a_loopback_slurm(tmp_path):
    why = slurmcluster.why_not()
    if why is not None:
        pytest.skip(why)
    exp = make_project(tmp_path, steps=2)
    script = _script(tmp_path, exp, "--time", "0-00:30:00", "--partition", "loopback", "--account", "proj.1")
    cluster = slurmcluster.Cluster(tmp_path / "slurm").start(timeout=SUBPROCESS_TIMEOUT_S)
    try:
        proc = subprocess.run(
            ["sbatch", "--test-only", str(script)],
            cwd=tmp_path,
            env={**os.environ, **cluster.env},
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        wrong = subprocess.run(
            ["sbatch", "--test-only", "--partition=nosuch", str(script)],
            cwd=tmp_path,
            env={**os.environ, **cluster.env},
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
    finally:
        cluster.stop()
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr
    assert wrong.returncode != 0  # the check is real: a partition the cluster lacks is refused
