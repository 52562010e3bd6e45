"""DeepSeek-style mixture-of-experts runs end to end: a V4-style run (sqrt-softplus, aux-free bias,
a shared expert, a hash-routed layer) killed and resumed is bit-identical to an uninterrupted one,
audits PASS, and a forged bias trajectory or step load FAILs; a V3-style run exports as
Glm4MoeForCausalLM and loads in transformers alone with the run's logits."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from trainfixtures import launch, make_project

from runner.reports.audit.result import AuditResult
from runner.reports.audit.routing import check_routing
from runner.reports.audit.run import audit, load_input
from runner.reports.tables import render_report_dir
from runner.training.routing_record import read_routing

V4 = {
    "arch": "olmoe",
    "intermediate_size": 32,
    "moe": {
        "n_experts": 4,
        "experts_per_token": 2,
        "expert_intermediate_size": 32,
        "router": "sqrt_softplus",
        "balancing": "aux_free",
        "bias_update_rate": 0.01,
        "router_aux_loss_coef": 0.0,
        "shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "hash_layers": 1,
        "swiglu_limit": 10.0,
    },
}
V3 = {
    "arch": "olmoe",
    "intermediate_size": 48,
    "tie_embeddings": False,
    "qk_norm": "per_head",
    "moe": {
        "n_experts": 4,
        "experts_per_token": 2,
        "expert_intermediate_size": 32,
        "router": "sigmoid",
        "balancing": "aux_free",
        "bias_update_rate": 0.01,
        "router_aux_loss_coef": 0.0,
        "sequence_aux_loss_coef": 0.001,
        "shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_dense_layers": 1,
    },
}
BIAS = "balancing bias replayed from the step loads"
SUMS = "routing record: step loads sum to the expert load table"
REPORT_BIAS = "report's final bias (final_bias.json) equals the replay"


def _lines(run: Path) -> dict[int, dict]:
    return read_routing(run, 4)


@pytest.mark.slow
def test_v4_style_run_resumes_bit_identically_audits_and_a_forged_bias_or_load_fails(tmp_path):
    exp = make_project(tmp_path, steps=4, checkpoint_every=2, keep_last=2, eval_every=4, model_extra=V4)
    ref = tmp_path / "runs" / "ref"
    launch(tmp_path, exp, "--run-dir", ref, "--no-tracking")
    run = tmp_path / "runs" / "k"
    killed = launch(tmp_path, exp, "--run-dir", run, "--kill-at-step", 4, "--no-tracking", check=False)
    assert killed.returncode == -signal.SIGKILL
    launch(tmp_path, run, "--no-tracking")
    # The bias is a buffer of the model: checkpointed, restored, and the weights are the same bytes.
    weights = [(r / "checkpoints/step-0000004/model.safetensors").read_bytes() for r in (run, ref)]
    assert weights[0] == weights[1]
    lines, ref_lines = _lines(run), _lines(ref)
    assert lines == ref_lines and sorted(lines) == list(range(1, 5))
    assert lines[4]["bias"][0] is None  # layer 0 is hash-routed: no bias
    bias = np.asarray(lines[4]["bias"][1])
    assert np.any(bias != 0) and set(np.round(np.abs(bias) / 0.01).astype(int)) <= set(range(5))
    assert (run / "metrics/routing.jsonl").read_text().count('"step": 3,') == 2  # redone after the kill
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics/train.jsonl").read_text().splitlines())}
    load = np.asarray(lines[4]["load"][1])  # the step's per-layer imbalance figure (MLflow's too)
    assert rows[4]["moe_layer_1_load_imbalance"] == pytest.approx(load.max() / load.mean())
    genuine = audit(run, check_mlflow=False)
    assert genuine.consistent, genuine.render()
    assert {c.name: c.status for c in genuine.checks}[BIAS] == "PASS"
    statuses = {c.name: c.status for c in genuine.checks}
    assert statuses["report.md = its tables"] == statuses["plots = its tables"] == "PASS"  # its bias section, heat map

    # Forgeries of metrics/routing.jsonl, each judged by the routing checks on the genuine report.
    inp = load_input(run)

    def routing_checks(edit) -> AuditResult:
        forged = tmp_path / f"forged-{len(list(tmp_path.glob('forged-*')))}"
        (forged / "metrics").mkdir(parents=True)
        text = (run / "metrics/routing.jsonl").read_text().splitlines()
        edit(text)
        (forged / "metrics/routing.jsonl").write_text("\n".join(text) + "\n")
        res = AuditResult(str(forged))
        check_routing(res, dataclasses.replace(inp, run_dir=forged, report_dir=None))
        return res

    def favour_one_expert(text: list[str]) -> None:  # the last step's bias, one expert a little higher
        row = json.loads(text[-1])
        row["bias"][1][0] += 0.01
        text[-1] = json.dumps(row)

    def move_load(text: list[str]) -> None:  # the last step's load moved between experts: its sum holds
        row = json.loads(text[-1])
        row["load"][1][0] += 8
        row["load"][1][1] -= 8
        text[-1] = json.dumps(row)

    assert routing_checks(lambda text: None).failed() == []
    result = routing_checks(favour_one_expert)
    assert result.failed() == [BIAS] and "step 4 layer 1" in result.checks[-1].detail
    assert SUMS in routing_checks(move_load).failed()

    # The final bias in the report (issue 36): report/final_bias.json and report.md's section, held by the audit.
    report = run / "report"
    final = json.loads((report / "final_bias.json").read_text())
    assert final["step"] == 4 and list(final["layers"]) == ["1"]  # model layer 1; layer 0 is hash-routed
    assert np.array_equal(np.asarray(final["layers"]["1"], dtype=np.float32), bias.astype(np.float32))
    md = (report / "report.md").read_text()
    assert "Balancing bias after step 4" in md
    assert "layer 1: " + " ".join(str(np.float32(x)) for x in lines[4]["bias"][1]) in md.splitlines()
    assert {c.name: c.status for c in genuine.checks}[REPORT_BIAS] == "PASS"
    forged_report = tmp_path / "forged-report"
    shutil.copytree(report, forged_report)
    final["layers"]["1"][0] += 0.01
    (forged_report / "final_bias.json").write_text(json.dumps(final))
    res = AuditResult(str(forged_report))
    check_routing(res, dataclasses.replace(inp, report_dir=forged_report))
    assert res.failed() == [REPORT_BIAS] and "model layer 1" in res.checks[-1].detail
    render_report_dir(forged_report)  # re-rendered from the report folder alone: the section stays
    assert "Balancing bias after step 4" in (forged_report / "report.md").read_text()


@pytest.mark.slow
def test_v3_style_run_exports_as_glm4_moe_with_the_runs_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from runner.export.export import export_run
    from runner.export.source import open_source, reference_model

    exp = make_project(tmp_path, steps=3, checkpoint_every=3, eval_every=3, model_extra=V3)
    run = tmp_path / "runs" / "v3"
    launch(tmp_path, exp, "--run-dir", run, "--no-tracking")
    out = tmp_path / "exports" / "v3"
    export_run(run, out, dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert (config["n_group"], config["topk_group"], config["first_k_dense_replace"]) == (1, 1, 1)
    rope = config.get("rope_parameters") or {}
    assert config.get("partial_rotary_factor", rope.get("partial_rotary_factor")) == 1.0  # Glm4Moe's default: 0.5
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = reference_model(open_source(run))
    bias = reference.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.any(bias != 0)  # the balancing ran, and the export carries it
    ids = torch.randint(0, 4000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((loaded(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max()) <= 1e-5


GOOD_LINE = {"format": "runner-routing/1", "step": 1, "load": [[3, 5], [4, 4]], "bias": [None, [0.01, -0.01]]}


@pytest.mark.parametrize(
    "change, says",
    [
        ({"bias": [None, "x"]}, "bias must be null or 2 float32 values per layer"),  # float('x') in the report
        ({"bias": -1}, "bias must be one entry per MoE layer (2)"),  # 'int' object is not iterable
        ({"bias": [None, [1e308, 0.0]]}, "bias must be null or 2 float32 values per layer"),  # inf after the cast
        ({"load": [[3, None], [4, 4]]}, "load must be one list per MoE layer of each expert's load (whole numbers)"),
        ({"load": [[3, 5], [4]]}, "load's layers hold [1, 2] experts, not one count"),
        ({"step": "x"}, 'step "x" is not a whole number >= 0'),
    ],
)
def test_a_routing_record_line_of_another_shape_is_one_line_naming_it(tmp_path, change, says):
    """metrics/routing.jsonl's lines were checked for their format, step and keys only: a bias or load of
    another shape was a traceback in `runner report` (TypeError, ValueError) and "unusable report or
    config" in the audit, wherever the arrays were read (a fuzz of its first and last lines, 128 cases).
    Each line is checked whole: one line naming the file and line."""
    from runner.errors import RunnerError

    (tmp_path / "metrics").mkdir()
    path = tmp_path / "metrics" / "routing.jsonl"
    path.write_text(json.dumps(GOOD_LINE) + "\n" + json.dumps({**GOOD_LINE, "step": 2, **change}) + "\n")
    with pytest.raises(RunnerError) as err:
        read_routing(tmp_path, 2)
    assert str(err.value) == f"{path}: line 2: not a routing record line: {says}"
    path.write_text(json.dumps(GOOD_LINE) + "\n")
    assert read_routing(tmp_path, 2) == {1: GOOD_LINE}
