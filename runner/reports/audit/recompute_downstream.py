"""`runner audit --recompute-eval`, downstream half: every scoring of the run, the loop's and
`runner eval`'s, rescored from the checkpoint it scored, request by request.

Owns: for every loop scoring (metrics/downstream.jsonl, downstream/requests-loop-step-N.jsonl.gz)
and every `runner eval` scoring (downstream/eval-step-N*.json and the requests-eval file it names)
whose checkpoint is still in the run folder and verifies, loading those weights (safetensors, no
unpickling) into the model experiment.yaml describes, scoring in fp32 on this CPU with the loop's
own code (runner.training.downstream.run) the tasks that scoring scored (the loop: the eval
recipe's; runner eval: the tasks its record names, each at the limit its convention records), and
comparing every request record whole: the same requests, each with the same gold, number of
choices, token and character counts, and a log-likelihood within 1e-4 + 1e-6 x |ll| (SPEC
"Downstream evaluation") for a scoring in fp32, within 2e-2 relative for one under bf16 autocast;
and every figure's convention record (its dtype aside). Scorings whose checkpoint was pruned are
named, not failed; a damaged request file is a failure. Never writes anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.config.eval_recipe import DownstreamTask
from runner.config.load import experiment_from_dict
from runner.errors import RunnerError
from runner.fsio import read_json
from runner.reports.audit.downstream import REQUEST_INTS, convention_record, read_requests
from runner.reports.audit.recompute_eval import _project_root
from runner.reports.audit.result import AuditResult
from runner.reports.downstream.table import loop_rows, read_eval_record
from runner.runs.checkpoints import dirname, verify
from runner.training.checkpoint import Checkpoint
from runner.training.downstream.run import BUILTIN, Prepared, prepare, score, task_specs
from runner.training.model import build_model

if TYPE_CHECKING:
    from runner.reports.audit.input import AuditInput

NAME = "downstream log-likelihoods rescored from the checkpoints"
SHOWN = 3  #: requests named per scoring; the rest are counted

Key = tuple[str, int, int]  #: (task, doc_id, choice)


@dataclass(frozen=True)
class Scoring:
    """One scoring the run records: where it is said, the checkpoint it scored, its files."""

    where: str  #: `step N` (the loop) or `runner eval step N (eval-step-N.json)`
    label: str  #: how the check's detail names it
    step: int
    checkpoint: Path
    requests: Path
    rows: list[dict]
    source: str  #: loop | runner eval
    bf16: bool  #: scored under bf16 autocast (the loop on a bf16 run)


def _eval_specs(exp, rows: list[dict]) -> dict[str, DownstreamTask]:
    """The tasks a `runner eval` scoring scored: those its rows name, each at the limit its
    convention records (runner eval --limit replaces every task's own)."""
    declared = task_specs(exp)
    specs = {}
    for r in rows:
        name = r["task"]
        if name == "aggregate" or name in specs:
            continue
        base = declared.get(name, BUILTIN if name == "builtin" else None)
        if base is None:
            raise RunnerError(f"task {name} is not a task of the run's eval recipe")
        limit = convention_record(r).get("limit")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RunnerError(f"task {name}: the convention's limit {limit!r} is not a document count")
        specs[name] = dataclasses.replace(base, limit=limit)
    return specs


def scorings(run_dir: Path) -> list[Scoring]:
    """The loop's scorings (its latest rows of each step) and `runner eval`'s, in that order."""
    loop_file = run_dir / "metrics/downstream.jsonl"
    latest = {(r["step"], r["task"], r["metric"]): r for r in (loop_rows(loop_file) if loop_file.exists() else [])}
    by_step: dict[int, list[dict]] = {}
    for (step, _, _), r in sorted(latest.items()):
        by_step.setdefault(step, []).append(r)
    out = []
    for step, rows in by_step.items():
        bf16 = any("bfloat16" in str(convention_record(r).get("dtype")) for r in rows if r["task"] != "aggregate")
        requests = run_dir / "downstream" / f"requests-loop-step-{step:07d}.jsonl.gz"
        ckpt = run_dir / "checkpoints" / dirname(step)
        out.append(Scoring(f"step {step}", f"loop step {step}", step, ckpt, requests, rows, "loop", bf16))
    for path in sorted((run_dir / "downstream").glob("eval-step-*.json")):
        record = read_eval_record(path)
        step, rows = record["step"], record["rows"]
        where = f"runner eval step {step} ({path.name})"
        ckpt, requests = run_dir / "checkpoints" / record["checkpoint"], path.parent / record["requests_file"]
        out.append(Scoring(where, f"runner eval {path.name}", step, ckpt, requests, rows, "runner eval", False))
    return out


def _close(a: float, b: float, bf16: bool) -> bool:
    return math.isclose(a, b, rel_tol=2e-2) if bf16 else abs(a - b) <= 1e-4 + 1e-6 * abs(b)


def _keyed(records: list[dict]) -> dict[Key, dict]:
    return {(str(r["task"]), int(r["doc_id"]), int(r["choice"])): r for r in records}


def _without_dtype(record: Any) -> Any:
    """A convention record less its dtype (the loop may score under bf16 autocast, the audit in fp32)."""
    if isinstance(record, dict):
        return {k: _without_dtype(v) for k, v in record.items() if k != "dtype"}
    return record


def request_problems(where: str, want: list[dict], got: list[dict], bf16: bool) -> list[str]:
    """Where the recorded request records differ from the rescored ones: a request one side lacks,
    a field (gold, choices, tokens, characters, bytes) unequal, an ll beyond the tolerance."""
    w, g = _keyed(want), _keyed(got)
    if w.keys() != g.keys():
        extra, lacking = sorted(w.keys() - g.keys()), sorted(g.keys() - w.keys())
        first = (
            f"{extra[0][0]} document {extra[0][1]} choice {extra[0][2]} is recorded, not rescored"
            if extra
            else f"{lacking[0][0]} document {lacking[0][1]} choice {lacking[0][2]} is rescored, not recorded"
        )
        return [f"{where}: {len(w)} requests recorded, {len(g)} rescored (the tasks differ: {first})"]
    off = []
    for key in sorted(w):
        a, b = w[key], g[key]
        fields = [f for f in REQUEST_INTS if a[f] != b[f]]
        if fields:
            f = fields[0]
            off.append(f"{key[0]} document {key[1]} choice {key[2]}: recorded {f} {a[f]!r}, rescored {b[f]!r}")
        elif not _close(float(b["ll"]), float(a["ll"]), bf16):
            off.append(f"{key[0]} document {key[1]} choice {key[2]}: recorded ll {a['ll']:.6g}, rescored {b['ll']:.6g}")
    out = [f"{where}: {line}" for line in off[:SHOWN]]
    return out + ([f"{where}: {len(off) - SHOWN} more requests off"] if len(off) > SHOWN else [])


def convention_problems(where: str, want: list[dict], got: list[dict]) -> list[str]:
    """Figures the recorded rows and the rescoring's disagree on: one lacking, or a convention key."""
    w = {(r["task"], r["metric"]): _without_dtype(convention_record(r)) for r in want}
    g = {(r["task"], r["metric"]): _without_dtype(json.loads(r["convention"])) for r in got}
    if w.keys() != g.keys():
        return [f"{where}: figures {sorted(w.keys() ^ g.keys())} are in one of the record and the rescoring only"]
    out = []
    for key in sorted(w):
        if w[key] != g[key]:
            k = next(k for k in sorted(set(w[key]) | set(g[key])) if w[key].get(k) != g[key].get(k))
            out.append(
                f"{where}: {key[0]}.{key[1]}: convention {k} recorded {w[key].get(k)!r}, rescored {g[key].get(k)!r}"
            )
    return out


class _Rescorer:
    """Each checkpoint's model and each task set's preparation made once (a step the loop and
    runner eval both scored loads one model)."""

    def __init__(self, exp) -> None:
        self.exp = exp
        self._models: dict[Path, tuple[Any, int]] = {}
        self._prepared: dict[str, Prepared] = {}

    def prepared(self, specs: dict[str, DownstreamTask]) -> Prepared:
        key = repr(sorted(specs.items()))
        if key not in self._prepared:
            self._prepared[key] = prepare(self.exp, specs)
        return self._prepared[key]

    def model(self, path: Path):
        if path not in self._models:
            state = read_json(path / "state.json")
            ckpt = Checkpoint(path=path, step=int(state["step"]), state=state)
            model = build_model(self.exp.config)
            model.load_state_dict(ckpt.model_state(), strict=True)
            self._models = {path: (model, ckpt.step)}  # one model held at a time
        return self._models[path]

    def rescore(self, s: Scoring, specs: dict[str, DownstreamTask]):
        prepared = self.prepared(specs)  # first: a task file not usable here costs no model load
        model, step = self.model(s.checkpoint)
        return score(model, prepared, step=step, exposure_tokens=0, micro_batch=16, dtype="float32")


def check_recomputed_downstream(
    res: AuditResult, inp: AuditInput, progress: Callable[[str], None] | None = None
) -> set[int]:
    """Adds NAME (nothing for a run that scored no task). Returns the steps of the `runner eval`
    scorings rescored (their figures need no other voucher; a failed rescoring is a FAIL here)."""
    progress = progress or (lambda message: None)
    if inp.run_dir is None:
        if "downstream" in inp.tables and len(inp.tables["downstream"]):
            res.could_not(NAME, "a report folder carries no checkpoint or per-request file: audit the run folder")
        return set()
    try:
        found = scorings(inp.run_dir)
    except RunnerError as err:
        res.add(NAME, [str(err)])
        return set()
    if not found:
        return set()
    exp = experiment_from_dict(inp.cfg, project_root=_project_root(inp), path=inp.cfg_file)
    rescorer = _Rescorer(exp)
    problems: list[str] = []
    rescored: list[Scoring] = []
    pruned: list[Scoring] = []
    for s in found:
        if not s.checkpoint.is_dir() or verify(s.checkpoint) is not None or not s.requests.is_file():
            pruned.append(s)
            continue
        progress(f"recompute-eval: rescoring the downstream tasks of {s.label} at {s.checkpoint.name}")
        try:
            want = read_requests(s.requests)
        except RunnerError as err:  # a damaged evidence file is a failed check
            problems.append(f"{s.where}: {err}")
            rescored.append(s)
            continue
        try:
            specs = task_specs(exp) if s.source == "loop" else _eval_specs(exp, s.rows)
        except RunnerError as err:  # the record names what the run's recipe cannot have scored
            problems.append(f"{s.where}: not a scoring of the run's tasks: {err}")
            rescored.append(s)
            continue
        try:
            got = rescorer.rescore(s, specs)
        except RunnerError as err:
            res.could_not(NAME, f"the task files or tokenizer are not usable here: {err}")
            return set()
        problems += request_problems(s.where, want, got.requests, s.bf16)
        problems += convention_problems(s.where, s.rows, got.rows)
        rescored.append(s)
    if not rescored:
        steps = ", ".join(map(str, sorted({s.step for s in found})))
        res.could_not(NAME, f"no checkpoint that verifies at a scored step ({steps})")
        return set()
    tol = "1e-4 + 1e-6 |ll|" + (" (2e-2 relative: bf16 autocast)" if any(s.bf16 for s in rescored) else "")
    loop = [str(s.step) for s in rescored if s.source == "loop"]
    evals = [s.label.removeprefix("runner eval ") for s in rescored if s.source != "loop"]
    what = "; ".join(
        ([f"loop steps {', '.join(loop)}"] if loop else []) + ([f"runner eval {', '.join(evals)}"] if evals else [])
    )
    detail = f"{what}: every request record equal (gold, choices, tokens, characters), ll within {tol}"
    if pruned:
        detail += f"; no checkpoint for {', '.join(s.label for s in pruned)}"
    res.add(NAME, problems, ok_detail=detail)
    return {s.step for s in rescored if s.source != "loop"}
