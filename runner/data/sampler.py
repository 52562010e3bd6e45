"""Mixture sampler: which (domain, sample) pairs make up every global batch, and reading them.

Owns three things, all pure functions of (samples per domain, ratios, seed, global step):
- the step-level allocation of global-batch slots to domains, exact at every step (SPEC
  invariant 5): after every step each domain's cumulative sample count is the floor or the ceil
  of `ratio * step * global_batch` (the quota property), never decreasing;
- the order each domain walks its samples: the j-th exposure of domain d is
  `perm(seed, d, epoch=j // n_d)[j % n_d]` with a keyed Feistel bijection (no O(n) arrays);
- the in-batch shuffle and the contiguous per-rank slices.
It must never count tokens (runner.training.ledger does), never keep state that changes what a step
contains (caches only speed up replay), and never read anything but the pools it is handed.

Why the allocation is exact: treat the k-th sample of domain d as a unit job released at the
first step where `ceil(T_d) >= k` and due at the first step where `floor(T_d) >= k`
(T_d = ratio * step * B). Any window of steps [a, b] holds at most (b - a + 1) * ratio_d * B
such jobs per domain, so at most (b - a + 1) * B in total: Hall's condition holds, and
earliest-deadline-first, which fills each step with the B released jobs due soonest, meets
every deadline. Ratios are taken as exact decimals (`Fraction(repr(r))`) normalised to sum
exactly 1, so the targets are exact rationals and no float rounding decides a slot.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from runner.errors import RunnerError

if TYPE_CHECKING:
    import torch

    from runner.data.pool import Pool

_CHECKPOINT_EVERY_STEPS = 256  # replay snapshots: random access replays at most this many steps
_FEISTEL_ROUNDS = 6


def exact_ratios(ratios: Mapping[str, float]) -> dict[str, Fraction]:
    """Ratios as the decimals a recipe wrote (0.3 -> 3/10), normalised to sum exactly 1."""
    fractions = {d: Fraction(repr(float(r))) for d, r in ratios.items()}
    total = sum(fractions.values())
    if total <= 0:
        raise RunnerError("target ratios must be positive", key="mixture.domains")
    return {d: f / total for d, f in sorted(fractions.items())}


class MixtureSchedule:
    """Cumulative per-domain sample counts after each step (domain order = sorted names).

    The schedule is periodic: after `period` steps (the smallest s with s * B * ratio_d whole for
    every d) every target is an integer, so the count is the target exactly, whatever came before;
    and from there the EDF rule repeats itself shifted by those integers (every deadline moves by
    the period, so every comparison it makes is the same). Hence
    `counts(k * period + r) = k * counts(period) + counts(r)`, and only steps within one period are
    replayed. Within a period it replays from 0, keeping the furthest point reached plus snapshots
    every `_CHECKPOINT_EVERY_STEPS` steps, so sequential access is O(domains) per step and random
    access replays at most one snapshot interval beyond what was already reached.
    """

    def __init__(self, ratios: Mapping[str, float], global_batch_sequences: int):
        if int(global_batch_sequences) != global_batch_sequences or global_batch_sequences < 1:
            raise RunnerError(
                f"must be a positive integer, got {global_batch_sequences!r}", key="train.global_batch_sequences"
            )
        exact = exact_ratios(ratios)
        self.domains = list(exact)
        self.global_batch = int(global_batch_sequences)
        denominator = math.lcm(*(f.denominator for f in exact.values()))
        self._denominator = denominator
        # T_d(s) = numerator_d * s * B / denominator, exactly; numerators sum to the denominator.
        self._numerators = [f.numerator * (denominator // f.denominator) for f in exact.values()]
        #: steps after which every target is whole again (period * B is a multiple of the denominator)
        self.period = denominator // math.gcd(denominator, self.global_batch)
        self._per_period = tuple(n * self.period * self.global_batch // denominator for n in self._numerators)
        self._cursor_step = 0
        self._cursor = tuple(0 for _ in self.domains)
        self._snapshots: dict[int, tuple[int, ...]] = {0: self._cursor}
        self._recent: dict[int, tuple[int, ...]] = {}

    def _advance(self, step: int, prev: tuple[int, ...]) -> tuple[int, ...]:
        """Counts after `step` steps given the counts after `step - 1` (one EDF step)."""
        batch, q = self.global_batch, self._denominator
        total = step * batch
        counts = []
        candidates = []  # (deadline step, domain index): the one optional job per domain
        extras = total
        for d, numerator in enumerate(self._numerators):
            floor_target, remainder = divmod(numerator * total, q)
            count = prev[d] if prev[d] > floor_target else floor_target
            if remainder and count == floor_target:
                job = floor_target + 1
                candidates.append((-(-(job * q) // (numerator * batch)), d))
            counts.append(count)
            extras -= count
        if not 0 <= extras <= len(candidates):
            raise AssertionError(f"mixture schedule broke its own proof at step {step}")
        if extras:
            candidates.sort()
            for _, d in candidates[:extras]:
                counts[d] += 1
        return tuple(counts)

    def replay_steps(self, step: int) -> int:
        """Steps `counts(step)` replays at most (from the start of its period)."""
        return int(step) % self.period

    def counts(self, step: int) -> tuple[int, ...]:
        """Cumulative samples per domain after `step` steps (step 0 -> all zeros)."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        periods, within = divmod(step, self.period)
        base = self._counts_within_period(within)
        if not periods:
            return base
        return tuple(b + periods * p for b, p in zip(base, self._per_period))

    def _counts_within_period(self, step: int) -> tuple[int, ...]:
        if step in self._recent:
            return self._recent[step]
        if step >= self._cursor_step:
            s, counts = self._cursor_step, self._cursor
            while s < step:
                s += 1
                counts = self._advance(s, counts)
                if s % _CHECKPOINT_EVERY_STEPS == 0:
                    self._snapshots[s] = counts
            self._cursor_step, self._cursor = s, counts
        else:
            s = (step // _CHECKPOINT_EVERY_STEPS) * _CHECKPOINT_EVERY_STEPS
            counts = self._snapshots[s]
            while s < step:
                s += 1
                counts = self._advance(s, counts)
        if len(self._recent) >= 8:
            self._recent.pop(next(iter(self._recent)))
        self._recent[step] = counts
        return counts

    def samples_per_step(self, d: int) -> Fraction:
        """Exact target samples of domain d per step: ratio_d * B."""
        return Fraction(self._numerators[d] * self.global_batch, self._denominator)

    def targets(self, step: int) -> list[Fraction]:
        """Exact targets ratio_d * step * B (in samples)."""
        return [Fraction(n * step * self.global_batch, self._denominator) for n in self._numerators]


# --- keyed random-access permutations ----------------------------------------------------

_SM1 = np.uint64(0xBF58476D1CE4E5B9)
_SM2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (array arithmetic wraps modulo 2**64)."""
    z = z ^ (z >> np.uint64(30))
    z = z * _SM1
    z = z ^ (z >> np.uint64(27))
    z = z * _SM2
    return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=4096)
def _round_keys(*key_parts) -> tuple[np.uint64, ...]:
    digest = hashlib.blake2b(repr(key_parts).encode(), digest_size=8 * _FEISTEL_ROUNDS).digest()
    return tuple(np.uint64(int.from_bytes(digest[8 * i : 8 * i + 8], "little")) for i in range(_FEISTEL_ROUNDS))


def permute(n: int, positions: np.ndarray, *key_parts) -> np.ndarray:
    """`perm(key)[positions]` for a keyed bijection of [0, n): Feistel network + cycle walking.

    Memory is O(len(positions)), not O(n), so a 12.7M-sample domain costs nothing up front.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if n <= 1:
        return np.zeros_like(positions)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)  # 2**(2*half_bits) < 4n
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    keys = _round_keys(*key_parts)

    def once(v: np.ndarray) -> np.ndarray:
        left, right = v >> shift, v & mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << shift) | right

    out = once(positions.astype(np.uint64))
    outside = out >= np.uint64(n)
    while outside.any():  # cycle walking: re-apply until the value lands inside [0, n)
        out[outside] = once(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


# --- the sampler ---------------------------------------------------------------------------


class MixtureSampler:
    """Global batches of (domain_id, sample_idx); domain ids index `self.domains` (sorted)."""

    def __init__(self, samples: Mapping[str, int], ratios: Mapping[str, float], seed: int, global_batch_sequences: int):
        if set(samples) != set(ratios):
            raise RunnerError(
                f"domains with samples {sorted(samples)} differ from domains with ratios {sorted(ratios)}",
                key="mixture.domains",
            )
        for d, n in samples.items():
            if int(n) < 1:
                raise RunnerError(f"domain has {n} samples; it needs at least one", key=f"data.manifests.{d}")
        self.domains = sorted(samples)
        self.samples = np.array([int(samples[d]) for d in self.domains], dtype=np.int64)
        self.seed = int(seed)
        self.global_batch_sequences = int(global_batch_sequences)
        self.schedule = MixtureSchedule(ratios, global_batch_sequences)

    def cumulative_counts(self, step: int) -> np.ndarray:
        """Samples per domain after `step` steps are committed."""
        return np.array(self.schedule.counts(step), dtype=np.int64)

    def exposures_to_samples(self, d: int, start: int, stop: int) -> np.ndarray:
        """Sample indices of domain d's exposures start..stop-1 (epoch by epoch)."""
        n = int(self.samples[d])
        j = np.arange(start, stop, dtype=np.int64)
        out = np.empty_like(j)
        epochs = j // n
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = permute(n, j[sel] % n, "sample", self.seed, self.domains[d], int(epoch))
        return out

    def step_arrays(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(domain_ids, sample_idx) of the global batch of `step`, both int64 [B]."""
        before, after = self.schedule.counts(step), self.schedule.counts(step + 1)
        domain_ids = np.repeat(np.arange(len(self.domains), dtype=np.int64), np.subtract(after, before))
        sample_idx = np.concatenate(
            [self.exposures_to_samples(d, before[d], after[d]) for d in range(len(self.domains))]
        )
        # Shuffle slots so that every rank's contiguous slice sees mixed domains.
        order = permute(
            self.global_batch_sequences, np.arange(self.global_batch_sequences), "slots", self.seed, int(step)
        )
        return domain_ids[order], sample_idx[order]

    def global_batch(self, step: int) -> list[tuple[int, int]]:
        domain_ids, sample_idx = self.step_arrays(step)
        return list(zip(domain_ids.tolist(), sample_idx.tolist()))

    def step_grid(self, step: int, world: int, accum: int = 1) -> np.ndarray:
        """The global batch of `step` as int64 [world, accum, micro, 2] (domain_id, sample_idx): rank r's
        contiguous slice is `[r]`, cut into its `accum` micro batches in order. The trainer reads this."""
        if world < 1:
            raise ValueError(f"a world of {world} ranks")
        if self.global_batch_sequences % (world * accum):
            raise RunnerError(
                f"global batch of {self.global_batch_sequences} sequences does not divide over {world} ranks"
                + (f" x {accum} micro batches" if accum > 1 else ""),
                key="train.global_batch_sequences",
            )
        pairs = np.stack(self.step_arrays(step), axis=1)
        return pairs.reshape(world, accum, self.global_batch_sequences // (world * accum), 2)

    def rank_slice(self, step: int, rank: int, world: int) -> list[tuple[int, int]]:
        """Contiguous slice of the global batch for `rank` of `world` (the trainer's `step_grid(...)[rank]`);
        slices are disjoint."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world of {world}")
        return [(int(d), int(i)) for d, i in self.step_grid(step, world)[rank].reshape(-1, 2)]


# --- reading windows -----------------------------------------------------------------------


@dataclass
class Batch:
    """Token ids for a list of (domain_id, sample_idx) pairs; all tensors on CPU."""

    input_ids: torch.Tensor  # int64 [n, L]: pool[k*L : k*L+L]
    labels: torch.Tensor  # int64 [n, L]: pool[k*L+1 : k*L+L+1]
    domain_ids: torch.Tensor  # int64 [n]
    loss_mask: torch.Tensor  # bool [n, L]: all True for packed pools


class BatchReader:
    """Reads sample windows `pool[k*L : k*L+L+1]` from pools keyed by domain name."""

    def __init__(self, pools: Mapping[str, Pool], seq_len: int):
        self.domains = sorted(pools)
        self.pools = [pools[d] for d in self.domains]
        self.seq_len = int(seq_len)
        self.samples = [(int(p.tokens) - 1) // self.seq_len for p in self.pools]

    def read(self, pairs: Sequence[tuple[int, int]] | np.ndarray) -> Batch:
        import torch  # noqa: PLC0415  (torch: the planner and the audit use this module without it)

        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        seq_len = self.seq_len
        windows = np.empty((len(pairs), seq_len + 1), dtype=np.int64)
        for row, (d, k) in enumerate(pairs.tolist()):
            if not 0 <= k < self.samples[d]:
                raise IndexError(f"sample {k} outside domain {self.domains[d]!r} ({self.samples[d]} samples)")
            windows[row] = self.pools[d].read(k * seq_len, k * seq_len + seq_len + 1)
        tokens = torch.from_numpy(windows)
        return Batch(
            input_ids=tokens[:, :-1].contiguous(),
            labels=tokens[:, 1:].contiguous(),
            domain_ids=torch.from_numpy(pairs[:, 0].copy()),
            loss_mask=torch.ones((len(pairs), seq_len), dtype=torch.bool),
        )
