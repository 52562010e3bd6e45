"""Two nodes on loopback: two torchrun agents meet through the c10d rendezvous, as two hosts would.

The one-process reference is a real one-node Slurm job (`runner job --slurm`'s script, sbatch'ed
to a slurm-wlm cluster started on loopback, tests/slurmcluster.py) where Slurm can start, else an
in-process launch. The DDP two-node run is that script's torchrun line on each node, with Slurm's
variables set by hand (a two-node Slurm job on one host needs a multiple-slurmd build).

Each agent is started as on its own host (`--nnodes 2 --nproc-per-node 1`, `--local-addr 127.0.0.1`
and `127.0.0.2`; with c10d torchrun orders the agents itself, by address, and the node is
`GROUP_RANK`). Node 1 runs from a folder of its own, so whatever it wrote beside the shared run
folder (a run folder of its own, an MLflow store) would show there. Every run is compared with ONE
one-process reference run of the same experiment (a session-wide fixture): weights within 1e-4 (as
tests/e2e/test_distributed.py allows for reduction order), audit consistent; the DDP run's ledger is
equal exactly; the FSDP2 run, elastic (--nnodes 1:2), meets a hung rank (the survivor's stop ends at
its bound), a node gone for good (world 1 after) and spent restarts (the job ends; the next launch
resumes), its ledger equal but for the lost work, counted once. Three torchrun runs in all.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import slurmcluster
import yaml
from safetensors.torch import load_file
from timeouts import SCALE, SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trainfixtures import env, launch, make_project, run_in_process

from runner.fsio import read_jsonl
from runner.reports.audit.run import audit
from runner.training.collectives import STOP_TIMEOUT_KEY

PROJECT = {"steps": 6, "micro": 2, "checkpoint_every": 3, "eval_every": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


NODES = (("127.0.0.1", 1), ("127.0.0.2", 0))  # (--local-addr, is_host): node 0's host serves the rendezvous


# How long an agent waits for the others (each round, restarts included): far below torchrun's 600 s,
# so a node that never comes back ends the job soon; ample for agents started together on a busy machine.
JOIN_TIMEOUT_S = int(120 * SCALE)


def _rdzv_conf(is_host: int) -> str:
    return f"is_host={is_host},join_timeout={JOIN_TIMEOUT_S}"


# The elastic run's train.checkpoint.stop_timeout_seconds: a survivor of a hung rank waits it out, then exits.
STOP_TIMEOUT_S = 2
# Under --nnodes 1:2, how long a round with one agent waits for the other: above the survivor's stop (its
# agent joins the next round only after it), so both nodes come back together; what a round alone costs.
LAST_CALL_S = int(10 * SCALE)


def _wait(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    done = []
    for p in procs:
        out, err = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _start(cmd: list[str], cwd: Path, environ: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def two_nodes(
    root: Path, *launch_args, node1_cwd: Path, restarts: int = 0, nnodes: str = "2"
) -> list[subprocess.CompletedProcess]:
    """`runner launch ARGS --no-tracking` under two torchrun agents (node 0 from `root`, node 1 from
    `node1_cwd`), torchrun restarting the group up to `restarts` times (under `--nnodes 1:2` the first
    round has both: started together, the second joins well within LAST_CALL_S of the first)."""
    port = _free_port()
    procs = []
    for (addr, is_host), cwd in zip(NODES, (root, node1_cwd)):
        conf = _rdzv_conf(is_host) + (f",last_call_timeout={LAST_CALL_S}" if ":" in nnodes else "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "multinode-test",
               "--rdzv-conf", conf, "--local-addr", addr, "--max-restarts", str(restarts),
               "-m", "runner", "launch", *map(str, launch_args), "--no-tracking"]  # fmt: skip
        # What runner job's files export: a restarted round needs its own process-group store (pytorch#135712).
        procs.append(_start(cmd, cwd, env(cwd, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")))
    return _wait(procs)


def slurm_nodes(root: Path, script: str, node1: Path) -> list[subprocess.CompletedProcess]:
    """The Slurm script's per-node command (what `srun` starts on each node) on two nodes, with the
    variables Slurm would set; torchrun's loopback-only options come from its PET_* variables."""
    body = re.sub(r"^srun .*\\$", lambda m: "exec \\", script, count=1, flags=re.M)
    assert body != script
    port = _free_port()
    procs = []
    for (addr, is_host), mine in zip(NODES, (root, node1)):
        slurm = {"SLURM_SUBMIT_DIR": str(root), "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1"}
        torchrun = {"MASTER_PORT": str(port), "PET_LOCAL_ADDR": addr, "PET_RDZV_CONF": _rdzv_conf(is_host)}
        # Each node's environment names an MLflow store in a folder of its own: only node 0's may appear.
        procs.append(_start(["bash", "-c", body], root, env(mine, **slurm, **torchrun)))
    return _wait(procs)


