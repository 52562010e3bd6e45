"""`runner audit --recompute-eval`, downstream half: the loop's scorings rescored from the
checkpoints the run still holds, request by request.

Owns: for every loop scoring (metrics/downstream.jsonl, downstream/requests-loop-step-N.jsonl.gz)
whose step has a checkpoint that verifies, loading those weights (safetensors, no unpickling) into
the model experiment.yaml describes, scoring the eval recipe's tasks in fp32 on this CPU with the
loop's own code (runner.training.downstream.run) and comparing every request's log-likelihood
with the recorded one: within 1e-4 + 1e-6 x |ll| (SPEC "Downstream evaluation") for a run scored in
fp32, within 2e-2 relative for one scored under bf16 autocast. Steps whose checkpoint was pruned
are named, not failed. Never writes anything.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from runner.config.load import experiment_from_dict
from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl
from runner.reports.audit_eval import _project_root
from runner.reports.audit_result import AuditResult
from runner.training.checkpoint import Checkpoint, dirname, verify
from runner.training.downstream.run import prepare, score, task_specs
from runner.training.model import build_model

if TYPE_CHECKING:
    from runner.reports.audit_input import AuditInput

NAME = "downstream log-likelihoods rescored from the checkpoints"


def _recorded(path: Path) -> dict[tuple[str, int, int], float]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return {(r["task"], int(r["doc_id"]), int(r["choice"])): float(r["ll"]) for r in map(json.loads, f)}


def _close(a: float, b: float, bf16: bool) -> bool:
    return math.isclose(a, b, rel_tol=2e-2) if bf16 else abs(a - b) <= 1e-4 + 1e-6 * abs(b)


def _rescore(exp, path: Path) -> dict[tuple[str, int, int], float]:
    state = read_json(path / "state.json")
    ckpt = Checkpoint(path=path, step=int(state["step"]), state=state)
    model = build_model(exp.config)
    model.load_state_dict(ckpt.model_state(), strict=True)
    prepared = prepare(exp, task_specs(exp))
    scored = score(model, prepared, step=ckpt.step, exposure_tokens=0, micro_batch=16, dtype="float32")
    return {(r["task"], int(r["doc_id"]), int(r["choice"])): float(r["ll"]) for r in scored.requests}


def _step_problems(exp, ckpt: Path, requests: Path, step: int, bf16: bool) -> list[str]:
    want, got = _recorded(requests), _rescore(exp, ckpt)
    if want.keys() != got.keys():
        return [f"step {step}: {len(want)} requests recorded, {len(got)} rescored (the tasks differ)"]
    off = [k for k in sorted(want) if not _close(got[k], want[k], bf16)]
    return [
        f"step {step}: {task} document {doc} choice {choice}: recorded ll {want[(task, doc, choice)]:.6g}, "
        f"rescored {got[(task, doc, choice)]:.6g}"
        for task, doc, choice in off[:3]
    ] + ([f"step {step}: {len(off) - 3} more requests off"] if len(off) > 3 else [])


def check_recomputed_downstream(
    res: AuditResult, inp: AuditInput, progress: Callable[[str], None] | None = None
) -> None:
    """Adds NAME (nothing for a run that scored no task in the loop)."""
    progress = progress or (lambda message: None)
    if inp.run_dir is None:
        if "downstream" in inp.tables and (inp.tables["downstream"]["source"] == "loop").any():
            res.could_not(NAME, "a report folder carries no checkpoint or per-request file: audit the run folder")
        return
    rows = read_jsonl(inp.run_dir / "metrics/downstream.jsonl", skip_torn=True)
    steps = sorted({int(r["step"]) for r in rows})
    if not steps:
        return
    bf16 = any("bfloat16" in str(json.loads(r["convention"]).get("dtype")) for r in rows if r["task"] != "aggregate")
    exp = experiment_from_dict(inp.cfg, project_root=_project_root(inp), path=inp.cfg_file)
    problems, rescored, pruned = [], [], []
    for step in steps:
        ckpt = inp.run_dir / "checkpoints" / dirname(step)
        requests = inp.run_dir / "downstream" / f"requests-loop-step-{step:07d}.jsonl.gz"
        if not ckpt.is_dir() or verify(ckpt) is not None or not requests.is_file():
            pruned.append(step)
            continue
        progress(f"recompute-eval: rescoring the downstream tasks at {ckpt.name}")
        try:
            problems += _step_problems(exp, ckpt, requests, step, bf16)
        except RunnerError as err:
            res.could_not(NAME, f"the task files or tokenizer are not usable here: {err}")
            return
        rescored.append(step)
    if not rescored:
        res.could_not(NAME, f"no checkpoint that verifies at a scored step ({', '.join(map(str, steps))})")
        return
    tol = "2e-2 relative (bf16 autocast)" if bf16 else "1e-4 + 1e-6 |ll|"
    detail = f"steps {', '.join(map(str, rescored))} within {tol}"
    res.add(NAME, problems, ok_detail=detail + (f"; no checkpoint at {', '.join(map(str, pruned))}" if pruned else ""))
