"""Downstream metrics from per-request log-likelihoods (SPEC "Downstream evaluation": Metrics).

Owns: acc (raw ll), acc_norm (lm-eval's: ll / characters of the choice, the continuation less one
leading " "), acc_per_char (OLMES's len_norm: ll / characters of the continuation as given),
acc_per_token (ll / continuation tokens), bpb (mean over documents of -ll_gold / (ln 2 x UTF-8
bytes of the gold continuation)), the random baseline, `centered_<acc>` = (acc - b) / (1 - b),
and the aggregate over tasks. numpy argmax: ties go to the lowest index. Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from runner.config.eval_recipe import DOWNSTREAM_ACCURACIES
from runner.training.downstream.documents import Task


def _choice_chars(continuation: str) -> int:
    return len(continuation[1:] if continuation.startswith(" ") else continuation)


def scores(task: Task, lls: Sequence[float], token_counts: Sequence[int]) -> dict[str, np.ndarray]:
    """Per accuracy, each document's normalised scores would pick: {metric: chosen index per document}."""
    chosen: dict[str, list[int]] = {m: [] for m in DOWNSTREAM_ACCURACIES}
    pos = 0
    for d in task.documents:
        ll = np.asarray(lls[pos : pos + d.choices], dtype=np.float64)
        toks = np.asarray(token_counts[pos : pos + d.choices], dtype=np.float64)
        conts = [r.continuation for r in d.requests]
        chosen["acc"].append(int(np.argmax(ll)))
        chosen["acc_norm"].append(int(np.argmax(ll / np.array([max(_choice_chars(c), 1) for c in conts]))))
        chosen["acc_per_char"].append(int(np.argmax(ll / np.array([max(len(c), 1) for c in conts]))))
        chosen["acc_per_token"].append(int(np.argmax(ll / toks)))
        pos += d.choices
    return {m: np.asarray(v) for m, v in chosen.items()}


def random_baseline(task: Task) -> float:
    if task.random_baseline is not None:
        return task.random_baseline
    return float(np.mean([1.0 / d.choices for d in task.documents]))


def task_metrics(task: Task, lls: Sequence[float], token_counts: Sequence[int]) -> dict[str, float]:
    """Every metric of the SPEC for one task (the recipe's `metrics` pick what is reported)."""
    gold = np.asarray([d.gold for d in task.documents])
    picked = scores(task, lls, token_counts)
    b = random_baseline(task)
    out: dict[str, float] = {}
    for m in DOWNSTREAM_ACCURACIES:
        acc = float(np.mean(picked[m] == gold))
        out[m] = acc
        out[f"centered_{m}"] = (acc - b) / (1 - b)
    pos, bpb = 0, []
    for d in task.documents:
        gold_cont = d.requests[d.gold].continuation
        bpb.append(-lls[pos + d.gold] / (math.log(2) * max(len(gold_cont.encode("utf-8")), 1)))
        pos += d.choices
    out["bpb"] = float(np.mean(bpb))
    return out


def aggregate_metrics(tasks: Sequence[Task]) -> dict[str, str]:
    """Per task, the metric `mean_centered` averages: its first listed centered metric, else the
    centered form of its first listed accuracy (tasks with neither are left out)."""
    out = {}
    for t in tasks:
        centered = [m for m in t.metrics if m.startswith("centered_")]
        accs = [m for m in t.metrics if m in DOWNSTREAM_ACCURACIES]
        if centered or accs:
            out[t.name] = centered[0] if centered else f"centered_{accs[0]}"
    return out


def aggregate(tasks: Sequence[Task], metrics: dict[str, dict[str, float]], rule: str) -> float | None:
    """`mean_centered`: the mean over tasks of aggregate_metrics' choice (None when no task has an
    accuracy, or rule = none)."""
    chosen = aggregate_metrics(tasks)
    if rule == "none" or not chosen:
        return None
    return float(np.mean([metrics[name][m] for name, m in chosen.items()]))
