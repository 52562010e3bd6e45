"""The expert tables of a run's report: expert load, balance, router losses, and the heat map.

Owns: turning a mixture-of-experts run folder's expert_load.json and metrics/train.jsonl into the
report tables `expert_load`, `expert_balance` and `router` (schemas/report_tables.py), the
domain x expert heat map (expert_load_heatmap.png) and the report.md section. A dense run gets
the same tables, empty.
Never: validates or judges the numbers (runner.reports.audit.experts does), or reads anything but
the run folder it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runner.config.schema import ExperimentSchema
from runner.errors import RunnerError
from runner.planning.flops import is_moe
from runner.training.expert_load import FILE, balance, read_expert_load
from schemas.report_tables import ALL_DOMAINS, SCHEMAS

TABLES = ("expert_load", "expert_balance", "router")
HEATMAP = "expert_load_heatmap.png"
#: train.jsonl keys of a step (runner.training.experts) -> router table columns
ROUTER_COLUMNS = {
    "router_aux_loss": "router_aux_loss",
    "router_z_loss": "router_z_loss",
    "expert_load_imbalance": "load_imbalance",
    "expert_load_cv": "load_cv",
    "expert_idle_capacity": "idle_capacity",
}


def _empty(name: str) -> pd.DataFrame:
    """A table with no rows whose columns already have the schema's dtypes."""
    columns = SCHEMAS[name].columns
    dtypes = {
        col: (str(spec.dtype) if str(spec.dtype) in ("int64", "float64") else "str") for col, spec in columns.items()
    }
    return pd.DataFrame({col: pd.Series(dtype=dtype) for col, dtype in dtypes.items()})


def empty_tables() -> dict[str, pd.DataFrame]:
    return {name: _empty(name) for name in TABLES}


def balance_rows(routed: np.ndarray, domains: list[str], exposure: dict[str, int], k: int) -> list[dict[str, Any]]:
    """expert_balance rows of `routed[layer, domain, expert]`: each domain, then the layer over all."""
    rows = []
    for layer in range(routed.shape[0]):
        loads = [(d, routed[layer, i], int(exposure[d])) for i, d in enumerate(domains)]
        loads.append((ALL_DOMAINS, routed[layer].sum(axis=0), sum(int(exposure[d]) for d in domains)))
        for domain, load, exposed in loads:
            b = balance(load)
            rows.append(
                {
                    "layer": layer,
                    "domain": domain,
                    "exposure_tokens": exposed,
                    "experts_per_token": int(k),
                    "routed_tokens": int(load.sum()),
                    "max_load_tokens": int(load.max()),
                    "mean_load_tokens": float(b["mean"]),
                    "load_imbalance": float(b["imbalance"]),
                    "load_cv": float(b["cv"]),
                    "idle_capacity": float(b["idle_capacity"]),
                }
            )
    return rows


def build(
    run_dir: Path, cfg: ExperimentSchema, accounting: pd.DataFrame, train_rows: list[dict]
) -> dict[str, pd.DataFrame]:
    """The three expert tables of a run folder (empty for a dense model)."""
    if not is_moe(cfg):
        return empty_tables()
    path = run_dir / FILE
    if not path.exists():
        raise RunnerError("missing: a mixture-of-experts run records its expert load here", file=str(path))
    load, _ = read_expert_load(path)
    domains = sorted(accounting["domain"])
    if load.domains != domains:
        raise RunnerError(f"domains {load.domains}, the run's ledger has {domains}", file=str(path))
    exposure = {r.domain: int(r.exposure_tokens) for r in accounting.itertuples(index=False)}
    expert_load = pd.DataFrame(
        [
            {"layer": layer, "domain": d, "expert": e, "routed_tokens": int(load.routed[layer, i, e])}
            for layer in range(load.n_layers)
            for i, d in enumerate(load.domains)
            for e in range(load.n_experts)
        ],
        columns=list(SCHEMAS["expert_load"].columns),
    )
    balance_table = pd.DataFrame(
        balance_rows(load.routed, load.domains, exposure, load.k), columns=list(SCHEMAS["expert_balance"].columns)
    )
    router = pd.DataFrame(
        [
            {"step": int(r["step"]), **{col: float(r[key]) for key, col in ROUTER_COLUMNS.items()}}
            for r in sorted(train_rows, key=lambda r: r["step"])
            if "router_aux_loss" in r
        ],
        columns=list(SCHEMAS["router"].columns),
    )
    return {"expert_load": expert_load, "expert_balance": balance_table, "router": router}


