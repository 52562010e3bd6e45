"""A real one-node Slurm cluster on loopback for tests: Debian's slurm-wlm 22.05 with munge.

`apt-get install -y slurm-wlm munge` provides the daemons; they run as root (slurmd starts jobs as
their user). `start(folder)` writes a munge key and a slurm.conf naming this host (from `slurmd
-C`) on free loopback ports, starts munged, slurmctld and slurmd, and waits until the node is idle;
`stop()` ends the three by the pids they wrote. A two-node job on one host needs a slurmd built with
--enable-multiple-slurmd, which Debian's is not: two nodes are tested with torchrun (test_multinode).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def why_not() -> str | None:
    """Why a Slurm cluster cannot be started here (None: it can)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"Slurm not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge"
    if os.geteuid() != 0:
        return "slurmd and munged need root to start jobs"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class Cluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.pidfiles = [folder / "munge" / "munged.pid", folder / "slurmctld.pid", folder / "slurmd.pid"]

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float) -> Cluster:
        f = self.folder
        for d in ("munge", "state", "spool", "log"):
            (f / d).mkdir(parents=True, exist_ok=True)
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = f / "munge" / "munge.socket"
        subprocess.run(
            [_exe("munged"), f"--key-file={key}", f"--socket={sock}", f"--pid-file={self.pidfiles[0]}",
             f"--log-file={f / 'munge' / 'munged.log'}", f"--seed-file={f / 'munge' / 'seed'}", "--force"],
            check=True,
        )  # fmt: skip
        node = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        name = node.split()[0].split("=", 1)[1]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=loopback",
                    f"SlurmctldHost={name}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={sock}",
                    "CredType=cred/munge",
                    f"StateSaveLocation={f / 'state'}",
                    f"SlurmdSpoolDir={f / 'spool'}",
                    f"SlurmctldPidFile={self.pidfiles[1]}",
                    f"SlurmdPidFile={self.pidfiles[2]}",
                    f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={f / 'log' / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "JobAcctGatherType=jobacct_gather/none",
                    f"{node.split(' UpTime')[0]} NodeAddr=127.0.0.1 State=UNKNOWN",
                    f"PartitionName=loopback Nodes={name} Default=YES MaxTime=INFINITE State=UP",
                ]
            )
            + "\n"
        )
        env = {**os.environ, **self.env}
        subprocess.run([_exe("slurmctld"), "-f", str(self.conf)], check=True, env=env)
        subprocess.run([_exe("slurmd"), "-f", str(self.conf)], check=True, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # the node registers within seconds on a quiet machine
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env).stdout
            if state.strip() == "idle":
                return self
            time.sleep(0.5)
        raise RuntimeError(f"slurm node not idle within {timeout} s: {state!r}")

    def stop(self) -> None:
        for pidfile in reversed(self.pidfiles):
            with contextlib.suppress(OSError, ValueError, IndexError):  # one that did not start has no pid
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGTERM)
