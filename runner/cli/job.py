"""CLI `runner job EXPERIMENT --slurm | --skypilot`: the job file a cluster runs, from the hardware recipe.

Owns turning the recipe's set-up (`nodes`, `devices_per_node`, `distributed`, the device and its
price) into a Slurm batch script or a SkyPilot task YAML, printed on stdout. Both start one torchrun
agent per node with the c10d rendezvous (torchrun is the launcher; the runner writes no launcher)
and `runner launch` into ONE fixed run folder, so a requeued or relaunched job resumes the same run.
The plan's time and cost head the file. Nothing is submitted.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from runner.errors import EXIT_OK, RunnerError

#: The environment `accelerate launch` derives from recipes/hardware/accelerate/fsdp2-Nx8.yaml
#: (docs/MULTI_NODE.md, tested in tests/training/test_accelerator.py): under torchrun `Accelerator()` reads it.
FSDP2_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
}
RDZV_PORT = 29500
STORE = "/runner-store"  # SkyPilot: where the bucket holding runs/, data/ and MLflow's store is mounted on every node
#: SkyPilot's mode for a bucket written heavily (checkpoints): writes land on local disk and are
#: uploaded behind the job (SkyPilot's docs recommend it for checkpoints; plain MOUNT writes through)
MOUNT_MODE = "MOUNT_CACHED"
#: seconds before the time limit Slurm sends SIGTERM (--signal): the runner's stop saves a checkpoint
SIGNAL_SECONDS = 120
#: per training process on a GPU node: its torch threads + batch prefetch, checkpoint writer and MLflow delivery
GPU_HELPER_CPUS = 3
PLAN_MARGIN = 1.25  # --time default: the plan's wall time + 25% (at least MIN_TIME_MINUTES)
MIN_TIME_MINUTES = 10

_SLURM_WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a partition or account name
_SLURM_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{2}){0,2}|\d+(:\d{2}){0,2})$")  # minutes, M:S, H:M:S, D-H[:M[:S]]
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")  # what S3 and GCS both accept
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"\\`$;|&<>]+$")  # scheme://... with no shell or YAML metacharacter


def register(subparsers) -> None:
    p = subparsers.add_parser("job", help="print a Slurm batch script or a SkyPilot task YAML for an experiment")
    p.add_argument("experiment", help="experiments/NAME.yaml (pinned: launch refuses an unpinned one, so job does)")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--slurm", action="store_true", help="a Slurm batch script (sbatch it)")
    kind.add_argument("--skypilot", action="store_true", help="a SkyPilot task YAML (sky launch it)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="the run folder every attempt resumes (default runs/<experiment>/<timestamp>; on SkyPilot on the bucket: a "
        "relative path is taken under /runner-store; fixed in the file)",
    )
    p.add_argument(
        "--bucket",
        default=None,
        help="SkyPilot: the storage bucket mounted for runs/, data/ and MLflow's store (default <experiment>-runner)",
    )
    p.add_argument(
        "--tracking-uri",
        default=None,
        help=f"SkyPilot: MLflow's tracking URI (default sqlite:///{STORE}/mlflow.db, on the bucket: it outlives the cluster)",
    )
    p.add_argument(
        "--time",
        default=None,
        help="Slurm: the job's time limit (minutes, H:M:S or D-H:M:S; default the plan's wall time + 25%%); "
        f"{SIGNAL_SECONDS} s before it the run saves and the job requeues itself to resume",
    )
    p.add_argument("--partition", default=None, help="Slurm: the partition (default: the cluster's)")
    p.add_argument("--account", default=None, help="Slurm: the account charged (default: yours)")
    p.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="Slurm: CPUs per node's task (default: a CPU recipe's processes x hardware.threads; on GPUs "
        f"each process's threads + {GPU_HELPER_CPUS} for its prefetch, checkpoint and MLflow threads)",
    )
    p.add_argument(
        "--shared",
        action="store_true",
        help="Slurm: do not ask for whole nodes (a GPU recipe's job is --exclusive by default)",
    )
    p.set_defaults(func=cmd_job)


def launch_env(cfg) -> dict[str, str]:
    """What torchrun's processes need beside their own variables: mixed precision, FSDP2's plugin."""
    from runner.training.accelerator import accelerate_mixed_precision

    out = {
        "ACCELERATE_MIXED_PRECISION": accelerate_mixed_precision(cfg.hardware),
        # torchrun's restart (--max-restarts) re-forms the group only with a process-group store of
        # its own per round: the store shared with the rendezvous keeps the dead round's addresses
        # (pytorch/pytorch#135712; seen with gloo on torch 2.13, tests/e2e/test_multinode.py).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    if cfg.hardware.distributed == "fsdp":
        out.update(FSDP2_ENV)
    return out


def sky_accelerator(hw) -> str | None:
    """SkyPilot's name of the recipe's device ("H200 SXM" -> H200, MI300X), None for a CPU."""
    return None if hw.accelerator == "cpu" else hw.device_name.split()[0].upper()


def _plan_lines(exp) -> list[str]:
    from runner.planning.plan import build_plan

    hw = exp.config.hardware
    t = build_plan(exp.config, root=exp.project_root)["time"]["assumed"]
    return [
        f"{exp.config.name} (fingerprint {exp.fingerprint[:12]}): {hw.nodes} node(s) x {hw.devices_per_node} "
        f"{hw.device_name}, distributed {hw.distributed}",
        f"plan at MFU {t['mfu']:.0%}: {t['wall_hours']:,.1f} h wall, {t['device_hours']:,.0f} device-h x "
        f"${hw.price_per_device_hour_usd:.2f}/device-h = ${t['cost_usd']:,.0f} (runner plan {exp.path})",
    ]


def comment(line: str) -> str:
    """`# line` that stays one comment line in a shell script or YAML, whatever `line` holds (validation
    refuses control characters in recipes; this is the second wall: a line break would end the comment)."""
    return "# " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def slurm_word(name: str) -> str:
    """A Slurm job name from an experiment name: characters outside [A-Za-z0-9._-] become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:128] or "runner"


