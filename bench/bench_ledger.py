"""Token-ledger cost per step at 1p3b shapes, against the step time it rides along with.

Shape: seq_len 2048, global batch 512, three domains of 12.7M samples in total (one uint8
exposure counter per sample: 12.7 MB). Per step the trainer calls `record_processed` once and
`commit` once with the global batch's 512 (domain, sample) pairs; checkpoints add
`state_dict()`, and the audit `check_invariants`.

Step time: 1,048,576 tokens per step at 50.7K tokens/s (1.3B params, 40% MFU on one H200,
6N convention: 0.4 * 989.4e12 / (6 * 1.3e9)) = 20.7 s.

Run: python bench/bench_ledger.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import time  # noqa: E402
from collections import Counter  # noqa: E402

from runner.data.sampler import MixtureSampler
from runner.training.ledger import TokenLedger

SEQ_LEN, GLOBAL_BATCH = 2048, 512
SAMPLES = {"web": 9_000_000, "code": 2_500_000, "math": 1_200_000}
RATIOS = {"web": 0.7, "code": 0.2, "math": 0.1}
CAPS = {"web": 4.0, "code": 4.0, "math": 4.0}
STEP_SECONDS = GLOBAL_BATCH * SEQ_LEN / (0.4 * 989.4e12 / (6 * 1.3e9))
STEPS, START_STEP = 50, 1_000


def _timed(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    sampler = MixtureSampler(SAMPLES, RATIOS, seed=0, global_batch_sequences=GLOBAL_BATCH)
    batches = [sampler.step_arrays(s) for s in range(START_STEP, START_STEP + STEPS)]
    pairs = [list(zip(d.tolist(), k.tolist())) for d, k in batches]
    positions = [{sampler.domains[d]: n * SEQ_LEN for d, n in Counter(dom.tolist()).items()} for dom, _ in batches]
    ledger = TokenLedger(SAMPLES, SEQ_LEN)

    t0 = time.perf_counter()
    for p, pos in zip(pairs, positions):
        ledger.record_processed(pos)
        ledger.commit(p, pos)
    step_seconds = (time.perf_counter() - t0) / STEPS
    state_seconds = _timed(ledger.state_dict, 5)
    check_seconds = _timed(lambda: ledger.check_invariants(GLOBAL_BATCH, SEQ_LEN, STEPS, RATIOS, CAPS), 5)
    histogram_seconds = _timed(ledger.histogram, 5)

    print(
        f"1p3b shape: seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, {sum(SAMPLES.values()):,} "
        f"samples ({sum(SAMPLES.values()) / 1e6:.1f} MB of counters), 1 thread"
    )
    print(f"{'operation':<44}{'ms':>10}{'share of a 1p3b step':>24}")
    print(f"{'1p3b step on H200 at 40% MFU':<44}{STEP_SECONDS * 1e3:>10.0f}{1.0:>24.2e}")
    for name, seconds in (
        ("record_processed + commit (every step)", step_seconds),
        ("state_dict (every checkpoint)", state_seconds),
        ("histogram (reports)", histogram_seconds),
        ("check_invariants (audit)", check_seconds),
    ):
        print(f"{name:<44}{seconds * 1e3:>10.3f}{seconds / STEP_SECONDS:>24.2e}")


if __name__ == "__main__":
    main()
