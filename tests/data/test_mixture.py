"""The mixture planner: exact per-domain exposure, or a refusal a user can act on."""

import pytest

from runner.data.mixture import plan_mixture
from runner.data.sampler import MixtureSampler
from runner.errors import MixtureInfeasible, RunnerError

# 100,000 samples x 1,000 tokens = a 100M-token pool; global batch 1,000 x 1,000 = 1M tokens.
SAMPLES = {"math": 100_000, "web": 10_000_000}
RATIOS = {"math": 0.3, "web": 0.7}
TEN_B = 10_000_000_000


def test_hand_computed_case_needs_thirty_epochs_and_is_refused_under_cap_4():
    # 30% of 10B = 3B tokens of math over a 100M-token pool = 30 epochs.
    with pytest.raises(MixtureInfeasible) as info:
        plan_mixture(SAMPLES, RATIOS, {"math": 4.0, "web": 1.0}, TEN_B, 1000, 1000)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("mixture.domains.math.max_repetition_ratio: ")
    assert "'math'" in message and "needs 30 epochs" in message
    # 4 epochs x 100M / 0.3 = 1.333...B, rounded down to whole 1M-token batches.
    assert "largest feasible budget at these ratios: 1,333,000,000 tokens" in message
    assert "smallest cap that fits this budget: 30.0" in message
    assert isinstance(info.value, RunnerError)


def test_hand_computed_case_is_accepted_under_cap_30():
    plan = plan_mixture(SAMPLES, RATIOS, {"math": 30.0, "web": 1.0}, TEN_B, 1000, 1000)
    assert plan.steps == 10_000
    math = plan.domains["math"]
    assert (math.exposure_samples, math.exposure_tokens) == (3_000_000, 3_000_000_000)
    assert (math.pool_tokens, math.epochs) == (100_000_000, 30.0)
    assert plan.domains["web"].epochs == pytest.approx(0.7)
    assert sum(p.exposure_tokens for p in plan.domains.values()) == TEN_B


def test_planned_counts_are_exactly_what_the_sampler_produces():
    samples = {"a": 40, "b": 900, "c": 5}
    ratios = {"a": 0.123, "b": 0.871, "c": 0.006}  # c gets 0.042 samples per step
    plan = plan_mixture(samples, ratios, {d: 100.0 for d in samples}, 7 * 333 * 16, 16, 7)
    sampler = MixtureSampler(samples, ratios, seed=0, global_batch_sequences=7)
    counts = [0, 0, 0]
    for step in range(plan.steps):
        for d, _ in sampler.global_batch(step):
            counts[d] += 1
    assert [plan.domains[d].exposure_samples for d in sampler.domains] == counts


def _refusal(samples, ratios, caps, budget, seq_len, batch):
    with pytest.raises(MixtureInfeasible) as info:
        plan_mixture(samples, ratios, caps, budget, seq_len, batch)
    return str(info.value)


def test_largest_feasible_budget_and_smallest_cap_are_tight():
    samples = {"rare": 7, "bulk": 10_000}
    ratios = {"rare": 0.013, "bulk": 0.987}
    caps = {"rare": 2.5, "bulk": 4.0}
    seq_len, batch = 8, 5
    message = _refusal(samples, ratios, caps, 40 * 400, seq_len, batch)
    budget = int(message.split("largest feasible budget at these ratios: ")[1].split(" ")[0].replace(",", ""))
    assert budget % (seq_len * batch) == 0 and budget > 0
    plan_mixture(samples, ratios, caps, budget, seq_len, batch)  # the offered budget fits
    _refusal(samples, ratios, caps, budget + seq_len * batch, seq_len, batch)  # one more doesn't
    cap = float(message.split("smallest cap that fits this budget: ")[1].split(" ")[0])
    plan_mixture(samples, ratios, {**caps, "rare": cap}, 40 * 400, seq_len, batch)


def test_other_domains_over_their_cap_are_named_too():
    message = _refusal({"a": 10, "b": 10}, {"a": 0.5, "b": 0.5}, {"a": 1.0, "b": 2.0}, 10 * 60, 10, 6)
    assert "'a'" in message and "also over cap: b needs 3 > 2" in message


@pytest.mark.parametrize(
    "budget, key",
    [
        (1_000_001 * 1000, "train.exposure_tokens"),  # not a whole number of batches
        (0, "train.exposure_tokens"),
    ],
)
def test_budget_must_be_whole_global_batches(budget, key):
    with pytest.raises(RunnerError, match=key):
        plan_mixture(SAMPLES, RATIOS, {"math": 30.0, "web": 1.0}, budget, 1000, 1000)


@pytest.mark.parametrize(
    "ratios, caps, key",
    [
        ({"math": 0.3, "web": 0.6}, {"math": 30, "web": 1}, "mixture.domains: target ratios sum"),
        ({"math": 0.3 + 1e-8, "web": 0.7}, {"math": 30, "web": 1}, "mixture.domains: target ratios"),
        ({"math": -0.3, "web": 1.3}, {"math": 30, "web": 1}, "mixture.domains.math.target_ratio"),
        ({"math": 0.3, "web": 0.7}, {"math": 30, "web": 0.9}, "mixture.domains.web.max_repetition_ratio"),
        ({"math": 0.3, "web": 0.7}, {"math": 30}, "mixture.domains: domains differ"),
    ],
)
def test_ratios_and_caps_are_validated(ratios, caps, key):
    with pytest.raises(RunnerError, match=key):
        plan_mixture(SAMPLES, ratios, caps, TEN_B, 1000, 1000)


def test_ratios_within_tolerance_of_one_are_accepted():
    ratios = {"a": 0.3333333333, "b": 0.3333333333, "c": 0.3333333334}
    plan = plan_mixture({d: 10_000 for d in ratios}, ratios, {d: 1.0 for d in ratios}, 30 * 100 * 10, 10, 30)
    assert sum(p.exposure_samples for p in plan.domains.values()) == 3000
