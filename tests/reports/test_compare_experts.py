"""`runner compare` puts mixture-of-experts runs' load balance side by side (runner.reports.compare.experts)."""

from __future__ import annotations

from pathlib import Path

from runner.reports.compare.render import render_markdown
from runner.reports.compare.runs import assign_labels, compare, load_source

REPO = Path(__file__).resolve().parents[2]
MOE_REPORT = REPO / "reports/cpu-tiny-moe/20261201-crash-resume"


def test_compare_shows_each_moe_runs_routing_and_per_layer_imbalance_from_its_report():
    sources = [load_source(str(MOE_REPORT)), load_source(str(MOE_REPORT))]
    assign_labels(sources, ["aux-loss", "again"])
    sources[1].cfg["model"]["moe"].update(balancing="aux_free", bias_update_rate=0.01, router="sigmoid")
    comp = compare(sources)
    frame = comp.frames["expert_balance"].set_index("")
    assert frame.loc["routing", "aux-loss"] == "softmax, aux_loss (coef 0.01)"
    assert frame.loc["routing", "again"] == "sigmoid, aux_free (rate 0.01)"
    balance = sources[0].tables["expert_balance"]
    want = balance[(balance["domain"] == "(all)") & (balance["layer"] == 1)]["load_imbalance"].iloc[0]
    assert frame.loc["layer 1 imbalance", "aux-loss"] == round(float(want), 4)
    assert "## Expert load balance" in render_markdown(comp)
