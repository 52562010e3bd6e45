"""CLI `runner job EXPERIMENT --slurm | --skypilot`: the job file a cluster runs, from the hardware recipe.

Owns turning the recipe's set-up (`nodes`, `devices_per_node`, `distributed`, the device and its
price) into a Slurm batch script or a SkyPilot task YAML, printed on stdout. Both start one torchrun
agent per node with the c10d rendezvous (torchrun is the launcher; the runner writes no launcher)
and `runner launch` into ONE fixed run folder, so a requeued or relaunched job resumes the same run.
The plan's time and cost head the file. Nothing is submitted.
"""

from __future__ import annotations

import datetime as dt
import shlex
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
INSTALL = "./install.sh"  # the README's install
STORE = "/runner-store"  # SkyPilot: where the bucket holding runs/ and data/ is mounted on every node


def register(subparsers) -> None:
    p = subparsers.add_parser("job", help="print a Slurm batch script or a SkyPilot task YAML for an experiment")
    p.add_argument("experiment", help="experiments/NAME.yaml")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--slurm", action="store_true", help="a Slurm batch script (sbatch it)")
    kind.add_argument("--skypilot", action="store_true", help="a SkyPilot task YAML (sky launch it)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="the run folder every attempt resumes (default runs/<experiment>/<timestamp>, on SkyPilot under the bucket; fixed in the file)",
    )
    p.add_argument(
        "--bucket",
        default=None,
        help="SkyPilot: the storage bucket mounted for runs/ and data/ (default <experiment>-runner)",
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


def _torchrun(nproc: str, nnodes: str, endpoint: str, rdzv_id: str, exp_path: str) -> str:
    return (
        f"torchrun --nnodes {nnodes} --nproc-per-node {nproc} --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint {endpoint} "
        f'--rdzv-id {rdzv_id} \\\n    -m runner launch {shlex.quote(exp_path)} --run-dir "$RUN_DIR"'
    )


def slurm_script(exp, exp_path: str, run_dir: str) -> str:
    hw = exp.config.hardware
    gpus = [f"#SBATCH --gpus-per-node={hw.devices_per_node}"] if hw.accelerator != "cpu" else []
    exports = " ".join(f"{k}={v}" for k, v in launch_env(exp.config).items())
    lines = [
        "#!/bin/bash",
        *(f"# {line}" for line in _plan_lines(exp)),
        f"#SBATCH --job-name={exp.config.name}",
        f"#SBATCH --nodes={hw.nodes}",
        "#SBATCH --ntasks-per-node=1",  # one torchrun agent per node; it starts the node's processes
        *gpus,
        "#SBATCH --requeue",  # a preempted job comes back and resumes RUN_DIR
        "#SBATCH --signal=B:TERM@120",
        "#SBATCH --open-mode=append",
        "set -euo pipefail",
        "# From the submit folder (shared storage: the project, data/ and runs/ on every node).",
        'cd "${SLURM_SUBMIT_DIR:-.}"',
        f"RUN_DIR={shlex.quote(run_dir)}  # fixed: a requeued or resubmitted job resumes this run",
        'MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"',
        f"export {exports}",
        "# A SIGTERM (preemption) reaches every torchrun; the runner checkpoints and exits, Slurm requeues.",
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\",
        "  "
        + _torchrun(
            str(hw.devices_per_node),
            '"$SLURM_NNODES"',
            f'"$MASTER_ADDR:${{MASTER_PORT:-{RDZV_PORT}}}"',
            '"$SLURM_JOB_ID"',
            exp_path,
        ),
    ]
    return "\n".join(lines) + "\n"


def skypilot_task(exp, exp_path: str, run_dir: str, bucket: str) -> str:
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
    task = {
        "name": cfg.name,
        "num_nodes": hw.nodes,
        "resources": resources,
        "workdir": ".",
        "file_mounts": {STORE: {"name": bucket, "mode": "MOUNT"}},
        "envs": {"RUN_DIR": run_dir, **launch_env(cfg)},
        "setup": f"{INSTALL}\n",
        "run": run + "\n",
    }
    head = "".join(f"# {line}\n" for line in _plan_lines(exp))
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


def cmd_job(args) -> int:
    from runner.planning.resources import load_experiment

    exp = load_experiment(args.experiment, check_files=False)
    if args.bucket is not None and not args.skypilot:
        raise RunnerError("only a SkyPilot task mounts a bucket (--skypilot)", key="--bucket")
    runs = Path("runs") if args.slurm else Path(STORE) / "runs"  # SkyPilot: on the bucket every node mounts
    run_dir = args.run_dir or str(runs / exp.config.name / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if args.slurm:
        print(slurm_script(exp, args.experiment, run_dir), end="")
    else:
        print(skypilot_task(exp, args.experiment, run_dir, args.bucket or f"{exp.config.name}-runner"), end="")
    return EXIT_OK
