"""`runner eval RUN_OR_CHECKPOINT [--tasks ...]`: a checkpoint's downstream tasks scored after the fact.

Owns: finding the checkpoint (a checkpoint folder, or a run folder's newest one that verifies),
loading its weights into the model experiment.yaml describes (safetensors, verified against its
own sha256s), scoring the tasks in fp32 in this process, and appending the result to the run's
record as files of its own: `downstream/eval-step-NNNNNNN.json` (the rows, the checkpoint, its
fingerprint, t_eval) and `downstream/requests-eval-step-NNNNNNN.jsonl.gz` (per-request `ll`); a
later scoring of the same step is `eval-step-NNNNNNN-2.json` and so on (nothing is overwritten).
Never: touches run.json, the ledger, the metrics files or any checkpoint (the training lineage).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from runner.errors import RunnerError
from runner.fsio import atomic_write_json, read_json
from runner.runs.checkpoints import verify
from runner.runs.folder import experiment_of_run, is_run_dir, not_a_run_dir
from runner.training.checkpoint import Checkpoint
from runner.training.downstream.run import prepare, requests_name, score, task_specs, write_requests
from runner.training.model import build_model


def find_checkpoint(target: Path) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) of a checkpoint folder or a run folder (its newest valid one)."""
    target = Path(target)
    if (target / "state.json").is_file() and target.parent.name == "checkpoints":
        problem = verify(target)
        if problem is not None:
            raise RunnerError(f"checkpoint does not verify: {problem}", file=str(target))
        return target.parents[1], target
    if not is_run_dir(target):
        raise not_a_run_dir(target, "neither a run folder (run.json, experiment.yaml) nor a checkpoint folder")
    found = sorted((target / "checkpoints").glob("step-*"), reverse=True)
    for path in found:
        if path.name.removeprefix("step-").isdigit() and verify(path) is None:
            return target, path
    raise RunnerError("no checkpoint that verifies", file=str(target / "checkpoints"))


def _claim_stem(out: Path, step: int) -> str:
    """`step-NNNNNNN`, or `step-NNNNNNN-K` with the first K >= 2 not yet used at that step, held by an
    exclusive `.eval-STEM.claim` until its record is written (`_release`): two `runner eval` of one step at
    once found the same stem free, and the later record replaced the earlier (its requests file too)."""
    out.mkdir(parents=True, exist_ok=True)
    k = 1
    while True:
        stem = f"step-{step:07d}" + (f"-{k}" if k > 1 else "")
        claim = out / f".eval-{stem}.claim"
        if not (out / f"eval-{stem}.json").exists():
            try:
                claim.open("x").close()
            except FileExistsError:
                pass  # another scoring is writing this one
            else:
                if not (out / f"eval-{stem}.json").exists():  # written, and its claim released, meanwhile
                    return stem
                claim.unlink()
        k += 1


def _release(out: Path, stem: str) -> None:
    (out / f".eval-{stem}.claim").unlink(missing_ok=True)


def run_eval(
    target: Path,
    names: list[str] | None = None,
    micro_batch: int | None = None,
    limit: int | None = None,
    say: Callable = print,
) -> Path:
    """Score the checkpoint; writes the record `downstream/eval-step-NNNNNNN.json` and returns its path."""
    if micro_batch is not None and micro_batch < 1:
        raise RunnerError(f"must be >= 1, got {micro_batch}", key="--micro-batch")
    run_dir, path = find_checkpoint(target)
    exp = experiment_of_run(run_dir)
    specs = task_specs(exp, names, limit)
    if not specs:
        raise RunnerError(
            "the eval recipe names no downstream task: give --tasks builtin, or list tasks under eval.tasks",
            file=str(run_dir / "experiment.yaml"),
            key="eval.tasks",
        )
    prepared = prepare(exp, specs)
    state = read_json(path / "state.json")
    step = int(state["step"])
    ckpt = Checkpoint(path=path, step=step, state=state)
    model = build_model(exp.config)
    model.load_state_dict(ckpt.model_state(), strict=True)
    ledger = ckpt.ledger_state()
    exposure = int(np.asarray(ledger["exposure.total"])[0]) if "exposure.total" in ledger else 0
    useful = int(np.asarray(ledger["useful.total"])[0]) if "useful.total" in ledger else None
    n = sum(len(e) for e in prepared.encoded)
    say(f"eval: {len(prepared.tasks)} task(s), {n} requests, checkpoint {path.name}")
    scored = score(
        model,
        prepared,
        step=step,
        exposure_tokens=exposure,
        micro_batch=micro_batch or exp.config.eval.downstream_micro_batch,
        dtype="float32",
    )
    out = run_dir / "downstream"
    stem = _claim_stem(out, step)
    try:
        requests = write_requests(out / requests_name(step, "eval").replace(f"step-{step:07d}", stem), scored, step)
        record = {
            "source": "runner eval",
            "checkpoint": path.name,
            "step": step,
            "fingerprint": state.get("fingerprint"),
            "t_eval_seconds": scored.t_eval_seconds,
            "forwards": scored.forwards,
            "requests_file": requests.name,
            # the checkpoint's useful tokens; no wall time: scored after the fact, never part of the run's
            "rows": [{**r, "useful_tokens": useful} for r in scored.rows] if useful is not None else scored.rows,
        }
        written = out / f"eval-{stem}.json"
        atomic_write_json(written, record)
    finally:
        _release(out, stem)
    for r in scored.rows:
        say(f"  {r['task']:<24} {r['metric']:<18} {r['value']:.4f}  ({r['documents']} documents)")
    say(f"  t_eval {scored.t_eval_seconds:.2f} s in {scored.forwards} forwards; written to {out}")
    return written
