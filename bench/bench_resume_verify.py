"""A resume's checkpoint verification with the writer's cache vs without it, side by side.

One checkpoint of about `--mb` megabytes (a stack of Linear layers and its AdamW state, 12 B/param)
written by runner.training.checkpoint.Checkpointer, which records the files it hashed while writing
them in its cache (runner.hashcache). A resume's verification (`Checkpointer.reader(run).latest_valid()`,
a fresh Checkpointer as a new process has) is then timed, interleaved `--repeats` times, two ways:
  trusted  this machine's cache: each file's path, size, mtime, ctime, inode and device still those
           the writer recorded, so only state.json is hashed (against the seal);
  rehash   an empty cache (another machine, or the runner before the cache): every file read and
           hashed, as every resume did before.
Prints the medians, their ratio and the hashing rate, and what the re-hash costs at gpu-smoke's
15.6 GB checkpoint at that rate. The files are in the page cache (just written): on a fresh host
the re-hash reads at the disk's bandwidth instead.

    python bench/bench_resume_verify.py [--mb 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from runner.training.checkpoint import Checkpointer, gather_full_state

GPU_SMOKE_CHECKPOINT_BYTES = 15.6e9


def write_checkpoint(run: Path, mb: int) -> int:
    """One checkpoint of about `mb` MB; returns its bytes on disk."""
    width = 1024
    layers = max(1, round(mb * 1e6 / 12 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    model_state, optim_state = gather_full_state(model, opt)
    writer = Checkpointer(run, interval_steps=1, interval_minutes=0, keep_last=1)
    path = writer.save(1, model_state, optim_state, {"counts": np.zeros(4, dtype=np.int64)}, {"fingerprint": "b"})
    return sum(f.stat().st_size for f in path.iterdir())


def resume_seconds(run: Path, cache: Path) -> float:
    os.environ["RUNNER_CACHE_DIR"] = str(cache)
    t0 = time.perf_counter()
    found = Checkpointer.reader(run).latest_valid(report=lambda m: None)
    seconds = time.perf_counter() - t0
    assert found is not None and found.step == 1
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="checkpoint size in MB (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="resumes of each, interleaved")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer_cache, empty = root / "cache-writer", root / "cache-empty"
        os.environ["RUNNER_CACHE_DIR"] = str(writer_cache)
        size = write_checkpoint(root / "run", args.mb)
        times: dict[str, list[float]] = {"trusted": [], "rehash": []}
        for _ in range(args.repeats):
            times["trusted"].append(resume_seconds(root / "run", writer_cache))
            times["rehash"].append(resume_seconds(root / "run", empty))
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint {size / 1e6:,.0f} MB, {args.repeats} resumes of each")
    for k, m in medians.items():
        print(f"  {k:<8} median {m:.3f} s   min {min(times[k]):.3f} s   max {max(times[k]):.3f} s")
    print(f"trusted / rehash = {medians['trusted'] / medians['rehash']:.3f}")
    rate = size / medians["rehash"]
    print(
        f"re-hash rate {rate / 1e9:.2f} GB/s (page cache); at this rate gpu-smoke's 15.6 GB checkpoint "
        f"costs a resume {GPU_SMOKE_CHECKPOINT_BYTES / rate:.1f} s of hashing, none when trusted"
    )


if __name__ == "__main__":
    main()
