"""The optimizer and its learning-rate schedule.

Owns: AdamW with decay on matrices only, the lr of every step under cosine / WSD / constant
schedules, and which segment's schedule length is in force after an extension. Never steps the
optimizer itself (the loop does).
"""

from __future__ import annotations

import math

import torch

from runner.config.schema import ExperimentSchema, OptimRecipe
from runner.errors import RunnerError


def lr_at(step: int, optim: OptimRecipe, schedule_steps: int, warmup_steps: int) -> float:
    """Learning rate of step `step` (0-based) over a schedule of `schedule_steps` steps."""
    peak, floor = optim.lr, optim.lr * optim.min_lr_ratio
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if optim.schedule == "constant":
        return peak
    if optim.schedule == "cosine":
        span = max(schedule_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if optim.schedule == "wsd":
        decay_steps = max(round(schedule_steps * optim.decay_fraction), 1)
        decay_start = schedule_steps - decay_steps
        if step < decay_start:
            return peak
        return peak + (floor - peak) * min((step - decay_start + 1) / decay_steps, 1.0)
    raise RunnerError(f"unknown schedule {optim.schedule!r}", key="optim.schedule")


def segment_schedule_steps(segments: list, step: int, tokens_per_step: int, default_steps: int) -> int:
    """Schedule length (steps) in force at `step`: the max_duration of the segment holding it.

    Each extension is a new segment with its own max_duration; the steps of an earlier segment keep
    the schedule they were trained under, so a resume that falls back to a checkpoint from before
    the extension replays them with the same learning rates."""
    chosen = None
    for seg in sorted(segments or [], key=lambda g: int(g.get("start_step", 0))):
        if int(seg.get("start_step", 0)) <= step and seg.get("max_duration_tokens") is not None:
            chosen = int(seg["max_duration_tokens"]) // tokens_per_step
    return default_steps if chosen is None else chosen


def make_optimizer(model: torch.nn.Module, cfg: ExperimentSchema, fused: bool) -> torch.optim.AdamW:
    # Decay matrices only: norms' gains are not weights to shrink towards zero.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    beta1, beta2 = o.betas
    if fused:
        return torch.optim.AdamW(groups, lr=o.lr, betas=(beta1, beta2), eps=o.eps, fused=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(beta1, beta2), eps=o.eps, foreach=False)
