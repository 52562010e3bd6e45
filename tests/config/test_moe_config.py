"""Mixture-of-experts recipes: schema and rules, unchanged dense fingerprints, exact total and active
parameter counts, and the H200 MoE experiment's plan and MFU against hand arithmetic."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from runner.config.fingerprint import canonical_meaning
from runner.config.load import load_experiment
from runner.config.schema import ExperimentSchema, ModelRecipe
from runner.config.section import from_plain
from runner.errors import RunnerError
from runner.planning import assumptions
from runner.planning.flops import MOE_CONVENTION, convention_for, count_params, flops_per_token, params_of_config
from runner.planning.hardware import mfu
from runner.planning.plan import build_plan
from runner.planning.plan_text import format_plan
from runner.reports.planning_inputs import read_calibration

REPO = Path(__file__).resolve().parents[2]


def test_dense_fingerprints_are_what_they_were_before_experts_existed():
    # Published runs were trained under these: a dense experiment's identity must not move (every
    # shipped experiment's is pinned in tests/config/test_recipe.py).
    assert load_experiment(REPO / "experiments/cpu-tiny.yaml").fingerprint == (
        "4f70b16fe06fec74b7cd229c09683bf5eb96022517ab5cca3a4d29ac512799b4"
    )
    dense = load_experiment(REPO / "experiments/cpu-tiny.yaml")
    assert dense.config.model.moe is None and "moe" not in canonical_meaning(dense.config)["model"]


def test_moe_experiment_resolves_with_its_expert_fields_in_the_fingerprint(project):
    exp = load_experiment(project / "experiments/cpu-tiny-moe.yaml")
    m = exp.config.model
    assert m.arch == "olmoe" and m.moe.n_experts == 8 and m.moe.experts_per_token == 2
    assert m.intermediate_size == m.moe.expert_intermediate_size == 64
    assert canonical_meaning(exp.config)["model"]["moe"]["router_z_loss_coef"] == 0.001
    path = project / "recipes/model/olmoe-tiny.yaml"
    path.write_text(path.read_text().replace("router_z_loss_coef: 0.001", "router_z_loss_coef: 0.0"))
    assert load_experiment(project / "experiments/cpu-tiny-moe.yaml").fingerprint != exp.fingerprint


BROKEN_MOE = [
    # (change to recipes/model/olmoe-tiny.yaml, key in the message, words in the message)
    (lambda d: d["moe"].update(experts_per_token=9), "moe.experts_per_token", "only 8 experts"),
    (lambda d: d["moe"].update(n_experts=0), "moe.n_experts", "must be >= 1"),
    (lambda d: (d.pop("moe"), d.update(intermediate_size=64)), "moe", "arch olmoe needs a moe section"),
    (lambda d: d["moe"].update(router_aux_loss_coef=-0.01), "moe.router_aux_loss_coef", "finite number >= 0"),
    (lambda d: d["moe"].update(router_z_loss_coef=float("nan")), "moe.router_z_loss_coef", "finite number"),
    (lambda d: d.update(intermediate_size=128), "intermediate_size", "must equal moe.expert_intermediate_size"),
    (lambda d: d["moe"].update(n_expert=8), "moe.n_expert", "did you mean 'n_experts'"),
    (lambda d: d.update(arch="llama"), "moe", "only a mixture-of-experts arch (olmoe) has experts"),
    (lambda d: d.update(arch="mixtral"), "arch", "not one of llama, olmoe"),
]


@pytest.mark.parametrize("change, key, words", BROKEN_MOE, ids=[b[1] for b in BROKEN_MOE])
def test_broken_moe_recipe_is_refused_naming_file_and_key(project, change, key, words):
    path = project / "recipes/model/olmoe-tiny.yaml"
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny-moe.yaml")
    line = next(line for line in str(err.value).splitlines() if key in line)
    assert words in line and line.split(": ")[0].endswith(".yaml"), line


def _olmoe(**kw) -> dict:
    model = dict(
        arch="olmoe",
        hidden_size=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=48,
        tie_embeddings=False,
        moe=dict(n_experts=6, experts_per_token=2, expert_intermediate_size=48),
    )
    model.update(kw)
    return model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_total_count_matches_transformers_olmoe_and_active_counts_k_experts(tied, n_kv_heads):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    model = _olmoe(tie_embeddings=tied, n_kv_heads=n_kv_heads)
    hf = OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=300,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=n_kv_heads,
            intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
            tie_word_embeddings=tied,
            pad_token_id=None,
        )
    )
    counts = count_params(from_plain(ModelRecipe, model), 300)
    assert counts.all == sum(p.numel() for p in hf.parameters())
    assert counts.get("all") == counts.all and counts.moe
    # Hand count, d=64, heads 4 (head_dim 16), kv_dim 16 * n_kv, 6 experts of 48, k=2, V=300.
    kv = 16 * n_kv_heads
    attn = 64 * 64 * 2 + 2 * 64 * kv
    norms = 64 + 64 + 64 + kv  # input, post-attention, q_norm, k_norm
    router, expert = 64 * 6, 3 * 64 * 48
    assert counts.layer.total == attn + norms + router + 6 * expert
    assert counts.active == 3 * (attn + norms + router + 2 * expert) + 64 + 300 * 64
    assert counts.get("active") == counts.active < counts.non_embedding


def test_dense_active_is_non_embedding_and_convention_follows_the_arch():
    dense = count_params(from_plain(ModelRecipe, dict(_olmoe(), arch="llama", moe=None, intermediate_size=160)), 300)
    assert dense.active == dense.non_embedding and not dense.moe
    assert convention_for(from_plain(ExperimentSchema, {"model": {"arch": "llama"}})).params_counted == "non_embedding"
    moe = from_plain(ExperimentSchema, {"model": _olmoe()})
    assert convention_for(moe) == MOE_CONVENTION and MOE_CONVENTION.params_counted == "active"


def _h200_moe() -> ExperimentSchema:
    return load_experiment(REPO / "experiments/olmoe-1b-7b.yaml", check_files=False).config


# The H200 MoE experiment by hand: OLMoE-1B-7B's shape. d = 2048, 16 layers, 16 heads (MHA), 64 experts
# of 1024, k = 8, V = 50,277 padded to 50,304 rows, untied; seq 2048; micro batch 4; 20,000 steps of 1,048,576.
D, LAYERS, V, SEQ = 2048, 16, 50_304, 2048
ATTN = 4 * D * D  # q, k, v, o: 16,777,216
NORMS = 4 * D  # input, post-attention, q_norm, k_norm: 8,192
ROUTER = D * 64  # 131,072
EXPERT = 3 * D * 1024  # 6,291,456
TOTAL = LAYERS * (ATTN + NORMS + ROUTER + 64 * EXPERT) + 2 * V * D + D  # 6,919,161,856
ACTIVE = LAYERS * (ATTN + NORMS + ROUTER + 8 * EXPERT) + V * D + D  # 1,178,994,688: no input embedding
FLOPS_PER_TOKEN = 6 * ACTIVE + 12 * LAYERS * D * SEQ  # 6N+attn over active: 7,879,274,496
H200_PEAK = 989.4e12


def test_h200_moe_counts_and_flops_per_token_by_hand():
    cfg = _h200_moe()
    counts = params_of_config(cfg)
    assert (counts.all, counts.active) == (TOTAL, ACTIVE) == (6_919_161_856, 1_178_994_688)
    assert flops_per_token(cfg, convention_for(cfg)) == FLOPS_PER_TOKEN == 7_879_274_496


def test_h200_moe_plan_takes_compute_from_active_and_memory_from_total_parameters(monkeypatch):
    monkeypatch.setattr(assumptions, "MEASURED_MFU", ())  # the assumed path (the measured one: test_plan_assumptions)
    plan = build_plan(_h200_moe(), root=REPO)
    assert plan["convention"]["params_counted"] == "active"
    assert plan["compute"]["flops_per_token"] == FLOPS_PER_TOKEN
    tokens = 20_000 * 512 * SEQ
    # The H200 recipe's dense 40% times the MoE ratio (OLMoE 1.3B active x 24,400 tokens/s over OLMo-core's
    # 7B x 10,000, on H100: 0.4531) = 18.13% of 989.4 TFLOP/s over 7.879 GFLOP per token: 22,760 tokens/s;
    # 20,000 x 1,048,576 tokens at that rate: 255.95 h.
    mfu = 0.4 * (1.3e9 * 24_400) / (7e9 * 10_000)
    assert mfu == pytest.approx(0.18126, abs=1e-5)
    assert plan["time"]["assumed"]["mfu"] == pytest.approx(mfu, rel=1e-12)
    assert plan["assumptions"]["mfu"]["architecture"] == "moe" and "OLMoE-1B-7B" in plan["assumptions"]["mfu"]["source"]
    tps = mfu * H200_PEAK / FLOPS_PER_TOKEN
    assert tps == pytest.approx(22_760.4, abs=0.1)
    assert plan["time"]["assumed"]["tokens_per_second"] == pytest.approx(tps, rel=1e-12)
    assert tokens / tps / 3600 == pytest.approx(255.95, abs=0.01)
    assert plan["time"]["assumed"]["pure_hours"] == pytest.approx(tokens / tps / 3600, rel=1e-12)
    mem = plan["memory"]
    # Every expert is held: 18 bytes (fp32 master, grads, 2 AdamW moments, bf16 copies) x all parameters.
    assert mem["params"] == TOTAL and mem["model_state_total_bytes"] == 18 * TOTAL
    # Activations, checkpointed (micro batch 4 x 2048 = n = 8,192 positions), in bytes per position as
    # runner.planning.plan.saved_activation_bytes counts them under bf16 autocast (c = 2; fp32 residual
    # stream and RMSNorms): each layer's fp32 input; one layer recomputed: attention (norm, 3 input casts,
    # q, k, v, logsumexp, output, and OLMoE's q/k norms: inputs, fp32 products, rsqrt), experts (the
    # runner's MoE layer: norm, router input, fp32 probabilities, top-k ids, sort order, source rows,
    # sorted weights; per routed copy (k = 8) its input, gate+up, silu, product, down output and the
    # fp32 weighted output);
    # the plain head (norm, lm_head input, fp32 log-softmax V, targets, mask) and the loss's transient
    # gradient (8 V); input ids 8; RoPE's cos and sin.
    n, c, heads, kv = 4 * SEQ, 2, 16, D
    norm = 4 * D + 4 + 4 * D
    attention = norm + 3 * c * D + c * D + 2 * c * kv + 4 * heads + c * D + c * D + c * kv + 4 * D + 4 * kv + 8
    experts = norm + c * D + 4 * 64 + 28 * 8 + 8 * (2 * c * D + 4 * c * 1024 + 4 * D)
    rope = 2 * SEQ * (D // heads) * 4
    head = norm + c * D + 4 * V + 9
    want = LAYERS * 4 * D * n + head * n + 8 * n + (attention + experts) * n + rope + 8 * V * n
    assert mem["activation_bytes_checkpointed"] == want
    assert mem["fits"] and mem["activation_checkpointing"]
    assert plan["storage"]["checkpoint_bytes"] == 12 * TOTAL
    text = format_plan(plan)
    assert "params (active per token)" in text and "1,178,994,688" in text and "params active" in text


def test_h200_moe_mfu_from_a_measured_run_counts_active_parameters(tmp_path):
    cfg = _h200_moe()
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    rows = [dict(step=s, tokens_per_second=40_000.0, step_seconds=26.2, wall_seconds=26.2 * s) for s in (1, 2, 3)]
    (run / "metrics/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "run.json").write_text(json.dumps({"conventions": {"peak_tflops": 989.4}, "devices": 1}))
    (run / "experiment.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    cal = read_calibration(run, cfg)
    # 7,879,274,496 FLOPs x 40,000 tokens/s / 989.4e12 = 31.855% (over all 6.9B parameters it would be 168%).
    assert cal.mfu == pytest.approx(FLOPS_PER_TOKEN * 40_000 / H200_PEAK) == pytest.approx(0.31855, abs=1e-5)
    assert mfu(FLOPS_PER_TOKEN, 40_000 * 26.2, 26.2, 989.4, 1) == pytest.approx(cal.mfu)
