"""Scoring an experiment's downstream tasks with a model, and what a scoring records.

Owns: preparing the eval recipe's tasks for a run (loaded, subset, encoded and refused at load),
one scoring of all of them (every task's requests batched together, every rank the same number
of forwards, its wall time as `t_eval_seconds`), the figure rows (task, metric, value, step,
exposure tokens, documents, random baseline (an accuracy's: null on bpb's rows) and the convention
record; the aggregate's names each task's own) and the per-request log-likelihood file. Callers:
the training loop (runner.training.inloop_downstream) and `runner eval`
(runner.training.downstream.posthoc). Never trains and never counts a token.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.config.eval_recipe import DownstreamTask
from runner.config.load import Experiment
from runner.data.tokenizer import load_tokenizer
from runner.errors import RunnerError
from runner.fsio import canonical_json
from runner.training.downstream.documents import Task
from runner.training.downstream.encode import Encoded, Encoder
from runner.training.downstream.metrics import aggregate, aggregate_metrics, random_baseline, task_metrics
from runner.training.downstream.score import loglikelihoods
from runner.training.downstream.tasks import load_task

#: the task `runner eval --tasks builtin` scores when the recipe names none
BUILTIN = DownstreamTask(format="builtin", metrics=["acc", "acc_norm", "centered_acc", "bpb"])


@dataclass(frozen=True)
class Prepared:
    tasks: tuple[Task, ...]
    encoded: tuple[tuple[Encoded, ...], ...]  #: per task, per request
    prefix: int  #: the empty-context prefix id (BOS, else EOS)
    seq_len: int
    aggregate: str


def task_specs(exp: Experiment, names: list[str] | None = None, limit: int | None = None) -> dict[str, DownstreamTask]:
    """The recipe's tasks, or the named ones among them (`builtin` is always available); `limit`
    replaces each task's own (the convention record says which was used)."""
    declared = dict(exp.config.eval.tasks)
    if limit is not None:
        if limit < 1:
            raise RunnerError(f"must be >= 1, got {limit}", key="--limit")
        declared = {n: dataclasses.replace(t, limit=limit) for n, t in declared.items()}
    if names is None:
        return declared
    builtin = BUILTIN if limit is None else dataclasses.replace(BUILTIN, limit=limit)
    unknown = [n for n in names if n not in declared and n != "builtin"]
    if unknown:
        known = ", ".join(sorted({*declared, "builtin"}))
        raise RunnerError(f"no task {', '.join(unknown)} in the eval recipe (known: {known})", key="--tasks")
    return {n: declared.get(n, builtin) for n in names}


def prepare(exp: Experiment, specs: dict[str, DownstreamTask]) -> Prepared:
    """Load and encode every task (a refused request is a RunnerError naming its task file)."""
    cfg = exp.config
    tokenizer = load_tokenizer(exp.resolve_path(cfg.tokenizer.path), cfg.tokenizer.sha256)
    encoder = Encoder(tokenizer, cfg.train.seq_len)
    tasks = tuple(load_task(name, spec, exp.project_root) for name, spec in sorted(specs.items()))
    encoded = tuple(tuple(encoder.encode_task(t)) for t in tasks)
    return Prepared(tasks, encoded, encoder.prefix, cfg.train.seq_len, cfg.eval.aggregate)


def convention(task: Task, prepared: Prepared, metric: str, dtype: str) -> dict:
    """The record a figure carries (SPEC "Record"): two figures compare only when these are equal."""
    return {
        "task_sha256": task.sha256,
        "config_sha256": task.config_sha256,
        "format": task.format,
        "metric": metric,
        "limit": task.limit,
        "seed": task.seed,
        "shots": "as rendered",
        "empty_context_prefix": prepared.prefix,
        "delimiter": task.delimiter if task.format in ("mc", "schema") else "as rendered",
        "seq_len": prepared.seq_len,
        "dtype": dtype,
        "random_baseline": task.random_baseline,
    }


