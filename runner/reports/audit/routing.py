"""The audit's checks of a mixture-of-experts run's step-by-step routing (metrics/routing.jsonl).

Owns the named checks `runner audit` adds for the routing record (runner.training.routing_record):
one line per committed step of the lineage, each MoE layer's load summing to the step's positions x
k; the step loads summing to the expert_load table (so a forged step load, or a forged table, FAILs);
the balancing bias of every learned router replayed from the recorded loads (SPEC: `b_i += rate *
sign(mean(load) - load_i)` from zero, float32, bit for bit) against the recorded trajectory, or
zero throughout when the run balances by a loss; and (`checkpoint_bias_problems`) the final bias
against the one the final checkpoint's weights hold.
Never: edits a report, imports torch, or raises for a discrepancy (discrepancies are check results).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runner.planning.flops import is_moe
from runner.training.routing_record import FILE, FINAL_BIAS_FILE, bias_matrix, next_bias, read_final_bias, read_routing

#: how many differing steps a FAIL lists
SHOWN = 4


def _record_path(inp) -> Path | None:
    for folder in (inp.run_dir, inp.report_dir):
        if folder is not None and (Path(folder) / FILE).exists():
            return Path(folder) / FILE
    return None


def check_routing(res, inp) -> None:
    """Add the routing checks of `inp` (runner.reports.audit.input.AuditInput) to `res`."""
    cfg = inp.config
    if not is_moe(cfg) or cfg.model.moe is None:
        return
    moe = cfg.model.moe
    n_layers, n_experts, k = cfg.model.n_layers - moe.first_dense_layers, moe.n_experts, moe.experts_per_token
    path = _record_path(inp)
    name = "routing record: one line per committed step"
    if path is None:
        if moe.balancing == "aux_loss":
            # no bias to replay: the expert_load table stays held by the expert audit (runner.reports.audit.experts)
            res.info(
                name,
                f"no {FILE} next to the report (a run recorded before it existed, or a published copy); "
                "balanced by a loss, so no bias to replay: the expert load table is checked on its own",
            )
        else:
            res.could_not(
                name, f"no {FILE} next to the report: the balancing bias of an aux-free run cannot be replayed"
            )
        return
    steps = inp.steps()
    rows = read_routing(path.parent.parent if path.parent.name == "metrics" else path.parent, steps)
    per_step = cfg.train.global_batch_sequences * cfg.train.seq_len * k
    problems = [f"step {s}: no line" for s in range(1, steps + 1) if s not in rows][:SHOWN]
    loads: dict[int, np.ndarray] = {}
    for s, row in sorted(rows.items()):
        load = np.asarray(row["load"], dtype=np.int64)
        if load.shape != (n_layers, n_experts):
            problems.append(f"step {s}: load of shape {list(load.shape)}, the model routes [{n_layers}, {n_experts}]")
            continue
        bad = [layer for layer in range(n_layers) if int(load[layer].sum()) != per_step]
        if bad:
            problems.append(f"step {s}: layer {bad[0]} routed {int(load[bad[0]].sum())}, positions x k = {per_step}")
        loads[s] = load
    res.add(
        name,
        problems,
        ok_detail=f"{len(rows)} steps x {n_layers} MoE layers x {n_experts} experts, each {per_step:,} routed",
    )
    if problems:
        return

    total = sum(loads.values(), np.zeros((n_layers, n_experts), dtype=np.int64))
    table = inp.tables["expert_load"]
    want = np.zeros((n_layers, n_experts), dtype=np.int64)
    for r in table.itertuples(index=False):
        if 0 <= int(r.layer) < n_layers and 0 <= int(r.expert) < n_experts:
            want[int(r.layer), int(r.expert)] += int(r.routed_tokens)
    diff = np.argwhere(total != want)
    res.add(
        "routing record: step loads sum to the expert load table",
        [
            f"layer {int(layer)} expert {int(e)}: steps sum to {int(total[layer, e])}, expert_load {int(want[layer, e])}"
            for layer, e in diff[:SHOWN]
        ],
        ok_detail=f"{steps} steps summed per layer and expert",
    )

    learned = [i >= moe.hash_layers for i in range(n_layers)]
    aux_free = moe.balancing == "aux_free"
    bias = np.zeros((n_layers, n_experts), dtype=np.float32)
    problems = []
    for s in range(1, steps + 1):
        if aux_free:
            bias = next_bias(bias, loads[s], moe.bias_update_rate)
        recorded = bias_matrix(rows[s])
        for layer in range(n_layers):
            got = recorded[layer] if layer < len(recorded) else None
            has_bias = learned[layer] and moe.router != "softmax"
            if not has_bias:
                if got is not None and np.any(got != 0):
                    problems.append(f"step {s} layer {layer}: a bias recorded where the router has none")
                continue
            if got is None or got.shape != (n_experts,) or not np.array_equal(got, bias[layer]):
                problems.append(
                    f"step {s} layer {layer}: recorded bias {None if got is None else got.tolist()[:3]}..., "
                    f"replayed {bias[layer].tolist()[:3]}..."
                )
        if len(problems) >= SHOWN:
            break
    what = (
        f"b += {moe.bias_update_rate} x sign(mean load - load), from zero, float32, over {steps} steps"
        if aux_free
        else "balancing by a loss: the bias stays zero"
    )
    res.add("balancing bias replayed from the step loads", problems[:SHOWN], ok_detail=what)
    has_bias = [learned[layer] and moe.router != "softmax" for layer in range(n_layers)]
    _check_report_bias(res, inp, bias, has_bias, moe.first_dense_layers, steps)


def _check_report_bias(res, inp, replayed: np.ndarray, has_bias: list[bool], first_dense: int, steps: int) -> None:
    """report/final_bias.json (report.md's bias section) against the bias replayed to the last step."""
    doc = read_final_bias(inp.report_dir) if inp.report_dir is not None else None
    if doc is None:
        return  # a loss-balanced run, or a report written before the file existed: nothing shown to hold
    want = {str(first_dense + layer): replayed[layer] for layer in range(len(has_bias)) if has_bias[layer]}
    problems = [] if doc.get("step") == steps else [f"written for step {doc.get('step')}, the run committed {steps}"]
    for key in sorted(set(want) | set(doc["layers"]), key=int):
        got = doc["layers"].get(key)
        if key not in want:
            problems.append(f"model layer {key}: a bias where the router has none")
        elif got is None or np.asarray(got, dtype=np.float32).shape != want[key].shape:
            problems.append(f"model layer {key}: missing or of the wrong length")
        elif not np.array_equal(np.asarray(got, dtype=np.float32), want[key]):
            problems.append(
                f"model layer {key}: {np.asarray(got, dtype=np.float32).tolist()[:3]}..., replayed {want[key].tolist()[:3]}..."
            )
    res.add(
        f"report's final bias ({FINAL_BIAS_FILE}) equals the replay",
        problems[:SHOWN],
        ok_detail=f"{len(want)} layers at step {steps}",
    )


def final_bias(inp) -> dict[int, np.ndarray]:
    """model layer index -> the bias the routing record holds after the last committed step."""
    path, moe = _record_path(inp), inp.config.model.moe
    if path is None or moe is None:
        return {}
    rows = read_routing(path.parent.parent if path.parent.name == "metrics" else path.parent, inp.steps())
    last = rows.get(inp.steps())
    if last is None:
        return {}
    return {moe.first_dense_layers + i: b for i, b in enumerate(bias_matrix(last)) if b is not None}


def checkpoint_bias_problems(checkpoint: Path, inp) -> list[str]:
    """Where the balancing bias in a final checkpoint's model weights differs from the routing
    record's last line ([] for a model without one)."""
    want = final_bias(inp)
    if not want:
        return []
    from safetensors import safe_open  # noqa: PLC0415

    problems = []
    with safe_open(str(checkpoint / "model.safetensors"), framework="np") as f:
        keys = set(f.keys())
        for layer, bias in sorted(want.items()):
            key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
            if key not in keys:
                problems.append(f"{key}: not in the checkpoint")
            elif not np.array_equal(np.asarray(f.get_tensor(key), dtype=np.float32), bias):
                problems.append(f"{key}: checkpoint and the routing record's last step differ")
    return problems
