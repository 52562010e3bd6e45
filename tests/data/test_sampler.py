"""The sampler: exact mixture at every step, seeded epoch walks, rank slices, batch windows."""

import time

import numpy as np
import pytest
import torch
from recount import replay

from runner.data.sampler import BatchReader, MixtureSampler, MixtureSchedule, permute
from runner.errors import RunnerError


def _random_mixture(rng, k):
    """Ratios as exact millionths (so the test knows the exact targets), some below 1/B."""
    weights = rng.integers(1, 1000, size=k).astype(np.int64)
    weights[rng.random(k) < 0.3] = 1  # tiny domains: ratio * B < 1 for most batch sizes
    weights = weights * 1_000_000 // weights.sum()
    weights[weights == 0] = 1
    weights[np.argmax(weights)] += 1_000_000 - weights.sum()
    return {f"d{i:02d}": w / 1_000_000 for i, w in enumerate(weights.tolist())}, weights


@pytest.mark.parametrize("case", range(40))
def test_every_step_is_within_one_sample_of_the_exact_target(case):
    rng = np.random.default_rng(case)
    k = int(rng.integers(1, 9))
    batch = int(rng.choice([1, 2, 3, 7, 16, 64, 512]))
    ratios, weights = _random_mixture(rng, k)
    schedule = MixtureSchedule(ratios, batch)
    steps = 10_000
    counts = np.array([schedule.counts(s) for s in range(steps + 1)], dtype=np.int64)
    s = np.arange(steps + 1, dtype=np.int64)[:, None]
    exact_numerator = weights[None, :] * s * batch  # target * 1e6, exact integers
    # Quota property (stronger than SPEC's |deviation| <= 1): floor(target) <= count <= ceil.
    assert (counts * 1_000_000 > exact_numerator - 1_000_000).all()
    assert (counts * 1_000_000 < exact_numerator + 1_000_000).all()
    assert (np.diff(counts, axis=0) >= 0).all(), "cumulative counts decreased"
    assert (counts.sum(axis=1) == s[:, 0] * batch).all()


def test_tiny_domain_gets_its_share_even_below_one_sample_per_step():
    schedule = MixtureSchedule({"big": 0.999, "tiny": 0.001}, 8)  # 0.008 samples per step
    counts = [schedule.counts(s)[1] for s in range(1001)]
    assert counts[125] == 1 and counts[1000] == 8  # targets exactly 1.0 and 8.0
    assert all(abs(c - 0.008 * s) <= 1 for s, c in enumerate(counts))


@pytest.mark.slow
def test_random_access_equals_sequential_and_is_fast():
    ratios = {"code": 0.25, "math": 0.05, "web": 0.6999, "rare": 0.0001}
    walked = MixtureSchedule(ratios, 512)
    sequential = [walked.counts(s) for s in range(25_001)]
    fresh = MixtureSchedule(ratios, 512)
    start = time.perf_counter()
    assert fresh.counts(25_000) == sequential[25_000]
    assert time.perf_counter() - start < 1.0
    for s in (24_999, 300, 0, 7777, 25_000, 1):  # backwards and forwards after the jump
        assert fresh.counts(s) == sequential[s]


def _sampler(seed=3, batch=16):
    return MixtureSampler({"web": 50, "code": 7, "math": 3}, {"web": 0.7, "code": 0.2, "math": 0.1}, seed, batch)


def test_sampler_is_a_pure_function_of_its_inputs():
    a, b = _sampler(), _sampler()
    for step in (5, 0, 41, 5):
        assert a.global_batch(step) == b.global_batch(step)
    assert a.global_batch(9) != _sampler(seed=4).global_batch(9)
    assert a.domains == ["code", "math", "web"]


