"""Cost of verifying every shard's sha256 at launch (runner.data.integrity), side by side.

One tiny model over a pool of one realistic shard (`runner data prepare` writes 100M-token shards:
200 MB of uint16), launched (3 steps) in this process three ways, interleaved `--repeats` times:
  off   verification disabled (what launch did before),
  cold  an empty verification cache: the shard is hashed in a background thread while training
        starts, and the first checkpoint (step 2) waits for it,
  warm  the cache of an earlier launch: a resume; one stat per shard.
Prints the median seconds from launch to the first step and to the first checkpoint, the ratios,
and the hashing throughput with its extrapolation to a FineWeb-Edu-sized pool. The shard is in the
page cache (just written): on a cold disk hashing runs at the disk's read bandwidth instead.

    python bench/bench_verify.py [--shard-mtokens 100] [--repeats 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

import runner.training.loop as loop
from runner.cli import main as runner_main
from runner.data.integrity import ShardVerifier
from runner.data.manifest import load_manifest, write_manifest
from runner.fsio import sha256_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def project(tmp: Path, shard_tokens: int) -> Path:
    from trainfixtures import make_project

    exp = make_project(
        tmp, steps=6, checkpoint_every=2, eval_every=10**6, pools={"a": (0.5, 4000, 400), "b": (0.5, 3000, 300)}
    )
    shard = tmp / "data" / "a" / "train-00000.bin"
    # The big shard, written in chunks (random ids keep the hash honest), then re-sealed in the manifest.
    rng = np.random.default_rng(0)
    with open(shard, "wb") as f:
        for start in range(0, shard_tokens, 1 << 24):
            rng.integers(1, 4096, size=min(1 << 24, shard_tokens - start), dtype=np.uint16).tofile(f)

    manifest = tmp / "data" / "a" / "manifest.json"
    fields = json.loads(manifest.read_text())
    fields["shards"][0].update(tokens=shard_tokens, sha256=sha256_file(shard))
    fields["pool_tokens"] = shard_tokens
    sha = write_manifest(manifest, fields)
    doc = yaml.safe_load(exp.read_text())
    doc["data"]["manifests"]["a"]["sha256"] = sha
    exp.write_text(yaml.safe_dump(doc, sort_keys=False))
    return exp


class _FirstStep:
    """A loop callback noting when the first step was committed."""

    def __init__(self):
        self.at: float | None = None

    def on_step(self, record, counters, ratios) -> None:
        self.at = self.at or time.time()

    def on_eval(self, step, exposure_tokens, rows) -> None:
        pass

    def on_end(self, summary) -> None:
        pass


def launch_once(exp: Path, run_dir: Path, cache: Path, verify: bool) -> dict[str, float]:
    """Seconds from calling `runner launch` to its first committed step, its first checkpoint and its end."""
    os.environ["RUNNER_CACHE_DIR"] = str(cache)
    marker, real = _FirstStep(), loop.Options
    loop.Options = functools.partial(real, verify_shards=verify, callbacks=[marker])
    t0 = time.time()
    try:
        # Three steps: the checkpoint at step 2 and the final one; no report (the run is not finished).
        assert runner_main(["launch", str(exp), "--run-dir", str(run_dir), "--no-tracking", "--max-steps", "3"]) == 0
    finally:
        loop.Options = real
    end = time.time()
    return {
        "to_first_step": marker.at - t0,
        "to_first_checkpoint": (run_dir / "checkpoints" / "step-0000002" / "COMPLETE").stat().st_mtime - t0,
        "total": end - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard-mtokens", type=float, default=100.0, help="shard size in millions of tokens (uint16)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shard_tokens = int(args.shard_mtokens * 1e6)
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp_name:
        tmp = Path(tmp_name)
        os.chdir(tmp)
        exp = project(tmp, shard_tokens)
        warm = tmp / "cache-warm"
        launch_once(exp, tmp / "runs" / "prime", warm, verify=True)  # fills the warm cache
        results: dict[str, list[dict]] = {"off": [], "cold": [], "warm": []}
        for r in range(args.repeats):
            order = list(results)[r % 3 :] + list(results)[: r % 3]  # rotate: no mode always goes first
            for mode in order:
                cache = tmp / f"cache-cold-{r}" if mode == "cold" else warm
                results[mode].append(launch_once(exp, tmp / "runs" / f"{mode}-{r}", cache, verify=mode != "off"))
        verifier = ShardVerifier([load_manifest(tmp / "data" / "a" / "manifest.json")], tmp / "cache-rate").start()
        verifier.wait()
        rate = verifier.bytes_hashed / verifier.seconds
    size_mb = shard_tokens * 2 / 1e6
    print(f"one shard of {shard_tokens / 1e6:,.0f}M uint16 tokens ({size_mb:,.0f} MB), median of {args.repeats}:")
    print(f"{'':8}{'to first step':>16}{'to 1st checkpoint':>20}{'whole launch':>16}")
    med = {m: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for m, rows in results.items()}
    for mode, row in med.items():
        print(f"{mode:8}{row['to_first_step']:>14.2f} s{row['to_first_checkpoint']:>18.2f} s{row['total']:>14.2f} s")
    for mode in ("cold", "warm"):
        print(
            f"{mode} / off: first step {med[mode]['to_first_step'] / med['off']['to_first_step']:.3f}, "
            f"first checkpoint {med[mode]['to_first_checkpoint'] / med['off']['to_first_checkpoint']:.3f}, "
            f"whole launch {med[mode]['total'] / med['off']['total']:.3f}"
        )
    print(
        f"hashing: {rate / 1e6:,.0f} MB/s in one background thread (page cache); a FineWeb-Edu 100BT pool "
        f"(~200 GB of uint16) takes {200e9 / rate / 60:,.1f} min once per machine, overlapped with training"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
