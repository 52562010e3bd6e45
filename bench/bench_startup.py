"""Start-up time of the `runner` command here vs at another git ref, side by side and alternating.

Default: `python -m runner --help` (the CLI imports a verb's modules only when the verb runs, so
`--help` pays for the argument parser and little else); a bare interpreter start is the floor.
`--cpu-tiny`: `runner launch experiments/cpu-tiny.yaml --max-steps 1 --no-tracking` in a scratch
project of each tree (the built-in corpus prepared once), the launch's whole wall timed, and this
tree's run.json `t_startup` (process start to the first step, by part) printed beside it. Medians and
their ratio are printed (the machine is shared and noisy).
`--cpu-tiny --uncompiled`: the same launches in an environment that compiles torch and transformers in
every process (a copy of them with no bytecode beside the sources, PYTHONDONTWRITEBYTECODE=1, as in
an image installed without bytecode): this tree with the runner's bytecode cache (runner.bytecode; its
first launch fills it and is printed apart), `--ref` with it off (`RUNNER_PYCACHE=off`).

`--cpu-tiny --tracking`: the same launches with MLflow on (a SQLite store per tree, made by its first
launch), as `runner launch` runs by default: MLflow's start before the first step counts.

Run: python bench/bench_startup.py --ref e936d7d --runs 10
     python bench/bench_startup.py --cpu-tiny --ref HEAD~1 --runs 3
     python bench/bench_startup.py --cpu-tiny --uncompiled --ref HEAD --runs 3
     python bench/bench_startup.py --cpu-tiny --tracking --ref HEAD --runs 5
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _extract(ref: str, dest: Path, paths: tuple[str, ...] = ("runner", "schemas")) -> None:
    """`paths` of `ref`, as a tree `python -m runner` imports from (cwd first on sys.path)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, *paths], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def _seconds(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, capture_output=True, check=True, env=env)
    return time.perf_counter() - t0


def _project(tree: Path, data: Path | None) -> Path:
    """A scratch project of `tree` (its runner/, schemas/, recipes/, experiments/), the built-in corpus
    prepared there (or linked from `data`)."""
    if data is not None:
        os.symlink(data, tree / "data")
    else:
        subprocess.run([sys.executable, "-m", "runner", "data", "builtin"], cwd=tree, capture_output=True, check=True)
    return tree


def _launch(
    tree: Path, run_dir: Path, env: dict[str, str] | None = None, tracking: bool = False
) -> tuple[float, dict | None]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "runner", "launch", "experiments/cpu-tiny.yaml", "--max-steps", "1"]
    if tracking:  # MLflow on, into a store of the tree's own (made by its first launch)
        env = {**(env or os.environ), "MLFLOW_TRACKING_URI": f"sqlite:///{tree / 'mlflow.db'}"}
    else:
        cmd.append("--no-tracking")
    seconds = _seconds([*cmd, "--run-dir", str(run_dir)], tree, env)
    info = json.loads((run_dir / "run.json").read_text())
    return seconds, info.get("t_startup")


def _uncompiled_site(dest: Path) -> Path:
    """torch and transformers as a tree of links to their files, with no bytecode beside the sources:
    an installation that every process compiles again under PYTHONDONTWRITEBYTECODE=1."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    for module in (torch, transformers):
        src = Path(str(module.__file__)).parent
        shutil.copytree(
            src, dest / src.name, symlinks=True, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__")
        )
    return dest


def cpu_tiny(ref: str, runs: int, uncompiled: bool = False, tracking: bool = False) -> None:
    paths = ("runner", "schemas", "recipes", "experiments")
    with tempfile.TemporaryDirectory() as tmp:
        envs: dict[str, dict[str, str] | None] = {"here": None, ref: None}
        if uncompiled:
            site = _uncompiled_site(Path(tmp) / "site")
            base = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            }
            base["PYTHONDONTWRITEBYTECODE"] = "1"
            envs = {
                "here": {**base, "RUNNER_PYCACHE": str(Path(tmp) / "pycache")},
                ref: {**base, "RUNNER_PYCACHE": "off"},
            }
        trees = {"here": Path(tmp) / "here", ref: Path(tmp) / "ref"}
        for name, tree in trees.items():
            tree.mkdir()
            _extract("HEAD" if name == "here" else ref, tree, paths)
            if name == "here":  # the working tree as it is, uncommitted edits included
                for p in ("runner", "schemas"):
                    shutil.rmtree(tree / p)
                    shutil.copytree(ROOT / p, tree / p, ignore=shutil.ignore_patterns("__pycache__"))
        _project(trees["here"], None)
        _project(trees[ref], trees["here"] / "data")
        times: dict[str, list[float]] = {name: [] for name in trees}
        startups: list[dict] = []
        if uncompiled:  # the first launch here fills the runner's bytecode cache: apart, not in the medians
            seconds, t_startup = _launch(trees["here"], Path(tmp) / "run-fill", envs["here"])
            code = (t_startup or {"attempts": [{}]})["attempts"][-1].get("bytecode")
            print(f"first launch here (fills the bytecode cache): {seconds:.2f} s; bytecode {code}")
        for _ in range(runs):
            for name, tree in trees.items():
                seconds, t_startup = _launch(tree, Path(tmp) / f"run-{name.replace('/', '_')}", envs[name], tracking)
                times[name].append(seconds)
                if name == "here" and t_startup:
                    startups.append(t_startup["attempts"][-1])
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for name, m in medians.items():
        print(f"runner launch cpu-tiny --max-steps 1 at {name:<12} median {m:.2f} s   min {min(times[name]):.2f} s")
    print(f"here / {ref} = {medians['here'] / medians[ref]:.2f}")
    if startups:
        last = startups[len(startups) // 2]
        print(f"t_startup here (median run): {last['seconds']:.2f} s; first step {last['first_step_seconds']} s")
        for part, v in last["parts"].items():
            print(f"  {part:<24} {v:7.3f} s")
        if "mlflow" in last:
            waited = last.get("before_first_step_parts", {}).get("attempt_start")
            print(f"  MLflow in {last['mlflow']}; the wait for its start before the first step: {waited} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="git ref to compare with (default HEAD)")
    parser.add_argument("--runs", type=int, default=10, help="runs of each, alternating")
    parser.add_argument("--cpu-tiny", action="store_true", help="launch cpu-tiny for one step instead of --help")
    parser.add_argument(
        "--uncompiled",
        action="store_true",
        help="with --cpu-tiny: torch and transformers compiled in every process; here with the runner's bytecode cache, --ref without",
    )
    parser.add_argument(
        "--tracking",
        action="store_true",
        help="with --cpu-tiny: MLflow on (a SQLite store per tree) instead of --no-tracking",
    )
    args = parser.parse_args()
    if args.cpu_tiny:
        cpu_tiny(args.ref, args.runs, args.uncompiled, args.tracking)
        return
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
