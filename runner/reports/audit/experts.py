"""The audit's checks of a mixture-of-experts report: expert load against exposure x k.

Owns: the named checks `runner audit` adds for the expert tables (runner.reports.expert_tables):
the tables are empty for a dense model; a mixture of experts has one expert_load row per layer,
domain and expert of its config; per layer and domain the loads sum to the domain's exposure (the
ledger's counter, in the accounting table) times k from the config (SPEC, "Mixture-of-experts");
expert_balance is recomputed from the loads; router losses are recorded at every logged step; the
expert load a run's final checkpoint stores (ledger.safetensors, a record apart from the tables)
equals the table.
Never: edits a report, or raises for a discrepancy (discrepancies are check results).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from runner.planning.flops import is_moe
from runner.reports.expert_tables import TABLES, balance_rows
from runner.training.expert_load import STATE_KEY

INT_COLUMNS = ("exposure_tokens", "experts_per_token", "routed_tokens", "max_load_tokens")
FLOAT_COLUMNS = ("mean_load_tokens", "load_imbalance", "load_cv", "idle_capacity")


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _routed_array(load: pd.DataFrame, layers: int, domains: list[str], experts: int) -> tuple[np.ndarray, list[str]]:
    """routed[layer, domain, expert] from the table, and the rows that do not fit the config's shape."""
    routed = np.zeros((layers, len(domains), experts), dtype=np.int64)
    seen: set[tuple[int, str, int]] = set()
    problems = []
    for r in load.itertuples(index=False):
        key = (int(r.layer), str(r.domain), int(r.expert))
        if not (0 <= key[0] < layers and key[1] in domains and 0 <= key[2] < experts):
            problems.append(f"row layer {key[0]}, {key[1]}, expert {key[2]}: not a layer/domain/expert of the model")
        elif key in seen:
            problems.append(f"row layer {key[0]}, {key[1]}, expert {key[2]}: duplicated")
        else:
            seen.add(key)
            routed[key[0], domains.index(key[1]), key[2]] = int(r.routed_tokens)
    missing = layers * len(domains) * experts - len(seen)
    if missing:
        problems.append(f"{missing} (layer, domain, expert) rows missing of {layers * len(domains) * experts}")
    return routed, problems


def _balance_problems(bal: pd.DataFrame, want_rows: list[dict]) -> list[str]:
    got = {(int(r["layer"]), str(r["domain"])): r for r in bal.to_dict("records")}
    problems = []
    for want in want_rows:
        key = (want["layer"], want["domain"])
        row = got.pop(key, None)
        if row is None:
            problems.append(f"layer {key[0]}, {key[1]}: row missing")
            continue
        for col in INT_COLUMNS:
            if int(row[col]) != want[col]:
                problems.append(f"layer {key[0]}, {key[1]}: {col} = {int(row[col])}, recomputed {want[col]}")
        for col in FLOAT_COLUMNS:
            if not _same(float(row[col]), want[col]):
                problems.append(f"layer {key[0]}, {key[1]}: {col} = {float(row[col]):.6g}, recomputed {want[col]:.6g}")
    problems += [f"layer {layer}, {domain}: row not expected" for layer, domain in got]
    return problems


def check_expert_load(res, inp) -> None:
    """Add the expert checks of `inp` (runner.reports.audit.input.AuditInput) to `res` (its AuditResult)."""
    tables, cfg = inp.tables, inp.config
    if not is_moe(cfg) or cfg.model.moe is None:
        filled = [f"{name}: {len(tables[name])} rows" for name in TABLES if len(tables[name])]
        res.add("expert tables empty for a dense model", filled, ok_detail="no experts")
        return
    moe = cfg.model.moe
    layers, experts, k = cfg.model.n_layers, moe.n_experts, moe.experts_per_token
    domains = sorted(cfg.mixture.domains)
    routed, shape_problems = _routed_array(tables["expert_load"], layers, domains, experts)
    res.add(
        "expert load: one row per layer, domain and expert",
        shape_problems,
        ok_detail=f"{layers} layers x {len(domains)} domains x {experts} experts",
    )

    exposure = {str(r.domain): int(r.exposure_tokens) for r in tables["accounting"].itertuples(index=False)}
    sums = routed.sum(axis=2)
    problems = [
        f"layer {layer}, {d}: {int(sums[layer, i])} routed, exposure {exposure.get(d, 0)} x k {k} = {exposure.get(d, 0) * k}"
        for layer in range(layers)
        for i, d in enumerate(domains)
        if int(sums[layer, i]) != exposure.get(d, 0) * k
    ]
    res.add(
        "expert load: loads sum to exposure x k per layer and domain",
        problems,
        ok_detail=f"{layers * len(domains)} sums, k = {k}, exposure from the ledger's counters",
    )

    want = balance_rows(routed, domains, {d: exposure.get(d, 0) for d in domains}, k)
    res.add("expert balance recomputed from the loads", _balance_problems(tables["expert_balance"], want))

    logged = sorted(int(s) for s in tables["throughput"]["step"])
    recorded = sorted(int(s) for s in tables["router"]["step"])
    res.add(
        "router losses at every logged step",
        [] if logged == recorded else [f"router rows at steps {recorded[:6]}..., throughput at {logged[:6]}..."],
        ok_detail=f"{len(recorded)} steps",
    )


def checkpoint_load_problems(ledger: dict[str, np.ndarray], inp) -> list[str]:
    """Where the expert load a final checkpoint stores (its ledger state's STATE_KEY) differs from the
    report's expert_load table; [] for a dense model."""
    cfg = inp.config
    if not is_moe(cfg) or cfg.model.moe is None:
        return []
    if STATE_KEY not in ledger:
        return ["the checkpoint stores no expert load"]
    domains = sorted(cfg.mixture.domains)
    table, _ = _routed_array(inp.tables["expert_load"], cfg.model.n_layers, domains, cfg.model.moe.n_experts)
    stored = np.asarray(ledger[STATE_KEY], dtype=np.int64)
    if stored.shape != table.shape:
        return [f"the checkpoint's expert load has shape {list(stored.shape)}, the report's {list(table.shape)}"]
    return [
        f"expert load layer {layer}, {domains[d]}, expert {e}: checkpoint {int(stored[layer, d, e])}, "
        f"report {int(table[layer, d, e])}"
        for layer, d, e in np.argwhere(stored != table)
    ]
