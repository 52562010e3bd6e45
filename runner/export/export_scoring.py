"""The exported folder's own downstream figures, scored at export time in the folder's dtype.

Owns: scoring the eval recipe's tasks on the folder `runner export` just wrote, loaded by
transformers alone (`AutoModelForCausalLM`) in the dtype its weights were saved in (bf16 by default,
where the run's figures were scored in fp32 or under bf16 autocast: the numbers a user of the folder
gets from lm-evaluation-harness at that dtype, SPEC "Export"), with the runner's downstream scoring
(the same requests, metrics and records as the run's); accounting.json's `downstream.export_scoring`
({dtype, step, t_eval_seconds, figures}) and the card's table that sets each of these beside the
run's figure of the same task and metric at that step, each with its dtype. Never scores a run
without tasks, and never writes outside the folder it is given.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from runner.export import folder as folder_mod
from runner.export.source import Source

#: a figure of the folder's own scoring equals a rescoring's within this (bf16 kernels may reorder sums)
RESCORE_ATOL = 1e-6


def score_folder(src: Source, path: Path, dtype: str) -> dict | None:
    """{dtype, step, t_eval_seconds, figures: [{task, metric, value, documents}]} of the folder at
    `path`, or None when the run declares no task."""
    if not src.exp.config.eval.tasks:
        return None
    from transformers import AutoModelForCausalLM  # noqa: PLC0415  (seconds to import)

    from runner.training.downstream.run import prepare, score, task_specs  # noqa: PLC0415  (imports torch)

    torch_dtype = folder_mod.DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    prepared = prepare(src.exp, task_specs(src.exp))
    exposure = int(src.checkpoint.ledger_state()["exposure.total"][0])
    scored = score(
        model,
        prepared,
        step=src.step,
        exposure_tokens=exposure,
        micro_batch=src.exp.config.eval.downstream_micro_batch,
        dtype=folder_mod.DTYPE_NAMES[dtype],
    )
    figures = [
        {"task": r["task"], "metric": r["metric"], "value": float(r["value"]), "documents": int(r["documents"])}
        for r in scored.rows
    ]
    return {
        "dtype": folder_mod.DTYPE_NAMES[dtype],
        "step": src.step,
        "t_eval_seconds": scored.t_eval_seconds,
        "figures": figures,
    }


def agrees(claimed: dict | None, rescored: dict | None) -> bool:
    """A card's export scoring and a rescoring of the same folder state the same figures."""
    if claimed is None or rescored is None:
        return claimed is rescored
    if claimed.get("dtype") != rescored["dtype"] or claimed.get("step") != rescored["step"]:
        return False
    want = {(f["task"], f["metric"]): f for f in rescored["figures"]}
    got = {(f.get("task"), f.get("metric")): f for f in claimed.get("figures") or []}
    return set(got) == set(want) and all(
        got[k].get("documents") == want[k]["documents"]
        and isinstance(got[k].get("value"), (int, float))
        and math.isclose(float(got[k]["value"]), want[k]["value"], rel_tol=0.0, abs_tol=RESCORE_ATOL)
        for k in want
    )


def _cell(x: Any) -> str:
    return "" if x is None else f"{round(float(x), 12) + 0.0:.6g}"


def markdown(downstream: dict | None) -> list[str]:
    """The card's table of the folder's own figures beside the run's ([] without an export scoring)."""
    scoring = (downstream or {}).get("export_scoring")
    if not scoring or downstream is None:
        return []
    run: dict[tuple[str, str], tuple[float, str]] = {}
    for f in downstream.get("figures") or []:
        dtype = (f.get("convention") or {}).get("dtype") or "?"
        run.setdefault((f["task"], f["metric"]), (f["value"], f"{f['source']}, {dtype}"))
    lines = [
        f"## Downstream tasks scored on this folder ({scoring['dtype']}, at export)",
        "",
        f"The same tasks scored on the exported weights, loaded by transformers in {scoring['dtype']} (what "
        "lm-evaluation-harness gives at that dtype), beside the run's figure at this step with its dtype.",
        "",
        f"| task | metric | this folder ({scoring['dtype']}) | the run's | the run's scored as |",
        "|---|---|---|---|---|",
    ]
    for f in scoring["figures"]:
        value, how = run.get((f["task"], f["metric"]), (None, "not scored at this step"))
        lines.append(f"| {f['task']} | {f['metric']} | {_cell(f['value'])} | {_cell(value)} | {how} |")
    return [*lines, ""]


def canonical(scoring: dict | None) -> str:
    return json.dumps(scoring, sort_keys=True)
