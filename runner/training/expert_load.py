"""Expert load of a mixture-of-experts run: input positions routed to each expert, per layer and domain.

Owns: the committed totals (an exact int64 count per layer x domain x expert), SPEC's invariant
(per layer and domain the loads sum to that domain's exposure x k: the implementation never drops
a position, so no dropped count exists), the derived figures (load imbalance = max / mean,
coefficient of variation = std / mean, idle capacity = 1 - mean / max), the checkpointable state
(kept with the ledger's in ledger.safetensors, so a resume or a rollback restores both together)
and `expert_load.json` in the run folder. Numpy only, so reports and the audit read it without torch.
Never: observes routing (runner.training.experts does, in the trainer) or counts work of a step
that was not committed (the trainer adds a step only after the ledger committed it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runner.errors import RunnerError
from runner.fsio import atomic_write_json, read_json
from runner.runs.recorded import whole

FILE = "expert_load.json"
FORMAT = "runner-expert-load/1"
STATE_KEY = "expert_load.routed"  # in the checkpoint's ledger.safetensors, next to the ledger's own keys


def balance(load: np.ndarray) -> dict[str, np.ndarray]:
    """SPEC's balance figures over the last axis (experts) of `load`: max, mean, imbalance (max /
    mean), cv (population std / mean) and idle capacity (1 - mean / max). NaN where nothing was routed."""
    load = np.asarray(load, dtype=np.float64)
    peak, mean, std = load.max(axis=-1), load.mean(axis=-1), load.std(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return {
            "max": peak,
            "mean": mean,
            "imbalance": np.where(mean > 0, peak / mean, np.nan),
            "cv": np.where(mean > 0, std / mean, np.nan),
            "idle_capacity": np.where(peak > 0, 1.0 - mean / peak, np.nan),
        }


class ExpertLoad:
    """Committed routed positions, `routed[layer, domain, expert]` (domain id = index in sorted names)."""

    def __init__(self, domains: Sequence[str], n_layers: int, n_experts: int, experts_per_token: int):
        self.domains = sorted(domains)
        self.n_layers, self.n_experts, self.k = int(n_layers), int(n_experts), int(experts_per_token)
        self.routed = np.zeros((self.n_layers, len(self.domains), self.n_experts), dtype=np.int64)

    def add(self, step_routed: np.ndarray) -> None:
        """One committed step's routed positions, summed over every rank."""
        self.routed += np.asarray(step_routed, dtype=np.int64).reshape(self.routed.shape)

    def broken_invariant(self, exposure_by_domain: Mapping[str, int]) -> list[str]:
        """Where the loads of a layer and domain do not sum to the domain's exposure x k (SPEC)."""
        sums = self.routed.sum(axis=2)
        problems = []
        for d, name in enumerate(self.domains):
            want = int(exposure_by_domain[name]) * self.k
            for layer in np.nonzero(sums[:, d] != want)[0].tolist():
                problems.append(
                    f"layer {layer} {name}: {int(sums[layer, d])} routed != exposure "
                    f"{int(exposure_by_domain[name])} x {self.k} experts per token"
                )
        return problems

    def state_dict(self) -> dict[str, np.ndarray]:
        return {STATE_KEY: self.routed.copy()}

    def load_state_dict(self, state: Mapping[str, np.ndarray] | None, where: str) -> None:
        """Restore from a checkpoint's ledger state; None (no checkpoint) starts from zero. A state
        without expert load, or of another shape, is refused: the tables would start from a guess."""
        if state is None:
            self.routed[...] = 0
            return
        if STATE_KEY not in state:
            raise RunnerError("the checkpoint holds no expert load (written by a dense run?)", file=where)
        routed = np.asarray(state[STATE_KEY], dtype=np.int64)
        if routed.shape != self.routed.shape:
            raise RunnerError(
                f"the checkpoint's expert load has shape {list(routed.shape)} (layers, domains, experts), "
                f"this model {list(self.routed.shape)}",
                file=where,
            )
        self.routed = routed.copy()

    def to_json(self, committed_steps: int) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "experts_per_token": self.k,
            "drops_tokens": False,
            "committed_steps": int(committed_steps),
            "domains": list(self.domains),
            "routed_tokens": {d: self.routed[:, i, :].tolist() for i, d in enumerate(self.domains)},
        }

    def write_json(self, run_dir: str | Path, committed_steps: int) -> None:
        atomic_write_json(Path(run_dir) / FILE, self.to_json(committed_steps))


def read_expert_load(path: str | Path) -> tuple[ExpertLoad, int]:
    """An expert_load.json back as (ExpertLoad, committed_steps); a malformed file is a RunnerError."""
    data = read_json(path)
    try:
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        for key in ("n_layers", "n_experts", "experts_per_token", "committed_steps"):
            if not whole(data.get(key)):
                raise ValueError(f"{key}: must be a whole number, got {json.dumps(data.get(key))[:40]}")
        load = ExpertLoad(data["domains"], data["n_layers"], data["n_experts"], data["experts_per_token"])
        for i, d in enumerate(load.domains):
            load.routed[:, i, :] = np.asarray(data["routed_tokens"][d], dtype=np.int64).reshape(
                load.n_layers, load.n_experts
            )
        return load, int(data["committed_steps"])
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as err:  # 1e308 as a count
        raise RunnerError(f"not an expert load record: {err}", file=str(path)) from None
