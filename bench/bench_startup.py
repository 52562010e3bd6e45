"""Start-up time of the `runner` command: `python -m runner --help` here vs at another git ref.

The CLI imports a verb's modules only when the verb runs, so `--help` (and every verb's own
start) pays for the argument parser and little else. This compares this tree with another commit
of the repository, side by side and alternating (the machine is shared and noisy), and prints the
medians and their ratio; a bare interpreter start is the floor.

Run: python bench/bench_startup.py --ref e936d7d --runs 10
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _extract(ref: str, dest: Path) -> None:
    """runner/ and schemas/ of `ref`, as a tree `python -m runner` imports from (cwd first on sys.path)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "runner", "schemas"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def _seconds(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, capture_output=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="git ref to compare with (default HEAD)")
    parser.add_argument("--runs", type=int, default=10, help="runs of each, alternating")
    args = parser.parse_args()
    help_cmd = [sys.executable, "-m", "runner", "--help"]
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp)
        _extract(args.ref, other)
        cases = {
            "bare python": ([sys.executable, "-c", "pass"], ROOT),
            f"runner --help at {args.ref}": (help_cmd, other),
            "runner --help here": (help_cmd, ROOT),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.runs):
            for name, (cmd, cwd) in cases.items():
                times[name].append(_seconds(cmd, cwd))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, m in medians.items():
        print(f"{name:<32} median {m:.3f} s   min {min(times[name]):.3f} s")
    here, there = medians["runner --help here"], medians[f"runner --help at {args.ref}"]
    print(f"here / {args.ref} = {here / there:.2f}")


if __name__ == "__main__":
    main()