def test_each_domain_walks_seeded_permutations_epoch_by_epoch():
    sampler = _sampler()
    per_domain = {d: [] for d in range(3)}
    for step in range(40):
        before = sampler.cumulative_counts(step)
        batch = sampler.global_batch(step)
        assert len(batch) == 16
        assert (np.bincount([d for d, _ in batch], minlength=3) == sampler.cumulative_counts(step + 1) - before).all()
        # The batch is shuffled, so rebuild each domain's exposure order from the definition.
        for d in range(3):
            got = sorted(k for dd, k in batch if dd == d)
            expected = sampler.exposures_to_samples(d, before[d], sampler.cumulative_counts(step + 1)[d])
            assert got == sorted(expected.tolist())
            per_domain[d].extend(expected.tolist())
    for d, n in enumerate(sampler.samples.tolist()):
        seq = per_domain[d]
        for epoch in range(len(seq) // n):
            assert sorted(seq[epoch * n : (epoch + 1) * n]) == list(range(n))
        tail = seq[(len(seq) // n) * n :]
        assert len(set(tail)) == len(tail), "a fractional epoch must not repeat a sample"
    # Consecutive epochs use different orders (the web domain has 50 samples).
    web = per_domain[2]
    assert web[:50] != web[50:100]


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097, 65_537])
def test_permutation_is_a_bijection(n):
    out = permute(n, np.arange(n), "k", 1)
    assert sorted(out.tolist()) == list(range(n))
    if n > 16:
        assert not (out == np.arange(n)).all()


def test_permutation_is_random_access_on_huge_domains():
    n = 12_700_000
    picks = np.array([0, 5, n - 1, 12_345_678])
    out = permute(n, picks, "sample", 0, "web", 2)
    assert ((out >= 0) & (out < n)).all() and len(set(out.tolist())) == 4
    assert (permute(n, picks[::-1], "sample", 0, "web", 2) == out[::-1]).all()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_slices_are_disjoint_and_cover_the_global_batch(world):
    sampler = _sampler()
    for step in range(6):
        slices = [sampler.rank_slice(step, r, world) for r in range(world)]
        assert all(len(s) == 16 // world for s in slices)
        assert [p for s in slices for p in s] == sampler.global_batch(step)


def test_rank_slices_mix_domains_and_refuse_uneven_worlds():
    sampler = MixtureSampler({"a": 1000, "b": 1000}, {"a": 0.5, "b": 0.5}, 0, 64)
    mixed = sum(len({d for d, _ in sampler.rank_slice(step, 0, 4)}) == 2 for step in range(50))
    assert mixed >= 45  # unshuffled, rank 0 would hold only domain "a" every step
    with pytest.raises(RunnerError, match="does not divide"):
        sampler.rank_slice(0, 0, 3)


def test_replay_counts_match_stepping_through_every_batch():
    sampler = _sampler()
    counts = {d: np.zeros(n, dtype=np.int64) for d, n in zip(sampler.domains, sampler.samples)}
    for step in range(37):
        for d, k in sampler.global_batch(step):
            counts[sampler.domains[d]][k] += 1
    replayed = replay({"web": 50, "code": 7, "math": 3}, {"web": 0.7, "code": 0.2, "math": 0.1}, 3, 16, 37)
    for d in counts:
        assert (replayed[d] == counts[d]).all()


class FakePool:
    """In-memory stand-in for runner.data.pool.Pool."""

    def __init__(self, tokens):
        self.array = np.asarray(tokens, dtype=np.uint16)
        self.tokens = len(self.array)

    def read(self, start, stop):
        assert 0 <= start < stop <= self.tokens
        return self.array[start:stop]


def test_batch_reader_reads_windows_of_seq_len_plus_one():
    pools = {"web": FakePool(np.arange(100)), "code": FakePool(np.arange(1000, 1021))}
    reader = BatchReader(pools, seq_len=4)
    assert reader.samples == [5, 24]  # code: (21 - 1) // 4, web: (100 - 1) // 4
    batch = reader.read([(1, 3), (0, 4), (1, 0)])
    assert batch.input_ids.dtype == torch.int64 and batch.labels.dtype == torch.int64
    assert batch.input_ids.tolist() == [[12, 13, 14, 15], [1016, 1017, 1018, 1019], [0, 1, 2, 3]]
    assert batch.labels.tolist() == [[13, 14, 15, 16], [1017, 1018, 1019, 1020], [1, 2, 3, 4]]
    assert batch.domain_ids.tolist() == [1, 0, 1]
    assert batch.loss_mask.dtype == torch.bool and batch.loss_mask.all()
    assert batch.loss_mask.shape == (3, 4)
    with pytest.raises(IndexError):
        reader.read([(0, 5)])


def test_sampler_refuses_mismatched_or_empty_domains():
    with pytest.raises(RunnerError, match="mixture.domains"):
        MixtureSampler({"a": 5}, {"b": 1.0}, 0, 4)
    with pytest.raises(RunnerError, match="data.manifests.a"):
        MixtureSampler({"a": 0, "b": 3}, {"a": 0.5, "b": 0.5}, 0, 4)


def test_the_schedule_repeats_every_period_so_any_step_is_closed_form():
    import random

    rng = random.Random(2)
    for _ in range(150):
        n = rng.randint(1, 5)
        cuts = [0, *sorted(rng.sample(range(1, 1000), n - 1)), 1000]
        ratios = {f"d{i}": (cuts[i + 1] - cuts[i]) / 1000 for i in range(n)}  # decimals as a recipe writes them
        batch = rng.choice([1, 3, 8, 16, 512, 1000])
        schedule = MixtureSchedule(ratios, batch)
        sequential = [tuple(0 for _ in ratios)]
        for step in range(1, 3 * schedule.period + 5):
            sequential.append(schedule._advance(step, sequential[-1]))  # the EDF rule, never shortcut
        fresh = MixtureSchedule(ratios, batch)
        for step in rng.sample(range(len(sequential)), min(40, len(sequential))):
            assert fresh.counts(step) == sequential[step], (ratios, batch, step)
    # 0.5 / 0.4 / 0.1 of 16 sequences: every target is whole after 5 steps; a step 10**15 costs nothing.
    schedule = MixtureSchedule({"code": 0.5, "prose": 0.4, "legal": 0.1}, 16)
    assert schedule.period == 5
    t0 = time.perf_counter()
    assert schedule.counts(10**15 + 3) == tuple(
        n * 16 * 10**15 // 10 + c for n, c in zip((5, 1, 4), schedule.counts(3))
    )
    assert time.perf_counter() - t0 < 30  # a replay of 10**15 steps would take a century