@dataclass
class Scored:
    rows: list[dict]  #: one per task and reported metric, plus the aggregate
    requests: list[dict]  #: one per request: task, doc_id, choice, gold, ll, tokens
    t_eval_seconds: float
    forwards: int


def score(
    model,
    prepared: Prepared,
    *,
    step: int,
    exposure_tokens: int,
    micro_batch: int,
    dtype: str,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world: int = 1,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Scored:
    """Every task's requests in one batched pass; the rows and the per-request log-likelihoods."""
    t0 = time.perf_counter()
    flat = [e for enc in prepared.encoded for e in enc]
    lls, forwards = loglikelihoods(
        model,
        flat,
        micro_batch,
        device=device,
        rank=rank,
        world=world,
        autocast=autocast,
        all_reduce=all_reduce,
    )
    t_eval = time.perf_counter() - t0
    rows, requests, per_task, pos = [], [], {}, 0
    for task, enc in zip(prepared.tasks, prepared.encoded):
        mine, tokens = lls[pos : pos + len(enc)], [len(e.targets) for e in enc]
        pos += len(enc)
        values = per_task[task.name] = task_metrics(task, mine, tokens)
        stamp = {"step": step, "exposure_tokens": exposure_tokens, "task": task.name}
        for metric in task.metrics:
            record = canonical_json(convention(task, prepared, metric, dtype))
            baseline = None if metric == "bpb" else random_baseline(task)  # an accuracy's: bpb has none
            rows.append(_row(stamp, metric, values[metric], len(task.documents), baseline, record, t_eval))
        requests += _request_records(task, mine, tokens)
    overall = aggregate(prepared.tasks, per_task, prepared.aggregate)
    if overall is not None:
        stamp = {"step": step, "exposure_tokens": exposure_tokens, "task": "aggregate"}
        record = _aggregate_record(prepared, dtype)
        documents = sum(len(t.documents) for t in prepared.tasks)
        rows.append(_row(stamp, prepared.aggregate, overall, documents, 0.0, record, t_eval))
    return Scored(rows, requests, t_eval, forwards)


def _aggregate_record(prepared: Prepared, dtype: str) -> str:
    """The aggregate's record: its rule, the metric it averages of each task, and each task's own
    record for that metric (task file, limit, seed, ...): two aggregates over different subsets,
    or differently pinned tasks, are never the same figure."""
    chosen = aggregate_metrics(prepared.tasks)
    by_name = {t.name: t for t in prepared.tasks}
    parts = {name: convention(by_name[name], prepared, m, dtype) for name, m in chosen.items()}
    return canonical_json({"tasks": chosen, "rule": prepared.aggregate, "task_records": parts})


def _row(
    stamp: dict, metric: str, value: float, documents: int, baseline: float | None, record: str, t_eval: float
) -> dict:
    return {
        **stamp,
        "metric": metric,
        "value": value,
        "documents": documents,
        "random_baseline": baseline,
        "convention": record,
        "t_eval_seconds": t_eval,
    }


def _request_records(task: Task, lls: list[float], tokens: list[int]) -> list[dict]:
    """Per request what the audit needs to recompute every metric without the task file."""
    out = []
    for (i, j, r), ll, n in zip(task.requests, lls, tokens):
        doc, cont = task.documents[i], r.continuation
        out.append(
            {
                "task": task.name,
                "doc_id": doc.doc_id,
                "choice": j,
                "choices": doc.choices,
                "gold": doc.gold,
                "ll": ll,
                "tokens": n,
                "chars": len(cont),  # the continuation as given (acc_per_char)
                "choice_chars": len(cont[1:] if cont.startswith(" ") else cont),  # acc_norm's
                "bytes": len(cont.encode("utf-8")),  # bpb's
            }
        )
    return out


def write_requests(path: Path, scored: Scored, step: int) -> Path:
    """Per-request log-likelihoods as gzip jsonl (written whole, then renamed): the audit's evidence."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for r in scored.requests:
            f.write(json.dumps({"step": step, **r}) + "\n")
    tmp.replace(path)
    return path


def requests_name(step: int, source: str) -> str:
    return f"requests-{source}-step-{step:07d}.jsonl.gz"
