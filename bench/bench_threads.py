"""CPU threads: the cpu-tiny run's first steps with hardware.threads 1 vs 2, side by side.

Each count trains the same experiment (`experiments/cpu-tiny.yaml` with `overrides: {hardware:
{threads: N}}`, operational: the same fingerprint) for `--steps` steps in a process of its own,
alternating counts, while `--busy K` other processes each keep one core busy (a shared machine:
other users, other test workers). Prints each count's median wall seconds and CPU seconds of the
training process and their ratios against one thread. What it measured decides the shipped CPU
recipe's `threads` (README: "CPU threads").

Run: python bench/bench_threads.py --steps 40 --runs 3 --busy 1     (builds the built-in data if missing)
     python bench/bench_threads.py --cpu-tiny                         (the same, short: 10 steps, 1 run)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COUNTS = (1, 2)


def _burn(stop) -> None:  # one busy core: another user's work
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2**31


def _experiment(tmp: Path, threads: int) -> Path:
    body = yaml.safe_load((ROOT / "experiments" / "cpu-tiny.yaml").read_text())
    body["name"] = f".bench-threads-{threads}"
    body.setdefault("overrides", {})["hardware"] = {"threads": threads}
    body["train"]["checkpoint"] = {"interval_steps": 10_000, "keep_last": 1}
    path = ROOT / "experiments" / f".bench-threads-{threads}.yaml"  # beside the recipes it names
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def _one(exp: Path, steps: int, run_dir: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `runner launch` of `steps` steps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OMP_NUM_THREADS", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "runner", "launch", str(exp), "--no-tracking", "--max-steps", str(steps)]
    subprocess.run([*cmd, "--run-dir", str(run_dir)], cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per launch (default 40)")
    parser.add_argument("--runs", type=int, default=3, help="launches per count, alternating (default 3)")
    parser.add_argument("--busy", type=int, default=1, help="other processes each keeping a core busy (default 1)")
    parser.add_argument("--cpu-tiny", action="store_true", help="short: 10 steps, 1 run each")
    args = parser.parse_args()
    if args.cpu_tiny:
        args.steps, args.runs = 10, 1
    if not (ROOT / "data" / "builtin" / "code" / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "runner", "data", "builtin"], cwd=ROOT, check=True, capture_output=True)
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.busy)]
    for b in burners:
        b.start()
    exps = {}
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in COUNTS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            exps = {n: _experiment(Path(tmp), n) for n in COUNTS}
            for r in range(args.runs):
                for n in COUNTS:
                    results[n].append(_one(exps[n], args.steps, Path(tmp) / f"run-{n}-{r}"))
    finally:
        stop.set()
        for b in burners:
            b.join()
        for p in exps.values():
            p.unlink(missing_ok=True)
    print(
        f"cpu-tiny, {args.steps} steps per launch (start-up included), {args.runs} launch(es) per count, "
        f"{args.busy} busy process(es), {os.cpu_count()} cores"
    )
    base_wall = statistics.median(w for w, _ in results[1])
    base_cpu = statistics.median(c for _, c in results[1])
    for n in COUNTS:
        wall = statistics.median(w for w, _ in results[n])
        cpu = statistics.median(c for _, c in results[n])
        print(
            f"  threads {n}: wall {wall:6.1f} s  CPU {cpu:6.1f} s  "
            f"(x{wall / base_wall:.2f} wall, x{cpu / base_cpu:.2f} CPU vs 1 thread)"
        )


if __name__ == "__main__":
    main()
