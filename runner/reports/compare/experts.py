"""The expert-balance part of `runner compare`: mixture-of-experts runs side by side.

Owns: per MoE layer, each run's load imbalance (max / mean load over all domains, from its report's
expert_balance table) and how the run routes and balances (router scores, auxiliary loss or the
auxiliary-loss-free bias), so an aux-free run sits beside an aux-loss run of the same data.
Never: recomputes or judges a figure (the audit of each report does).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from schemas.report_tables import ALL_DOMAINS


def _routing(cfg: dict) -> str:
    moe = ((cfg.get("model") or {}).get("moe")) or {}
    balancing = moe.get("balancing", "aux_loss")
    how = (
        f"aux_free (rate {moe.get('bias_update_rate', 0.001)})"
        if balancing == "aux_free"
        else f"aux_loss (coef {moe.get('router_aux_loss_coef')})"
    )
    return f"{moe.get('router', 'softmax')}, {how}"


def expert_balance(labels: list[str], sources: list[Any]) -> pd.DataFrame | None:
    """Rows: `routing`, then each MoE layer's imbalance; one column per run. None when no run has experts."""
    tables = [s.tables.get("expert_balance") for s in sources]
    if not any(t is not None and len(t) for t in tables):
        return None
    rows: dict[str, dict[str, Any]] = {"routing": {}}
    for label, s, t in zip(labels, sources, tables):
        if t is None or not len(t):
            rows["routing"][label] = "dense"
            continue
        rows["routing"][label] = _routing(s.cfg)
        for r in t[t["domain"] == ALL_DOMAINS].itertuples(index=False):
            rows.setdefault(f"layer {int(r.layer)} imbalance", {})[label] = round(float(r.load_imbalance), 4)
    return pd.DataFrame([{"": key, **{lab: cells.get(lab, "") for lab in labels}} for key, cells in rows.items()])
