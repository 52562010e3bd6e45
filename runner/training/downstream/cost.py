"""Request counts and input positions of an eval recipe's downstream tasks, for `runner plan`.

Owns: reading the tasks (pinned files, their subsets) and counting what a scoring feeds the model:
one window per request, min(len(context + continuation tokens), seq_len + 1) - 1 input positions,
a context shared by several requests counted once where the model's attention shares it
(runner.training.downstream.rows).
Tokens are the run's tokenizer's where its file is at hand (exact), else estimated from UTF-8 bytes
at the plan's `raw_bytes_per_token` (the basis says which). The arithmetic is
runner.planning.downstream_cost's.
"""

from __future__ import annotations

import math
from typing import Any

from runner.config.load import Experiment
from runner.errors import RunnerError
from runner.training.downstream.rows import SHARING_ATTENTION, rows
from runner.training.downstream.tasks import load_task


def _encoder(exp: Experiment):
    from runner.data.tokenizer import load_tokenizer  # noqa: PLC0415  (tokenizers: only with a tokenizer file)
    from runner.training.downstream.encode import Encoder  # noqa: PLC0415

    cfg = exp.config
    path = exp.resolve_path(cfg.tokenizer.path) if cfg.tokenizer.path else None
    if path is None or not path.is_file():
        return None
    return Encoder(load_tokenizer(path, cfg.tokenizer.sha256), cfg.train.seq_len)


def task_positions(exp: Experiment) -> dict[str, dict[str, Any]]:
    """{task: {requests, documents, positions, basis}} for the recipe's tasks ({} without tasks).
    A task file that is missing or does not match its pin is a RunnerError naming it."""
    cfg = exp.config
    if not cfg.eval.tasks:
        return {}
    encoder = _encoder(exp)
    seq_len, bytes_per_token = cfg.train.seq_len, cfg.plan.raw_bytes_per_token
    out = {}
    for name, spec in sorted(cfg.eval.tasks.items()):
        task = load_task(name, spec, exp.project_root)
        requests = [r for d in task.documents for r in d.requests]
        if encoder is not None:
            encoded = [encoder.window(r.context, r.continuation) for r in requests]
            share = str(cfg.model.attn_implementation) in SHARING_ATTENTION
            positions = sum(row.width(encoded) for row in rows(encoded, share))
            basis = "tokenized (the run's tokenizer)" + ("; a context once for its choices" if share else "")
        else:
            positions = sum(
                min(math.ceil(len((r.context + r.continuation).encode("utf-8")) / bytes_per_token), seq_len)
                for r in requests
            )
            basis = f"estimated: UTF-8 bytes / {bytes_per_token:g} bytes per token (tokenizer file not at hand)"
        out[name] = {
            "requests": len(requests),
            "documents": len(task.documents),
            "positions": positions,
            "basis": basis,
        }
    return out


def safe_task_positions(exp: Experiment) -> tuple[dict[str, dict[str, Any]], str | None]:
    """task_positions, or ({}, why) when a task cannot be read here (the plan says so, never fails)."""
    try:
        return task_positions(exp), None
    except RunnerError as err:
        return {}, str(err)
