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


def test_a_dense_run_and_a_mixture_of_experts_compare_their_mfu_by_one_rule():
    """A dense model's active parameters are its non-embedding ones (SPEC 'Mixture-of-experts'): the dense
    report (`non_embedding`) and the MoE report (`active`) count by one rule, so their MFU compares (it
    was marked NOT comparable, in the comparison users make first). An MoE counted `non_embedding` (every
    expert) is another rule."""
    dense = REPO / "reports/cpu-tiny/20261201-crash-resume"
    sources = [load_source(str(dense)), load_source(str(MOE_REPORT))]
    assign_labels(sources)
    assert [str(s.summary["params_counted"]) for s in sources] == ["non_embedding", "active"]
    comp = compare(sources)
    assert comp.mfu_comparable and comp.mfu_differences == []
    sources[1].tables["run_summary"].loc[0, "params_counted"] = "non_embedding"
    comp = compare(sources)
    assert not comp.mfu_comparable
    assert comp.mfu_differences == [
        "params_counted: non_embedding (dense: non_embedding = active) (cpu-tiny) vs non_embedding (every expert) "
        "(cpu-tiny-moe)"
    ]


def test_default_labels_never_name_one_runs_folder_twice():
    """Each run's report copy is runs/<label> in a comparison folder: an experiment `a_b` beside two runs of
    `a` (default labels `a/b` and `a/c`) named runs/a_b twice. Later labels whose folder is taken get #n."""
    from types import SimpleNamespace

    from runner.reports.compare.runs import folder_name

    def runs(*pairs):
        return [SimpleNamespace(summary={"experiment": e, "run_id": r}, label=None) for e, r in pairs]

    sources = runs(("a_b", "1"), ("a", "b"), ("a", "c"), ("a_b_2", "9"))
    assign_labels(sources)
    labels = [s.label for s in sources]
    assert labels == ["a_b", "a/b#2", "a/c", "a_b_2#2"]
    assert len({folder_name(x) for x in labels}) == 4
    plain = runs(("x", "1"), ("y", "2"), ("x", "3"))  # no folder shared: the labels as before
    assign_labels(plain)
    assert [s.label for s in plain] == ["x/1", "y", "x/3"]
