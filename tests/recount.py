"""The ledger tests' oracle: exposures recounted from the sampler's definition alone.

Every domain walks its samples epoch by epoch, each epoch a keyed permutation, so after `steps`
committed steps a sample was seen `full epochs` times, plus once more if it is in the seeded
prefix of the current epoch. The count needs no stepping through batches, so it checks the ledger
(and the sampler's batches) without sharing their code path.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runner.data.sampler import MixtureSampler


def replay(
    samples: Mapping[str, int], ratios: Mapping[str, float], seed: int, global_batch: int, steps: int
) -> dict[str, np.ndarray]:
    """Exposure count per sample of every domain after `steps` committed steps (int64, unsaturated)."""
    sampler = MixtureSampler(samples, ratios, seed, global_batch)
    totals = sampler.cumulative_counts(steps)
    out = {}
    for d, name in enumerate(sampler.domains):
        n, exposures = int(sampler.samples[d]), int(totals[d])
        full_epochs = exposures // n
        counts = np.full(n, full_epochs, dtype=np.int64)
        counts[sampler.exposures_to_samples(d, full_epochs * n, exposures)] += 1
        out[name] = counts
    return out
