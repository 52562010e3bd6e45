"""Mixture planner: what a budget at given ratios asks of each domain's pool, or why it can't.

Owns the feasibility decision made before training (SPEC "Budget and duration"): validation of
the budget (whole global batches), the ratios (positive, summing to 1) and the repetition caps
(>= 1.0), and the per-domain planned exposure. Planned sample counts are the sampler's own
counts (runner.data.sampler.MixtureSchedule), never re-derived here. It must never read pools or
train; it only does arithmetic on sample counts.

`max_repetition_ratio` has OLMo-core's SourceMixture meaning (the most epochs a domain's pool
may be walked), but the check is exact: planned samples vs cap * pool samples, in integers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from runner.config.data_recipes import RATIO_SUM_TOLERANCE
from runner.data.sampler import MixtureSchedule
from runner.errors import MixtureInfeasible, RunnerError

#: steps of the sampler's schedule the planner may replay (about 5 us each: ~10 s). Only ratios with
#: many decimals (a period over this) and a budget of more steps than this reach it.
MAX_PLAN_REPLAY_STEPS = 2_000_000


@dataclass(frozen=True)
class DomainPlan:
    """Planned exposure of one domain over the whole run."""

    samples: int  # samples in the pool
    pool_tokens: int  # samples * L (input positions)
    exposure_samples: int
    exposure_tokens: int
    epochs: float  # exposure_tokens / pool_tokens
    target_ratio: float
    max_repetition_ratio: float


@dataclass(frozen=True)
class MixturePlan:
    exposure_tokens: int
    seq_len: int
    global_batch_sequences: int
    steps: int
    domains: dict[str, DomainPlan] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "exposure_tokens": self.exposure_tokens,
            "seq_len": self.seq_len,
            "global_batch_sequences": self.global_batch_sequences,
            "steps": self.steps,
            "domains": {d: vars(p).copy() for d, p in self.domains.items()},
        }


def _fmt_cap(value: Fraction) -> str:
    """Smallest cap, rounded up to 4 decimals so that using it as written is feasible."""
    scaled = math.ceil(value * 10_000)
    text = f"{scaled // 10_000}.{scaled % 10_000:04d}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _validate(samples, ratios, caps, exposure_tokens, seq_len, global_batch_sequences) -> int:
    """Checks every input; returns the number of steps."""
    for name, value in (("train.seq_len", seq_len), ("train.global_batch_sequences", global_batch_sequences)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise RunnerError(f"must be a positive integer, got {value!r}", key=name)
    if set(ratios) != set(samples) or set(caps) != set(samples):
        raise RunnerError(
            f"domains differ: pools {sorted(samples)}, ratios {sorted(ratios)}, caps {sorted(caps)}",
            key="mixture.domains",
        )
    if not samples:
        raise RunnerError("a mixture needs at least one domain", key="mixture.domains")
    for d in sorted(samples):
        if int(samples[d]) < 1:
            raise RunnerError(
                f"pool has {samples[d]} samples of {seq_len} tokens; it needs at least one", key=f"data.manifests.{d}"
            )
        r = float(ratios[d])
        if not r > 0 or not math.isfinite(r):
            raise RunnerError(f"must be > 0, got {ratios[d]!r}", key=f"mixture.domains.{d}.target_ratio")
        c = float(caps[d])
        if not c >= 1.0 or not math.isfinite(c):
            raise RunnerError(
                f"must be >= 1.0 (epochs over the pool), got {caps[d]!r}",
                key=f"mixture.domains.{d}.max_repetition_ratio",
            )
    total = sum(float(r) for r in ratios.values())
    if abs(total - 1.0) > RATIO_SUM_TOLERANCE:
        raise RunnerError(
            f"target ratios sum to {total!r}, not 1 (tolerance {RATIO_SUM_TOLERANCE})", key="mixture.domains"
        )
    batch_tokens = int(global_batch_sequences) * int(seq_len)
    if (
        isinstance(exposure_tokens, bool)
        or int(exposure_tokens) != exposure_tokens
        or exposure_tokens < batch_tokens
        or exposure_tokens % batch_tokens
    ):
        raise RunnerError(
            f"{exposure_tokens!r} tokens is not a positive whole number of global "
            f"batches of {global_batch_sequences} x {seq_len} = {batch_tokens:,} "
            f"tokens",
            key="train.exposure_tokens",
        )
    return int(exposure_tokens) // batch_tokens


def plan_mixture(
    samples: Mapping[str, int],
    ratios: Mapping[str, float],
    caps: Mapping[str, float],
    exposure_tokens: int,
    seq_len: int,
    global_batch_sequences: int,
) -> MixturePlan:
    """Per-domain planned exposure, or `MixtureInfeasible` naming the constraining domain."""
    steps = _validate(samples, ratios, caps, exposure_tokens, seq_len, global_batch_sequences)
    seq_len, batch = int(seq_len), int(global_batch_sequences)
    schedule = MixtureSchedule(ratios, batch)
    domains = schedule.domains
    # Exact cap in samples: epochs <= cap  <=>  exposure_samples <= floor(cap * samples).
    limits = [math.floor(Fraction(repr(float(caps[d]))) * int(samples[d])) for d in domains]
    # Each count is the floor or the ceil of its exact target, so a target whose floor is over its
    # limit is infeasible whatever the schedule does: decided without replaying (a budget of 10^18
    # tokens is refused at once).
    targets = schedule.targets(steps)
    certain = [i for i in range(len(domains)) if math.floor(targets[i]) > limits[i]]
    if certain:
        bounds = [math.floor(t) for t in targets]
        raise _infeasible(schedule, samples, ratios, caps, steps, seq_len, bounds, limits, certain)
    _check_replay(schedule, steps)
    counts = schedule.counts(steps)
    over = [i for i, d in enumerate(domains) if counts[i] > limits[i]]
    if over:
        raise _infeasible(schedule, samples, ratios, caps, steps, seq_len, counts, limits, over)
    plans = {}
    for i, d in enumerate(domains):
        pool_tokens = int(samples[d]) * seq_len
        plans[d] = DomainPlan(
            samples=int(samples[d]),
            pool_tokens=pool_tokens,
            exposure_samples=counts[i],
            exposure_tokens=counts[i] * seq_len,
            epochs=counts[i] / int(samples[d]),
            target_ratio=float(ratios[d]),
            max_repetition_ratio=float(caps[d]),
        )
    return MixturePlan(
        exposure_tokens=int(exposure_tokens), seq_len=seq_len, global_batch_sequences=batch, steps=steps, domains=plans
    )


def _check_replay(schedule: MixtureSchedule, steps: int) -> None:
    """Exact counts replay up to one period of the schedule; refuse a plan that would take minutes."""
    if schedule.replay_steps(steps) > MAX_PLAN_REPLAY_STEPS:
        raise RunnerError(
            f"these ratios repeat only every {schedule.period:,} steps, so planning {steps:,} steps would replay "
            f"{schedule.replay_steps(steps):,} of them (at most {MAX_PLAN_REPLAY_STEPS:,}); write the ratios with "
            "fewer decimal places",
            key="mixture.domains",
        )


def _largest_feasible_steps(schedule: MixtureSchedule, limits: list[int], steps: int) -> int:
    """Largest s <= steps with every cumulative count within its cap (counts never decrease)."""
    # The count is floor or ceil of the exact target, so feasibility certainly holds while
    # ceil(target) <= limit and certainly fails once floor(target) > limit; only the steps in
    # between need the schedule itself, and since feasibility is monotone a bisection finds the
    # last feasible one in log(gap) lookups.
    sure, impossible = steps, steps + 1
    for i, limit in enumerate(limits):
        share = schedule.samples_per_step(i)
        sure = min(sure, math.floor(limit / share))
        impossible = min(impossible, math.floor((limit + 1) / share) + 1)
    if impossible - sure > 1 and min(impossible, schedule.period) > MAX_PLAN_REPLAY_STEPS:
        return sure  # feasible for certain; the exact last step would take too long to replay
    lo, hi = sure, impossible  # lo feasible, hi infeasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if all(c <= lim for c, lim in zip(schedule.counts(mid), limits)):
            lo = mid
        else:
            hi = mid
    return lo


def _infeasible(schedule, samples, ratios, caps, steps, seq_len, counts, limits, over):
    domains = schedule.domains
    batch_tokens = schedule.global_batch * seq_len
    epochs = {i: Fraction(counts[i], int(samples[domains[i]])) for i in over}
    worst = max(over, key=lambda i: (epochs[i] / Fraction(repr(float(caps[domains[i]]))), -i))
    name = domains[worst]
    best_steps = _largest_feasible_steps(schedule, limits, steps)
    others = [f"{domains[i]} needs {float(epochs[i]):.4g} > {float(caps[domains[i]]):g}" for i in over if i != worst]
    message = (
        f"mixture infeasible: domain {name!r} at ratio {float(ratios[name]):g} of "
        f"{steps * batch_tokens:,} tokens needs {float(epochs[worst]):.4g} epochs of its "
        f"{int(samples[name]) * seq_len:,}-token pool, over max_repetition_ratio "
        f"{float(caps[name]):g}; largest feasible budget at these ratios: "
        f"{best_steps * batch_tokens:,} tokens ({best_steps:,} global batches of "
        f"{batch_tokens:,}); smallest cap that fits this budget: "
        f"{_fmt_cap(epochs[worst])}"
    )
    if others:
        message += f" (also over cap: {', '.join(others)})"
    return MixtureInfeasible(message, key=f"mixture.domains.{name}.max_repetition_ratio")
