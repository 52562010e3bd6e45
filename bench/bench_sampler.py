"""Sampler + batch assembly throughput on a 1p3b-shaped plan, against what an H200 consumes.

Shape: seq_len 2048, global batch 512 (1,048,576 tokens per step), three domains of 12.7M
samples in total, held in sparse memory-mapped uint16 files in a temp dir (~52 GB apparent,
no disk used). Assembly is timed twice over the same batches: "cold" is the first touch of each
page (on ext4 a sparse-file fault costs milliseconds, a storage artefact, not our code) and
"warm" is with the pages resident, which is the cost of the sampler and copying themselves.

Consumer: a 1.3B-parameter model at 40% MFU on one H200 (989.4 dense BF16 TFLOP/s) with the
6N convention: 0.4 * 989.4e12 / (6 * 1.3e9) = 50.7K tokens/s. Target: >= 100x that on one core.

Run: python bench/bench_sampler.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from runner.data.sampler import BatchReader, MixtureSampler, MixtureSchedule

SEQ_LEN, GLOBAL_BATCH = 2048, 512
SAMPLES = {"web": 9_000_000, "code": 2_500_000, "math": 1_200_000}  # 12.7M samples
RATIOS = {"web": 0.7, "code": 0.2, "math": 0.1}
CONSUMER_TOKENS_PER_SECOND = 0.4 * 989.4e12 / (6 * 1.3e9)
STEPS, COLD_STEPS, START_STEP = 20, 3, 25_000


class MemmapPool:
    """The duck type of runner.data.pool.Pool over one memory-mapped file."""

    def __init__(self, path: Path, tokens: int):
        with open(path, "wb") as f:
            f.truncate(tokens * 2)  # sparse: apparent size only
        self.array = np.memmap(path, dtype=np.uint16, mode="r", shape=(tokens,))
        self.tokens = tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.array[start:stop]


def main() -> None:
    torch.set_num_threads(1)
    step_tokens = SEQ_LEN * GLOBAL_BATCH
    with tempfile.TemporaryDirectory() as tmp:
        pools = {d: MemmapPool(Path(tmp) / f"{d}.bin", n * SEQ_LEN + 1) for d, n in SAMPLES.items()}
        sampler = MixtureSampler(SAMPLES, RATIOS, seed=0, global_batch_sequences=GLOBAL_BATCH)
        reader = BatchReader(pools, SEQ_LEN)

        t0 = time.perf_counter()
        MixtureSchedule(RATIOS, GLOBAL_BATCH).counts(START_STEP)
        jump_seconds = time.perf_counter() - t0
        sampler.global_batch(START_STEP)  # warm the replay cursor like a resumed run would

        t0 = time.perf_counter()
        batches = [sampler.global_batch(s) for s in range(START_STEP, START_STEP + STEPS)]
        sample_seconds = (time.perf_counter() - t0) / STEPS
        t0 = time.perf_counter()
        for pairs in batches[:COLD_STEPS]:
            reader.read(pairs)
        cold_seconds = (time.perf_counter() - t0) / COLD_STEPS
        for pairs in batches:  # fault every page in before timing the warm pass
            reader.read(pairs)
        t0 = time.perf_counter()
        for pairs in batches:
            reader.read(pairs)
        read_seconds = (time.perf_counter() - t0) / STEPS

    rows = [
        ("sampler only (pairs per step)", sample_seconds),
        ("assembly, cold sparse pages", cold_seconds),
        ("assembly, warm (read + tensors)", read_seconds),
        ("sampler + warm assembly", sample_seconds + read_seconds),
    ]
    print(
        f"1p3b shape: seq {SEQ_LEN}, global batch {GLOBAL_BATCH} ({step_tokens:,} tokens/step), "
        f"{sum(SAMPLES.values()):,} samples, 1 thread"
    )
    print(f"random access to step {START_STEP:,} from a fresh schedule: {jump_seconds * 1e3:.1f} ms")
    print(f"{'stage':<40}{'ms/step':>10}{'tokens/s':>16}{'x H200 need':>14}")
    print(
        f"{'H200 1p3b at 40% MFU (consumer)':<40}{step_tokens / CONSUMER_TOKENS_PER_SECOND * 1e3:>10.0f}"
        f"{CONSUMER_TOKENS_PER_SECOND:>16,.0f}{1.0:>14.1f}"
    )
    for name, seconds in rows:
        rate = step_tokens / seconds
        print(f"{name:<40}{seconds * 1e3:>10.2f}{rate:>16,.0f}{rate / CONSUMER_TOKENS_PER_SECOND:>14.1f}")
    ratio = step_tokens / (sample_seconds + read_seconds) / CONSUMER_TOKENS_PER_SECOND
    print(f"target >= 100x: {'met' if ratio >= 100 else 'NOT met'} ({ratio:.0f}x)")


if __name__ == "__main__":
    main()