def _project(root: Path, distributed: str | None = None) -> Path:
    exp = make_project(root, **PROJECT)
    if distributed:
        recipe = root / "recipes" / "hardware" / "cpu.yaml"
        recipe.write_text(yaml.safe_dump({**yaml.safe_load(recipe.read_text()), "distributed": distributed}))
    return exp


def _files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}


def _weights(run: Path) -> dict:
    return load_file(str(run / "checkpoints" / "step-0000006" / "model.safetensors"))


def slurm_script(root: Path, exp: Path, run_dir: str) -> str:
    proc = run_in_process(root, ["job", str(exp), "--slurm", "--run-dir", run_dir], env(root))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, str | None]:
    """One process, the same experiment: the run every two-node run must equal; with the Slurm job's
    output when it ran as one (None: launched in process). ONE for the session: pytest-xdist's
    workers share the folder above their base temp, and the first to take the lock runs it."""
    base = tmp_path_factory.getbasetemp()  # under xdist: <session>/popen-gwN, the session's folder above it
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "multinode-reference"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        done = shared / "done.json"
        if not done.exists():
            output = _reference_run(shared / "project", tmp_path_factory)
            done.write_text(json.dumps({"slurm_output": output}))
    return shared / "project" / "runs" / "one", json.loads(done.read_text())["slurm_output"]