def slurm_time(wall_hours: float) -> str:
    """D-HH:MM:SS of the plan's wall time + 25%, at least MIN_TIME_MINUTES minutes."""
    minutes = max(MIN_TIME_MINUTES, math.ceil(wall_hours * 60 * PLAN_MARGIN))
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def cpus_per_task(hw) -> int:
    """CPUs the node's torchrun agent needs for its processes (see --cpus-per-task)."""
    threads = hw.threads or 1
    return hw.devices_per_node * (threads if hw.accelerator == "cpu" else threads + GPU_HELPER_CPUS)


def _torchrun(nproc: str, nnodes: str, endpoint: str, rdzv_id: str, exp_path: str) -> str:
    return (
        f"torchrun --nnodes {nnodes} --nproc-per-node {nproc} --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint {endpoint} "
        f'--rdzv-id {rdzv_id} \\\n    -m runner launch {shlex.quote(exp_path)} --run-dir "$RUN_DIR"'
    )


def slurm_script(exp, exp_path: str, run_dir: str, opts: SlurmOptions | None = None) -> str:
    from runner.planning.plan import build_plan

    hw = exp.config.hardware
    opts = opts or SlurmOptions()
    gpu = hw.accelerator != "cpu"
    wall_hours = build_plan(exp.config, root=exp.project_root)["time"]["assumed"]["wall_hours"]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch_env(exp.config).items())
    sbatch = [
        f"--job-name={slurm_word(exp.config.name)}",
        f"--nodes={hw.nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the node's processes
        f"--cpus-per-task={opts.cpus_per_task or cpus_per_task(hw)}",
        *([f"--gpus-per-node={hw.devices_per_node}"] if gpu else []),
        *(["--exclusive"] if gpu and not opts.shared else []),  # the node's GPUs, memory and network
        f"--time={opts.time or slurm_time(wall_hours)}",
        *([f"--partition={opts.partition}"] if opts.partition else []),
        *([f"--account={opts.account}"] if opts.account else []),
        "--requeue",  # preempted or at its time limit: back in the queue, resuming RUN_DIR
        f"--signal=B:TERM@{SIGNAL_SECONDS}",  # to this shell, whose trap passes it on to srun
        "--open-mode=append",
    ]
    lines = [
        "#!/bin/bash",
        *(comment(line) for line in _plan_lines(exp)),
        *(f"#SBATCH {o}" for o in sbatch),
        "set -euo pipefail",
        "# From the submit folder (shared storage: the project, data/ and runs/ on every node).",
        'cd "${SLURM_SUBMIT_DIR:-.}"',
        f"RUN_DIR={shlex.quote(run_dir)}  # fixed: a requeued or resubmitted job resumes this run",
        'MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"',
        f"export {exports}",
        f"# {SIGNAL_SECONDS} s before the time limit (--signal) or at a preemption Slurm sends this shell SIGTERM: the",
        "# trap passes it to srun, which passes it to every torchrun and rank; the runner saves a checkpoint",
        "# and exits, and the job requeues itself (below) to resume RUN_DIR.",
        "stopped=0",
        'trap \'stopped=1; if [ -n "${step:-}" ]; then kill -TERM "$step" 2>/dev/null || true; fi\' TERM',
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\",
        "  "
        + _torchrun(
            str(hw.devices_per_node),
            '"$SLURM_NNODES"',
            f'"$MASTER_ADDR:${{MASTER_PORT:-{RDZV_PORT}}}"',
            '"$SLURM_JOB_ID"',
            exp_path,
        )
        + " &",
        "step=$!",
        "rc=0",
        "while :; do  # a trap interrupts wait: wait again until srun has ended",
        '  if wait "$step"; then rc=0; else rc=$?; fi',
        '  kill -0 "$step" 2>/dev/null || break',
        "done",
        'status=$(python -c \'import json, sys; print(json.load(open(sys.argv[1]))["status"])\' "$RUN_DIR/run.json" 2>/dev/null || echo none)',
        'if [ "$stopped" = 1 ] && [ "$status" != finished ]; then',
        '  echo "runner job: stopped by SIGTERM, run $RUN_DIR $status: requeueing job $SLURM_JOB_ID to resume it" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def skypilot_task(exp, exp_path: str, run_dir: str, bucket: str, tracking_uri: str | None = None) -> str:
    import yaml

    hw, cfg = exp.config.hardware, exp.config
    accelerator = sky_accelerator(hw)
    resources = {"accelerators": f"{accelerator}:{hw.devices_per_node}"} if accelerator else {"cpus": "2+"}
    run = "\n".join(
        [
            "set -euo pipefail",
            f"[ -e data ] || ln -s {STORE}/data data  # the experiment's data/, shared by every node",
            'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
            f"echo node $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES, rendezvous $MASTER_ADDR:{RDZV_PORT}",
            _torchrun(
                str(hw.devices_per_node),
                "$SKYPILOT_NUM_NODES",
                f"$MASTER_ADDR:{RDZV_PORT}",
                "$SKYPILOT_TASK_ID",
                exp_path,
            ),
        ]
    )
    # The runtime only (no dev or eval tools); a GPU node's NVML readings and Liger kernels come with `gpu`.
    extra = "[gpu]" if accelerator else ""
    setup = "\n".join(
        [
            "set -euo pipefail",
            'python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"',
            f'python -m pip install --quiet -e ".{extra}"' if extra else "python -m pip install --quiet -e .",
        ]
    )
    task = {
        "name": cfg.name,
        "num_nodes": hw.nodes,
        "resources": resources,
        "workdir": ".",
        "file_mounts": {STORE: {"name": bucket, "mode": MOUNT_MODE}},
        "envs": {
            "RUN_DIR": run_dir,
            # on the bucket (or a server): the audit's MLflow evidence outlives the cluster
            "MLFLOW_TRACKING_URI": tracking_uri or f"sqlite:///{STORE}/mlflow.db",
            **launch_env(cfg),
        },
        "setup": setup + "\n",
        "run": run + "\n",
    }
    head = "".join(comment(line) + "\n" for line in _plan_lines(exp))
    return head + yaml.dump(task, Dumper=_block_dumper(), sort_keys=False, width=200)


def _block_dumper():
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return Dumper


@dataclass(frozen=True)
class SlurmOptions:
    """The flags a Slurm script takes beside the recipe (None: the default the recipe or plan gives)."""

    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    shared: bool = False


def _checked(value: str | None, pattern: re.Pattern, flag: str, what: str) -> str | None:
    """A flag's value written into a job file: refused in one line unless it is plainly `what`."""
    if value is not None and not pattern.match(value):
        raise RunnerError(f"{value[:80]!r} is not {what}", key=flag)
    return value


def slurm_seconds(text: str) -> int:
    """Seconds of a Slurm time as sbatch reads it: minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 3:
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)


def _slurm_time(value: str | None) -> str | None:
    """--time as written into the script, refused where the job could not train: 0 is Slurm's "no
    limit" (a partition with a MaxTime holds such a job in the queue), and under MIN_TIME_MINUTES the
    SIGTERM SIGNAL_SECONDS before the limit would leave a start and a save no steps between them, so
    every requeue would resume the run and save it again, forever."""
    value = _checked(value, _SLURM_TIME, "--time", "a Slurm time (minutes, H:M:S or D-H:M:S)")
    if value is None:
        return None
    seconds = slurm_seconds(value)
    if seconds < MIN_TIME_MINUTES * 60:
        raise RunnerError(
            f"{value!r} is under {MIN_TIME_MINUTES} minutes"
            + (" (0 is Slurm's 'no limit')" if seconds == 0 else "")
            + f": the job saves and requeues itself {SIGNAL_SECONDS} s before its limit, so a shorter one"
            f" would resume and save the run again and again without training; give at least"
            f" {MIN_TIME_MINUTES} (minutes), or leave --time out for the plan's wall time + 25%",
            key="--time",
        )
    if seconds > MAX_TIME_DAYS * 86400:  # `99999999-00:00:00` went into the script; sbatch refuses it late
        raise RunnerError(f"{value!r} is over {MAX_TIME_DAYS} days: give the job's real limit", key="--time")
    return value


#: the longest --time taken: a year (a 7B run on one node is weeks; clusters cap jobs at days)
MAX_TIME_DAYS = 365

#: the most CPUs --cpus-per-task takes: 4x a two-socket 192-core node with SMT (768 CPUs); a figure beyond
#: it is a typo that sbatch would only refuse at submission
MAX_CPUS_PER_TASK = 4096


def slurm_options(args) -> SlurmOptions:
    if args.cpus_per_task is not None and not 1 <= args.cpus_per_task <= MAX_CPUS_PER_TASK:
        raise RunnerError(
            f"must be 1 to {MAX_CPUS_PER_TASK} (more than any node has), got {args.cpus_per_task}",
            key="--cpus-per-task",
        )
    return SlurmOptions(
        time=_slurm_time(args.time),
        partition=_checked(args.partition, _SLURM_WORD, "--partition", "a partition name ([A-Za-z0-9._-])"),
        account=_checked(args.account, _SLURM_WORD, "--account", "an account name ([A-Za-z0-9._-])"),
        cpus_per_task=args.cpus_per_task,
        shared=args.shared,
    )


def refuse_unpinned(exp) -> None:
    """`runner launch` refuses an experiment whose tokenizer, manifests or Hub revisions are not pinned:
    a job file for one would only fail on the cluster, after the queue."""
    from runner.config.rules import unresolved_revisions

    cfg = exp.config
    where = exp.path
    missing = ["tokenizer.sha256"] if cfg.tokenizer.sha256 is None else []
    missing += [f"data.manifests.{d}.sha256" for d, pin in cfg.data.manifests.items() if pin.sha256 is None]
    missing += [dotted for dotted, _ in unresolved_revisions(cfg)]
    if missing:
        raise RunnerError(
            f"not pinned ({', '.join(missing)}): `runner launch` would refuse it on the cluster; "
            f"`runner pin {where}` first (after `runner fetch` and `runner data prepare`)",
            file=str(where),
        )


def on_bucket(run_dir: str) -> str:
    """A SkyPilot run folder on the bucket every node mounts at STORE: a relative --run-dir is taken
    under it (in the workdir it would live on one node's disk and go with the cluster, checkpoints
    included); an absolute one must be under it."""
    path = Path(os.path.normpath(Path(STORE) / run_dir))
    if path == Path(STORE) or Path(STORE) not in path.parents:
        raise RunnerError(
            f"{run_dir!r} is not under the bucket mounted at {STORE}: a run folder elsewhere lives on one node's "
            f"disk and goes with the cluster; give a path on the bucket (runs/NAME, or {STORE}/runs/NAME)",
            key="--run-dir",
        )
    return str(path)


def cmd_job(args) -> int:
    from runner.planning.resources import load_experiment

    exp = load_experiment(args.experiment, check_files=False)
    if args.bucket is not None and not args.skypilot:
        raise RunnerError("only a SkyPilot task mounts a bucket (--skypilot)", key="--bucket")
    if args.tracking_uri is not None and not args.skypilot:
        raise RunnerError(
            "a SkyPilot option (--skypilot): a Slurm job uses MLFLOW_TRACKING_URI as sbatch passes it",
            key="--tracking-uri",
        )
    for flag in ("--time", "--partition", "--account", "--cpus-per-task", "--shared"):
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False) and not args.slurm:
            raise RunnerError("a Slurm option (--slurm)", key=flag)
    refuse_unpinned(exp)
    runs = Path("runs") if args.slurm else Path(STORE) / "runs"  # SkyPilot: on the bucket every node mounts
    if args.run_dir is not None and not args.run_dir.strip():  # `--run-dir ""` (an unset variable) took the default
        raise RunnerError("is empty: give the run folder, or leave --run-dir out for a new one", key="--run-dir")
    run_dir = args.run_dir or str(runs / exp.config.name / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if any(not c.isprintable() for c in run_dir):
        raise RunnerError("holds a control character", key="--run-dir")
    if args.skypilot:
        run_dir = on_bucket(run_dir)
    if args.slurm:
        print(slurm_script(exp, args.experiment, run_dir, slurm_options(args)), end="")
    else:
        bucket = _checked(args.bucket, _BUCKET, "--bucket", "a bucket name (a-z, 0-9, '.', '-'; 3-63)")
        uri = _checked(args.tracking_uri, _URI, "--tracking-uri", "a plain URI (scheme://..., no quotes or spaces)")
        default = re.sub(r"[^a-z0-9.-]+", "-", f"{exp.config.name}-runner".lower()).strip("-.")
        print(skypilot_task(exp, args.experiment, run_dir, bucket or default, uri), end="")
    return EXIT_OK
