"""The token ledger against a brute-force recount of the sampler's pairs."""

from collections import Counter

import numpy as np
import pytest
from recount import replay
from safetensors.numpy import load_file, save_file

from runner.data.sampler import MixtureSampler
from runner.training.ledger import TokenLedger

SAMPLES = {"web": 40, "code": 9, "math": 2}
RATIOS = {"web": 0.75, "code": 0.2, "math": 0.05}
CAPS = {"web": 10.0, "code": 10.0, "math": 40.0}
L, B = 8, 8


def _run(steps, lost_steps=(), ledger=None, start=0):
    """Commits `steps` steps; each step in lost_steps is processed once more and discarded."""
    sampler = MixtureSampler(SAMPLES, RATIOS, seed=11, global_batch_sequences=B)
    ledger = ledger or TokenLedger(SAMPLES, L)
    for step in range(start, start + steps):
        pairs = sampler.global_batch(step)
        per_domain = Counter(sampler.domains[d] for d, _ in pairs)
        processed = {d: n * L for d, n in per_domain.items()}
        if step in lost_steps:
            ledger.record_processed(processed)  # crashed before commit: compute spent, lost
        ledger.record_processed(processed)
        useful = {d: n * L - n for d, n in per_domain.items()}  # one masked target per row
        ledger.commit(pairs, useful)
    return sampler, ledger


def test_counters_equal_a_brute_force_recount():
    sampler, ledger = _run(30, lost_steps={4, 17})
    seen = Counter()
    exposure = Counter()
    for step in range(30):
        for d, k in sampler.global_batch(step):
            seen[(d, k)] += 1
            exposure[d] += L
    lost = Counter()
    for step in (4, 17):
        for d, _ in sampler.global_batch(step):
            lost[d] += L
    rows = ledger.counters()
    for d, name in enumerate(sampler.domains):
        row = rows[name]
        assert row["exposure"] == exposure[d]
        assert row["processed"] == exposure[d] + lost[d]
        assert row["lost"] == lost[d]
        assert row["useful"] == exposure[d] - exposure[d] // L
        assert row["unique"] == len([1 for (dd, _) in seen if dd == d]) * L
        assert row["pool"] == SAMPLES[name] * L
        times = Counter(seen[(d, k)] for k in range(SAMPLES[name]))
        assert ledger.histogram()[name] == {t: times.get(t, 0) for t in range(max(times) + 1)}
    assert rows["total"]["exposure"] == 30 * B * L
    assert rows["total"]["lost"] == 2 * B * L
    assert ledger.realized_ratios()["web"] == pytest.approx(rows["web"]["exposure"] / (30 * B * L))
    assert ledger.check_invariants(B, L, 30, RATIOS, CAPS) == []


def test_ledger_agrees_with_the_independent_replay():
    _, ledger = _run(25)
    recount = replay(SAMPLES, RATIOS, 11, B, 25)
    for name, seen in zip(ledger.domains, ledger.seen):
        assert (seen == np.minimum(recount[name], 255)).all()


def test_per_sample_counter_saturates_at_255():
    ledger = TokenLedger({"one": 1}, 4)
    for _ in range(300):
        ledger.record_processed({"one": 4})
        ledger.commit([(0, 0)], {"one": 4})
    assert ledger.histogram()["one"] == {t: (1 if t == 255 else 0) for t in range(256)}
    row = ledger.counters()["one"]
    assert (row["exposure"], row["unique"], row["pool"]) == (1200, 4, 4)  # exposure never saturates
    assert ledger.check_invariants(1, 4, 300, {"one": 1.0}, {"one": 300.0}) == []


def test_duplicate_samples_within_one_step_count_twice():
    ledger = TokenLedger({"a": 3}, 2)
    ledger.record_processed({"a": 6})
    ledger.commit([(0, 1), (0, 1), (0, 2)], {"a": 6})
    assert ledger.histogram()["a"] == {0: 1, 1: 1, 2: 1}
    assert ledger.counters()["a"]["unique"] == 4 and ledger.counters()["a"]["exposure"] == 6


def test_state_dict_round_trips_through_safetensors(tmp_path):
    _, ledger = _run(12, lost_steps={3})
    state = ledger.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    save_file(state, str(tmp_path / "ledger.safetensors"))
    restored = TokenLedger(SAMPLES, L)
    restored.load_state_dict(load_file(str(tmp_path / "ledger.safetensors")))
    assert restored.counters() == ledger.counters()
    assert restored.histogram() == ledger.histogram()
    assert restored.committed_steps == 12
    # Resuming from the restored ledger ends exactly where an uninterrupted run ends.
    _run(8, ledger=restored, start=12)
    _, uninterrupted = _run(20, lost_steps={3})
    assert restored.counters() == uninterrupted.counters()
    assert restored.histogram() == uninterrupted.histogram()


def test_state_for_other_pools_is_refused():
    _, ledger = _run(2)
    with pytest.raises(ValueError, match="domains"):
        TokenLedger({"web": 40, "code": 9}, L).load_state_dict(ledger.state_dict())
    with pytest.raises(ValueError, match="samples"):
        TokenLedger({**SAMPLES, "web": 41}, L).load_state_dict(ledger.state_dict())
    with pytest.raises(ValueError, match="seq_len"):
        TokenLedger(SAMPLES, L * 2).load_state_dict(ledger.state_dict())


def test_each_invariant_violation_is_reported():
    _, ledger = _run(10)
    assert ledger.check_invariants(B, L, 10, RATIOS, CAPS) == []
    problems = ledger.check_invariants(B, L, 11, RATIOS, CAPS)
    assert any(p.startswith("invariant 3:") for p in problems)
    problems = ledger.check_invariants(B, L, 10, RATIOS, {**CAPS, "math": 1.0})
    assert [p.split(":")[0] for p in problems] == ["invariant 4"] and "math" in problems[0]
    problems = ledger.check_invariants(B, L, 10, {"web": 0.7, "code": 0.25, "math": 0.05}, CAPS)
    assert {p.split(":")[1].strip() for p in problems} == {"web", "code"}
    state = ledger.state_dict()
    state["processed.by_domain"][0] -= 1  # processed below exposure, totals no longer add up
    broken = TokenLedger(SAMPLES, L)
    broken.load_state_dict(state)
    kinds = {p.split(":")[0] for p in broken.check_invariants(B, L, 10, RATIOS, CAPS)}
    assert kinds == {"invariant 1", "invariant 2"}