def relative_load(expert_load: pd.DataFrame) -> tuple[np.ndarray, list[str], int]:
    """Heat map values: each (layer, domain) row's loads over their mean (1 = the expert's fair share)."""
    pivot = expert_load.pivot_table(index=["layer", "domain"], columns="expert", values="routed_tokens", aggfunc="sum")
    values = pivot.to_numpy(dtype=float)
    mean = values.mean(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(mean > 0, values / mean, np.nan)
    labels = [f"layer {layer} {domain}" for layer, domain in pivot.index]
    return rel, labels, values.shape[1]


def write_heatmap(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    """expert_load_heatmap.png: domain x expert, one block of rows per layer; [] for a dense run."""
    if tables.get("expert_load") is None or tables["expert_load"].empty:  # dense, or an older report
        return []
    import matplotlib  # noqa: PLC0415  (matplotlib: only when plots are written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rel, labels, n_experts = relative_load(tables["expert_load"])
    fig, ax = plt.subplots(figsize=(max(6.0, min(2 + 0.25 * n_experts, 18)), 1.5 + 0.3 * len(labels)))
    image = ax.imshow(rel, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xticks(range(n_experts), [str(e) for e in range(n_experts)], fontsize=7)
    n_domains = tables["expert_load"]["domain"].nunique()
    for boundary in range(n_domains, len(labels), n_domains):
        ax.axhline(boundary - 0.5, color="white", linewidth=1.5)
    ax.set(xlabel="expert", title="Expert load per domain (routed / row mean; 1 = fair share)")
    fig.colorbar(image, ax=ax, label="load / mean load")
    fig.tight_layout()
    path = out / HEATMAP
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def markdown(
    tables: dict[str, pd.DataFrame],
    cfg: ExperimentSchema,
    params: dict[str, int],
    md_table: Callable[[pd.DataFrame], str],
    final_bias: dict[str, Any] | None = None,
) -> list[str]:
    """The report.md section on experts ([] for a dense run); `md_table` renders a frame as the report does;
    `final_bias` (report/final_bias.json) adds the balancing bias after the last step."""
    bal = tables.get("expert_balance")
    if bal is None or bal.empty:  # dense, or an older report
        return []
    moe = cfg.model.moe
    if moe is None:
        return []
    layers = bal[bal["domain"] == ALL_DOMAINS]
    worst = bal.loc[bal["load_imbalance"].idxmax()] if bal["load_imbalance"].notna().any() else None
    router = tables["router"]
    lines = [
        "## Experts",
        "",
        f"- {moe.n_experts} experts per layer, each input position routed to "
        f"k = {moe.experts_per_token} (expert hidden size {moe.expert_intermediate_size}); "
        f"router loss weights: load balancing {moe.router_aux_loss_coef}, z-loss {moe.router_z_loss_coef}.",
        f"- Parameters: {params['all']:,} in total (memory, checkpoints), {params['active']:,} active per token "
        "(attention, router, k experts, norms, head: FLOPs and MFU).",
        "- Every position is routed (no drops): per layer and domain the loads sum to exposure x k.",
        *_deepseek_lines(cfg),
    ]
    if worst is not None:
        lines.append(
            f"- Most unbalanced: layer {int(worst.layer)}, {worst.domain}: busiest expert "
            f"{worst.load_imbalance:.3g}x the mean load."
        )
    if not router.empty:
        last = router.iloc[-1]
        lines.append(
            f"- Router losses at step {int(last.step)}: load balancing {last.router_aux_loss:.4g} "
            f"(1 = uniform), z-loss {last.router_z_loss:.4g}."
        )
    cols = ["layer", "routed_tokens", "max_load_tokens", "load_imbalance", "load_cv", "idle_capacity"]
    lines += [
        "",
        "Load balance per layer over all domains (per-domain rows in `expert_balance`):",
        "",
        md_table(layers[cols].reset_index(drop=True)),
        "",
        f"![expert load per domain]({HEATMAP})",
        "",
        "- `routed_tokens`: input positions routed to an expert in committed steps (a position counts once per",
        "  expert it is sent to); `load_imbalance` = max / mean load; `load_cv` = std / mean;",
        "  `idle_capacity` = 1 - mean / max: the share of expert capacity, sized for the busiest expert, left idle.",
        "",
    ]
    return lines + bias_lines(final_bias, md_table)


def bias_lines(final_bias: dict[str, Any] | None, md_table: Callable[[pd.DataFrame], str]) -> list[str]:
    """report.md's balancing bias after the last step, every layer's whole vector ([] without one)."""
    if not final_bias:
        return []
    layers = sorted(final_bias["layers"].items(), key=lambda kv: int(kv[0]))
    rows = pd.DataFrame(
        [
            {
                "model layer": int(layer),
                "min": float(np.min(v)),
                "max": float(np.max(v)),
                "experts raised (b > 0)": int(np.sum(np.asarray(v) > 0)),
                "experts lowered (b < 0)": int(np.sum(np.asarray(v) < 0)),
            }
            for layer, v in layers
        ]
    )
    return [
        f"Balancing bias after step {final_bias['step']} (added to the scores for the top-k choice only; float32, "
        f"in `final_bias.json`; every step's in the run's `{final_bias['source']}`, which the audit replays from "
        "the step loads and holds the final checkpoint's router buffers to):",
        "",
        md_table(rows),
        "",
        "```",
        *(f"layer {layer}: " + " ".join(str(np.float32(x)) for x in v) for layer, v in layers),
        "```",
        "",
    ]


def _deepseek_lines(cfg: ExperimentSchema) -> list[str]:
    """What the report says of DeepSeek-style routing ([] for an OLMoE recipe at its defaults)."""
    moe = cfg.model.moe
    assert moe is not None
    lines = []
    if moe.router != "softmax" or moe.balancing != "aux_loss":
        balancing = (
            f"auxiliary-loss-free: a per-expert bias on the top-k choice only, b += {moe.bias_update_rate} x "
            "sign(mean load - load) once per optimizer step; its value after every step is in "
            "metrics/routing.jsonl, which the audit replays from the recorded step loads"
            if moe.balancing == "aux_free"
            else "by the auxiliary loss"
        )
        lines.append(
            f"- Routing: {moe.router} scores"
            + (", top-k renormalised" if moe.norm_topk_prob else "")
            + (f", routed output x {moe.routed_scaling_factor}" if moe.routed_scaling_factor != 1.0 else "")
            + f"; balancing {balancing}."
        )
    if moe.shared_experts:
        lines.append(
            f"- {moe.shared_experts} shared expert(s) of {moe.shared_intermediate_size} per layer: every position "
            "passes through them; they are not in the load tables (nothing is routed to them)."
        )
    if moe.first_dense_layers:
        lines.append(
            f"- The first {moe.first_dense_layers} layer(s) have a dense MLP and route nothing: `layer` in the "
            f"tables counts mixture-of-experts layers (table layer 0 is model layer {moe.first_dense_layers})."
        )
    if moe.hash_layers:
        lines.append(
            f"- MoE layers 0-{moe.hash_layers - 1} route by a fixed token id -> expert table (hash routing): their "
            "load follows each domain's token frequencies, not a learned choice, and no bias balances them."
        )
    return lines
