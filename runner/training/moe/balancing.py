"""Auxiliary-loss-free balancing and the per-step routing record of a mixture-of-experts run.

Owns: once per committed optimizer step, from that step's load (input positions routed to each
expert of each MoE layer, summed over micro batches, ranks and domains: the router probe's
all-reduced count, runner.training.experts), (1) the balancing update of every learned router's
bias with `balancing: aux_free` (runner.training.moe.ds_routers.update_bias; hash-routed layers
have no bias: their choice is a table), outside autograd, identically on every rank, and (2) the
line of `metrics/routing.jsonl`: the step, each MoE layer's per-expert load and, where a layer has
one, its bias after the update (float32 values, written exactly). The bias is a buffer of the
model, so checkpoints carry it and a resume restores it bit for bit; the audit replays the
trajectory from the recorded loads (runner.reports.audit.routing). Also the per-layer load
imbalance of the step (max / mean) for MLflow.
Never: touches the gate weights, counts a step that was not committed, or writes from a rank
other than the main one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.fsio import repair_jsonl_tail
from runner.training.expert_load import balance
from runner.training.moe.deepseek import moe_routers
from runner.training.moe.ds_routers import ScoreTopKRouter, update_bias
from runner.training.routing_record import FILE, FORMAT


class RoutingRecord:
    """The per-step routing record and, for aux_free, the bias updates of `routers` (one per MoE layer)."""

    def __init__(self, routers: list[torch.nn.Module], aux_free: bool, rate: float, run_dir: Path, main: bool):
        self.routers = routers
        self.aux_free, self.rate = aux_free, float(rate)
        self.path = Path(run_dir) / FILE
        self.main = main
        if main:  # a SIGKILL may have torn the last line of an earlier attempt
            repair_jsonl_tail(self.path)

    def _bias(self, router: torch.nn.Module) -> torch.Tensor | None:
        return router.e_score_correction_bias if isinstance(router, ScoreTopKRouter) else None

    def commit(self, step: int, load: np.ndarray) -> dict[str, float]:
        """Step `step` committed with `load` [MoE layers, experts] (every rank's): update the biases,
        write the line, return the step's per-layer imbalance figures."""
        load = np.asarray(load, dtype=np.int64)
        biases: list[list[float] | None] = []
        for layer, router in enumerate(self.routers):
            bias = self._bias(router)
            if bias is None:
                biases.append(None)
                continue
            if self.aux_free:
                update_bias(bias, torch.from_numpy(load[layer]).to(bias.device), self.rate)
            biases.append(bias.detach().cpu().numpy().astype(np.float32).tolist())
        if self.main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            row = {"format": FORMAT, "step": int(step), "load": load.tolist(), "bias": biases}
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        imbalance = balance(load)["imbalance"]
        return {f"moe_layer_{i}_load_imbalance": float(v) for i, v in enumerate(imbalance)}


def attach(model: torch.nn.Module, cfg: Any, run_dir: Path, main: bool) -> RoutingRecord | None:
    """The routing record of a mixture-of-experts model (before it is wrapped); None for a dense one."""
    moe = cfg.model.moe
    if cfg.model.arch != "olmoe" or moe is None:
        return None
    return RoutingRecord(moe_routers(model), moe.balancing == "aux_free", moe.bias_update_rate, run_dir, main)
