"""`runner audit --recompute-eval`: the final validation loss recomputed from the final checkpoint.

Owns: loading the checkpoint written at the run's last committed step (safetensors, verified
against its own sha256s, no unpickling) into the model experiment.yaml describes, scoring the
pinned validation samples with the trainer's own evaluation (runner.training.evaluate: the same
windows of each domain's validation pool, the same arithmetic) in this process, on the CPU, and
comparing with the report's last evaluation. No edit of a table survives it; what it cannot do
without the checkpoint and the validation shards on this machine is UNVERIFIED, saying which.
Never: writes anything, trains, or changes the checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runner.config.load import experiment_from_dict, find_project_root
from runner.errors import RunnerError
from runner.reports.audit import evidence as ev
from runner.reports.audit.result import AuditResult
from runner.runs.checkpoints import MARKER, dirname, verified_state
from runner.training.batches import load_data
from runner.training.checkpoint import Checkpoint
from runner.training.evaluate import evaluate
from runner.training.model import build_model
from runner.training.schedule import make_optimizer

if TYPE_CHECKING:
    from runner.reports.audit.input import AuditInput

NAME = "validation loss recomputed from the final checkpoint"
# fp32 on CPU repeats the trainer's kernels up to summation order; a bf16 run (autocast on its GPU)
# recomputed under CPU bf16 autocast differs by rounding. A forged loss is off by far more.
REL_TOL = {"fp32": 1e-4, "bf16": 2e-2}


class _LocalAccelerator:
    """The parts of an accelerate.Accelerator that runner.training.evaluate uses: one CPU process."""

    process_index, num_processes = 0, 1

    def __init__(self, precision: str):
        self.device = torch.device("cpu")
        self._bf16 = precision == "bf16"

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self._bf16 else contextlib.nullcontext()


def _project_root(inp: AuditInput) -> Path:
    """Where the experiment's relative data and tokenizer paths start: run.json's project root when it
    is on this machine, else the checkout around the current folder."""
    recorded = inp.record.project_root
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    return find_project_root(Path.cwd())


def _checkpoint_dir(inp: AuditInput, checkpoint: Path | None) -> Path | None:
    if checkpoint is not None:
        return checkpoint
    if inp.run_dir is not None:
        return inp.run_dir / "checkpoints" / dirname(inp.steps())
    return None


def _recompute(inp: AuditInput, path: Path, state: dict, progress: Callable[[str], None]) -> list[dict]:
    """Per-domain rows {domain, loss_nats, bpb} of the checkpoint at `path` on the pinned samples."""
    exp = experiment_from_dict(inp.cfg, project_root=_project_root(inp), path=inp.cfg_file)
    cfg = exp.config
    data = load_data(exp, cfg.train.seq_len)
    progress(f"recompute-eval: scoring {sum(data.val_samples.values())} validation samples of {path.name}")
    model = build_model(cfg)
    # load_into is the trainer's own path (tied weights, formats 1 and 2); it also restores the optimizer.
    Checkpoint(path=path, step=int(state["step"]), state=state).load_into(
        model, make_optimizer(model, cfg, fused=False)
    )
    return evaluate(
        model,
        data,
        _LocalAccelerator(str(cfg.hardware.precision)),
        cfg.eval.micro_batch_sequences,
        int(state["step"]),
        0,
    )


def check_recomputed_eval(
    res: AuditResult, inp: AuditInput, *, checkpoint: Path | None = None, progress: Callable[[str], None] | None = None
) -> None:
    progress = progress or (lambda message: None)
    path = _checkpoint_dir(inp, checkpoint)
    if path is None:
        res.could_not(
            NAME, "no checkpoint: a report folder carries none; give --checkpoint RUN_DIR/checkpoints/step-NNNNNNN"
        )
        return
    if not path.is_dir():
        res.could_not(NAME, f"no checkpoint at {path}")
        return
    if checkpoint is not None and not any((path / name).exists() for name in ("state.json", MARKER)):
        # the folder the auditor named is no checkpoint at all (the run folder, an empty one): nothing the
        # report states is contradicted, the check could not run (a run's own checkpoint missing its files FAILs)
        res.could_not(NAME, f"{path} is not a checkpoint folder (no state.json, no {MARKER})")
        return
    state, problem = verified_state(path)
    if state is None:
        res.add(NAME, [str(problem)])
        return
    final = ev.final_validation(inp.tables["validation"])
    if not final:
        res.could_not(NAME, "the report holds no evaluation to compare with")
        return
    if int(state["step"]) != final["step"]:
        res.could_not(
            NAME, f"{path.name} is at step {state['step']}, the report's last evaluation at step {final['step']}"
        )
        return
    if state.get("fingerprint") != inp.exp.fingerprint:
        res.add(
            NAME, [f"{path.name} was written under fingerprint {str(state.get('fingerprint'))[:12]}, not this report's"]
        )
        return
    try:
        rows = _recompute(inp, path, state, progress)
    except RunnerError as err:
        res.could_not(NAME, f"the validation data or tokenizer is not usable here: {err}")
        return
    tol = REL_TOL.get(str(inp.config.hardware.precision), REL_TOL["bf16"])
    problems = []
    got = {r["domain"]: r for r in rows}
    for d in sorted(set(got) | set(final["domains"])):
        if d not in got or d not in final["domains"]:
            problems.append(f"{d}: {'recomputed' if d in got else 'reported'} only")
            continue
        for kind in ("loss_nats", "bpb"):
            a, b = got[d][kind], final["domains"][d][kind]
            if not math.isclose(a, b, rel_tol=tol):
                problems.append(f"{d}.{kind}: report {b:.6g}, recomputed {a:.6g}")
    detail = ", ".join(f"{d} {got[d]['loss_nats']:.4f}" for d in sorted(got))
    res.add(NAME, problems, ok_detail=f"{path.name}: {detail} nats (within {tol:g} relative)")