def _reference_run(root: Path, tmp_path_factory) -> str | None:
    exp = _project(root)
    if slurmcluster.why_not() is not None:
        launch(root, exp, "--run-dir", "runs/one", "--no-tracking")
        return None
    script = root / "job.sbatch"
    script.write_text(slurm_script(root, exp, "runs/one"))
    cluster = slurmcluster.Cluster(tmp_path_factory.mktemp("slurm")).start(timeout=SUBPROCESS_TIMEOUT_S)
    try:
        proc = subprocess.run(
            ["sbatch", "--wait", "--output=slurm-%j.out", str(script)],
            cwd=root,
            env={**env(root, MASTER_PORT=_free_port()), **cluster.env},
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
    finally:
        cluster.stop()
    outputs = list(root.glob("slurm-*.out"))
    assert proc.returncode == 0 and len(outputs) == 1, (proc.stdout, proc.stderr, [o.read_text() for o in outputs])
    return outputs[0].read_text()


@pytest.mark.slow  # the shared reference run: a real Slurm job, ~40 s
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_slurm_script_ran_as_a_real_slurm_job(reference):
    run, output = reference
    if output is None:
        pytest.skip(f"the reference ran in process, no Slurm here: {slurmcluster.why_not()}")
    assert "run runs/one: finished" in output, output[-3000:]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["nodes"] == 1 and info["world_size"] == 1
    assert audit(run, check_mlflow=False).consistent


def _check_two_nodes(reference: Path, run: Path, node1: Path, procs, tracked: bool = False) -> dict:
    """What every two-node run must show: both agents done, two nodes recorded, only rank 0 writing."""
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["world_size"] == 2 and info["devices"] == 2
    assert info["nodes"] == 2
    host = socket.gethostname()
    assert info["system"]["nodes"] == {f"{host}#0": [0], f"{host}#1": [1]}  # rank 0 on node 0, rank 1 on node 1
    _check_rank0_wrote(reference, run, node1, procs, tracked)
    return info


def _check_rank0_wrote(reference: Path, run: Path, node1: Path, procs, tracked: bool = False, rank1_ended=True) -> None:
    """Only rank 0 wrote the folder, the weights are the one-process run's, the audit is consistent.
    `rank1_ended`: rank 1 closed its system samples (a killed one may have had none to write)."""
    assert not any(node1.iterdir()), sorted(node1.rglob("*"))  # node 1 wrote nothing beside the shared folder
    # Only rank 0 writes the folder: the reference's files, plus rank 1's own system samples.
    journal = "journal/mlflow-pending.jsonl"  # rank 0's MLflow journal: in a tracked run (the Slurm reference is)
    assert (journal in _files(run)) == tracked
    extra = (_files(run) ^ _files(reference)) - {journal}
    assert (
        extra == {"metrics/system-rank00001.jsonl"} if rank1_ended else extra <= {"metrics/system-rank00001.jsonl"}
    ), extra
    # Progress lines from node 0's rank 0 only.
    assert not [x for x in procs[1].stderr.splitlines() if x.startswith("train: step ")]
    wa, wb = _weights(reference), _weights(run)
    assert set(wa) == set(wb) and max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    result = audit(run, check_mlflow=tracked)
    assert result.consistent, result.render()


# One fault in step 5 (checkpoint at 3) per torchrun round, RESTART:RANK:STEP:MODE (runner launch's hidden
# --fault; RESTART is the rank's agent's count: torchrun counts a failed worker, not a restart for a rejoin).
FAULTS = (
    "0:1:5:hang",  # round 0: rank 1 gone with its connections open, as a lost node's: rank 0 blocks in a collective
    "1:1:5:gone",  # round 1: node 1 gone for good (its agent killed too): node 0 goes on alone
    "1:0:5:kill",  # round 2 (node 0's first restart for a failure was round 1's): the restarts are spent, the job ends
)


@pytest.mark.longest
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_nodes_fsdp2_elastic_restarts_world_change_and_a_job_that_ends(reference, tmp_path):
    """FSDP2 on two nodes under `--nnodes 1:2 --max-restarts 1`, one fault per round (FAULTS).
    Round 0: rank 0, SIGTERMed by its agent for the restart while blocked on the hung rank 1, gives
    up at train.checkpoint.stop_timeout_seconds, says so, and both nodes come back from step 3.
    Round 1: node 1 is gone for good; node 0 comes back alone (world 1) from step 3.
    Round 2: rank 0 dies with the restarts spent: the job ends with torchrun's line, step 3 intact.
    The next `runner launch RUN` says it resumes from step 3 and finishes: the end state is the
    uninterrupted run's, the work each attempt lost counted once, each attempt's device-seconds
    with the devices it held."""
    exp = _project(tmp_path, "fsdp")
    body = yaml.safe_load(exp.read_text())
    body["train"]["checkpoint"]["stop_timeout_seconds"] = STOP_TIMEOUT_S  # operational: the fingerprint is the same
    exp.write_text(yaml.safe_dump(body, sort_keys=False))
    node1 = tmp_path / "node1"
    node1.mkdir()
    run = tmp_path / "runs" / "two"
    faults = [x for f in FAULTS for x in ("--fault", f)]
    procs = two_nodes(tmp_path, exp, "--run-dir", run, *faults, node1_cwd=node1, restarts=1, nnodes="1:2")
    node0 = procs[0].stderr
    # Round 0: the survivor's stop ended at its bound (its one line), before torchrun's own SIGKILL at 30 s.
    bound = f"stopped by signal, but the stop did not finish within {STOP_TIMEOUT_KEY} = {STOP_TIMEOUT_S} s"
    said = [x for x in node0.splitlines() if x.startswith(bound)]
    resumes = f"the newest checkpoint, step-0000003, is what `runner launch {run}` resumes"
    assert said == [f"{bound} (a rank is gone or hung): exiting; {resumes}"], node0[-4000:]
    assert "forcefully exiting" not in node0  # torchrun had no SIGKILL to send
    # Rounds 1 and 2 resumed from step 3; then the restarts were spent: torchrun's line, the checkpoint intact.
    assert node0.count("resuming from step-0000003 (step 3)") == 2, node0[-4000:]
    assert procs[0].returncode == 1 and "ChildFailedError" in node0, node0[-3000:]
    assert procs[1].returncode == -signal.SIGKILL  # node 1's agent, killed in round 1
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "running" and info["attempts"] == 3  # as a kill leaves it: a launch resumes it
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000003"]
    again = run_in_process(tmp_path, ["launch", str(run), "--no-tracking"], env(tmp_path))
    assert again.returncode == 0 and "resuming from step-0000003 (step 3)" in again.stderr, again.stderr[-3000:]
    _check_rank0_wrote(reference[0], run, node1, procs, rank1_ended=False)  # rank 1 was killed in both its rounds
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["attempts"] == 4 and info["world_size"] == info["nodes"] == 1
    _check_elastic_accounting(reference[0], run, info)


def _check_elastic_accounting(reference: Path, run: Path, info: dict) -> None:
    """The ledger is the uninterrupted run's but for the lost work, counted once per attempt; every
    attempt's rows, MFU and device-seconds count the devices it held (SPEC: time bases)."""
    ours, ref = (json.loads((r / "ledger.json").read_text())["counters"] for r in (run, reference))
    assert ours.keys() == ref.keys()
    for domain in ref:
        for key in ("pool", "exposure", "useful", "unique"):
            assert ours[domain][key] == ref[domain][key], (domain, key)
        assert ours[domain]["processed"] - ours[domain]["lost"] == ref[domain]["processed"]
    step_tokens = 8 * 16  # global batch 8 x 16
    world2_micro, world1_micro = 2 * 2 * 16, 2 * 16  # a micro step: ranks x micro 2 x 16
    # Each faulted attempt lost step 4 and step 5's first micro step, at its world size.
    assert ours["total"]["lost"] == 2 * (step_tokens + world2_micro) + (step_tokens + world1_micro)
    rows = read_jsonl(run / "metrics" / "train.jsonl")
    # Steps 1-4 on 2 devices, 4 again on 2, on 1 (the killed round), then 4-6 on 1 (the last launch).
    assert [(r["step"], r["devices"]) for r in rows] == [(1, 2), (2, 2), (3, 2), (4, 2), (4, 2), (4, 1)] + [
        (s, 1) for s in (4, 5, 6)
    ]
    ref_loss = {r["step"]: r["loss"] for r in read_jsonl(reference / "metrics" / "train.jsonl")}
    assert all(r["loss"] == pytest.approx(ref_loss[r["step"]], rel=1e-5) for r in rows)
    peak, fpt = info["conventions"]["peak_tflops"], info["flops_per_token"]
    for r in rows:  # each row's MFU over the devices its attempt held
        assert r["mfu"] == pytest.approx(fpt * step_tokens / (r["step_seconds"] * r["devices"] * peak * 1e12))
    # Device-seconds held: each attempt's wall (its journal) x its devices; cost per useful token from them.
    journal = read_jsonl(run / "journal" / "processed.jsonl")
    walls: dict[int, tuple[float, int]] = {}
    for e in journal:
        walls[e["attempt"]] = (max(walls.get(e["attempt"], (0.0, 0))[0], e["wall_seconds"]), e["world"])
    assert [(a, walls[a][1]) for a in sorted(walls)] == [(1, 2), (2, 2), (3, 1), (4, 1)]
    held = sum(wall * world for wall, world in walls.values())
    assert info["device_wall_seconds"] == pytest.approx(held, rel=1e-12)  # one reading (the clock stops at the end)
    useful = ours["total"]["useful"]
    assert info["cost_per_billion_useful_tokens"] == pytest.approx(0.1 * held / 3600 / (useful / 1e9), rel=1e-12)
    # Device step time: the killed attempts' (lost work included) as journaled, the last one's steps x 1 device.
    before = max(e["device_step_seconds_total"] for e in journal if e["attempt"] == 3)
    assert info["device_step_seconds_total"] == pytest.approx(
        before + sum(r["step_seconds"] for r in rows[-3:]), abs=0.002
    )


@pytest.mark.longest
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_nodes_ddp_from_the_slurm_script_with_mlflow_equal_one_process(reference, tmp_path):
    from mlflow.tracking import MlflowClient

    exp = _project(tmp_path)
    node1 = tmp_path / "node1"
    node1.mkdir()
    run = tmp_path / "runs" / "two"
    procs = slurm_nodes(tmp_path, slurm_script(tmp_path, exp, "runs/two"), node1)
    info = _check_two_nodes(reference[0], run, node1, procs, tracked=True)
    assert info["runtime"]["sharding"] == "none" and info["attempts"] == 1
    assert info["runtime"]["stop_timeout_seconds"] == 25.0  # the stop's bound (the default) is recorded
    one = reference[0]
    assert json.loads((run / "ledger.json").read_text()) == json.loads((one / "ledger.json").read_text())
    for name, key in (("train.jsonl", "loss"), ("eval.jsonl", "loss_nats")):
        a, b = read_jsonl(one / "metrics" / name), read_jsonl(run / "metrics" / name)
        assert len(a) == len(b) and all(x[key] == pytest.approx(y[key], rel=1e-5) for x, y in zip(a, b))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [info["mlflow"]["run_id"]]
    assert len(client.get_metric_history(runs[0].info.run_id, "loss")) == 6  # the audit above checked the run too


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_nodes_seeing_different_run_folders_are_refused_in_one_line(tmp_path):
    exp = _project(tmp_path)
    node1 = tmp_path / "node1"
    node1.mkdir()
    # A relative run folder from two launch folders: each node would write its own copy.
    procs = two_nodes(tmp_path, exp, "--run-dir", "runs/split", node1_cwd=node1)
    for p in procs:
        assert p.returncode != 0
        errors = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
        assert len(errors) == 1, p.stderr[-3000:]
        assert errors[0] == (
            "error: runs/split: ranks see different run folders: the folder rank 0 locked is not the one "
            "rank 1 (node 1) sees; the run folder must be on storage every node shares (same path from the launch directory)"
        )
    assert not any(node1.iterdir())
    assert not (tmp_path / "runs" / "split" / "run.json").exists()
