"""metrics/routing.jsonl: a mixture-of-experts run's routing, step by step, and the balancing bias replay.

Owns: the file's format (one line per committed step: the step, each MoE layer's per-expert load
summed over micro batches, ranks and domains, and each learned router's balancing bias after that
step's update, float32 values written exactly; a hash-routed layer's bias is null), its reader
(the lineage: a step redone after a resume is written again and the later line counts), and
`next_bias`, the numpy twin of the trainer's update (runner.training.moe.ds_routers.update_bias):
`b_i += rate * sign(mean(load) - load_i)`, the sign taken on integers (sum - E x load_i) and each
step adding exactly +-rate or 0 in float32, so a replay equals the trainer's bias bit for bit.
Numpy only, so reports and the audit read it without torch. Never: writes the file (the trainer's
runner.training.moe.balancing does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl
from runner.runs.recorded import number, whole

FILE = "metrics/routing.jsonl"
FORMAT = "runner-routing/1"
#: the report folder's copy of the last line's biases (small, unlike the record: a run's report carries it)
FINAL_BIAS_FILE = "final_bias.json"
FINAL_BIAS_FORMAT = "runner-final-bias/1"


def next_bias(bias: np.ndarray, load: np.ndarray, rate: float) -> np.ndarray:
    """The bias after one step's update from that step's `load` [..., E] (float32, as the trainer)."""
    load = np.asarray(load, dtype=np.int64)
    direction = np.sign(load.sum(axis=-1, keepdims=True) - load.shape[-1] * load).astype(np.float32)
    return (np.asarray(bias, dtype=np.float32) + direction * np.float32(rate)).astype(np.float32)


def read_routing(run_dir: str | Path, committed_steps: int) -> dict[int, dict[str, Any]]:
    """step -> its line, for steps 1..committed_steps of the run's lineage; {} when there is no file."""
    path = Path(run_dir) / FILE
    rows: dict[int, dict[str, Any]] = {}
    for n, row in enumerate(read_jsonl(path, skip_torn=True), 1):
        problem = _shape_problem(row)
        if problem:
            raise RunnerError(f"line {n}: not a routing record line: {problem}", file=str(path))
        if 1 <= row["step"] <= committed_steps:
            rows[row["step"]] = row
    return rows


def _count(x: Any) -> bool:
    return whole(x) and x < 2**62  # a load summed in int64


def _float32(x: Any) -> bool:
    """A bias value as the trainer writes it: a float32, so finite and within float32's range."""
    return number(x) and abs(x) <= float(np.finfo(np.float32).max)


def _shape_problem(row: Any) -> str | None:
    """What is wrong with a line, as the trainer writes them (None if nothing): a line edited or damaged
    was a traceback in the report, or "unusable report" in the audit, wherever its arrays were read."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not a JSON object"
    if row.get("format") != FORMAT:
        return f"format {row.get('format')!r}, expected {FORMAT}"
    if not whole(row.get("step")):
        return f"step {json.dumps(row.get('step'))[:40]} is not a whole number >= 0"
    load, bias = row.get("load"), row.get("bias")
    if (
        not isinstance(load, list)
        or not load
        or not all(isinstance(x, list) and x and all(map(_count, x)) for x in load)
    ):
        return "load must be one list per MoE layer of each expert's load (whole numbers)"
    experts = len(load[0])
    if any(len(x) != experts for x in load):
        return f"load's layers hold {sorted({len(x) for x in load})} experts, not one count"
    if not isinstance(bias, list) or len(bias) != len(load):
        return f"bias must be one entry per MoE layer ({len(load)})"
    if not all(b is None or (isinstance(b, list) and len(b) == experts and all(map(_float32, b))) for b in bias):
        return f"bias must be null or {experts} float32 values per layer"
    return None


def bias_matrix(row: dict[str, Any]) -> list[np.ndarray | None]:
    """A line's biases as float32 vectors (None for a layer without one)."""
    return [None if b is None else np.asarray(b, dtype=np.float32) for b in row["bias"]]


def final_bias_of(run_dir: str | Path, committed_steps: int, first_dense_layers: int) -> dict[str, Any] | None:
    """The balancing bias after the last committed step, as report/final_bias.json holds it: the step,
    and model layer index (as a string) -> its float32 vector (only layers with a learned bias); None
    when the run has no routing record, no line for that step, or no layer with a bias."""
    last = read_routing(run_dir, committed_steps).get(committed_steps)
    if last is None:
        return None
    layers = {
        str(first_dense_layers + i): [float(x) for x in b] for i, b in enumerate(bias_matrix(last)) if b is not None
    }
    if not layers:
        return None
    return {"format": FINAL_BIAS_FORMAT, "step": committed_steps, "source": FILE, "layers": layers}


def read_final_bias(report_dir: str | Path) -> dict[str, Any] | None:
    """report/final_bias.json, or None when the report has none (a dense run, a loss-balanced one, a report
    written before it existed)."""
    path = Path(report_dir) / FINAL_BIAS_FILE
    if not path.exists():
        return None
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FINAL_BIAS_FORMAT or not isinstance(doc.get("layers"), dict):
        raise RunnerError(f"not a final bias record ({FINAL_BIAS_FORMAT})", file=str(path))
    return doc
