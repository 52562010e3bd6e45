"""DeepSeek-style mixture-of-experts keys: validation (one line naming the key), the fingerprint
(unchanged at the defaults, moved when set), and the accounting of shared experts, dense first
layers and q/k norms against transformers' Glm4Moe and a hand count of moe-ds-1b."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runner.config.fingerprint import canonical_meaning
from runner.config.load import load_experiment
from runner.config.schema import ModelRecipe
from runner.config.section import from_plain
from runner.errors import RunnerError
from runner.planning.flops import convention_for, count_params, flops_per_token, params_of_config
from runner.planning.plan import build_plan
from runner.planning.plan_text import format_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["cpu-tiny-moe-ds", "cpu-tiny-moe-v3", "moe-ds-1b"])
def test_the_deepseek_experiments_validate_with_their_keys_in_the_fingerprint(name):
    cfg = load_experiment(REPO / f"experiments/{name}.yaml", check_files=False).config
    moe = canonical_meaning(cfg)["model"]["moe"]
    assert moe["balancing"] == "aux_free" and moe["shared_experts"] == 1 and moe["router"] != "softmax"


def test_the_new_keys_at_their_defaults_leave_the_olmoe_meaning_as_it_was(project):
    moe = canonical_meaning(load_experiment(project / "experiments/cpu-tiny-moe.yaml").config)["model"]["moe"]
    assert set(moe) == {
        "n_experts",
        "experts_per_token",
        "expert_intermediate_size",
        "router_aux_loss_coef",
        "router_z_loss_coef",
    }
    before = load_experiment(project / "experiments/cpu-tiny-moe.yaml").fingerprint
    path = project / "recipes/model/olmoe-tiny.yaml"
    data = yaml.safe_load(path.read_text())
    data["moe"]["shared_experts"] = 1
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_experiment(project / "experiments/cpu-tiny-moe.yaml").fingerprint != before


BROKEN = [
    # (change to recipes/model/dsmoe-v4-tiny.yaml, key in the message, words in the message)
    (lambda m: m["moe"].update(router="tanh"), "moe.router", "not one of softmax, sigmoid, sqrt_softplus"),
    (lambda m: m["moe"].update(balancing="free"), "moe.balancing", "not one of aux_loss, aux_free"),
    (lambda m: m["moe"].update(hash_layers=3), "moe.hash_layers", "only 2 mixture-of-experts layers"),
    (lambda m: m["moe"].update(first_dense_layers=2), "moe.first_dense_layers", "leave no mixture-of-experts"),
    (
        lambda m: m["moe"].update(first_dense_layers=1, hash_layers=2),
        "moe.hash_layers",
        "only 1 mixture-of-experts layers",
    ),
    (lambda m: m["moe"].update(router_aux_loss_coef=0.01), "moe.router_aux_loss_coef", "aux_free balances without"),
    (
        lambda m: m["moe"].update(balancing="aux_loss", bias_update_rate=0.01),
        "moe.bias_update_rate",
        "only with balancing: aux_free",
    ),
    (lambda m: m["moe"].update(bias_update_rate=0.0), "moe.bias_update_rate", "finite number > 0"),
    (lambda m: m["moe"].update(shared_experts=-1), "moe.shared_experts", "integer >= 0"),
    (
        lambda m: m["moe"].update(shared_experts=0, shared_expert_intermediate_size=32),
        "moe.shared_expert_intermediate_size",
        "shared_experts is 0",
    ),
    (lambda m: m["moe"].update(routed_scaling_factor=0), "moe.routed_scaling_factor", "finite number > 0"),
    (lambda m: m["moe"].update(swiglu_limit=-1.0), "moe.swiglu_limit", "or null"),
    (lambda m: m["moe"].update(sequence_aux_loss_coef=-1.0), "moe.sequence_aux_loss_coef", "finite number >= 0"),
    (lambda m: m.update(qk_norm="rms"), "qk_norm", "not one of full, per_head, none"),
    (lambda m: m.update(intermediate_size=128), "intermediate_size", "or give the first layers a dense MLP"),
]


@pytest.mark.parametrize("change, key, words", BROKEN, ids=[f"{b[1]}-{i}" for i, b in enumerate(BROKEN)])
def test_an_impossible_combination_is_one_line_naming_file_and_key(project, change, key, words):
    path = project / "recipes/model/dsmoe-v4-tiny.yaml"
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny-moe-ds.yaml")
    lines = [line for line in str(err.value).splitlines() if key in line]
    assert len(lines) == 1, str(err.value)
    assert words in lines[0] and lines[0].split(": ")[0].endswith(".yaml"), lines[0]


def test_qk_norm_is_refused_on_a_dense_model(project):
    path = project / "recipes/model/llama-tiny.yaml"
    path.write_text(path.read_text() + "qk_norm: none\n")
    with pytest.raises(RunnerError, match="qk_norm: only arch olmoe has q/k norms"):
        load_experiment(project / "experiments/cpu-tiny.yaml")


def _v3(**moe) -> dict:
    model = dict(
        arch="olmoe",
        hidden_size=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=80,
        tie_embeddings=False,
        qk_norm="per_head",
        moe=dict(n_experts=6, experts_per_token=2, expert_intermediate_size=48, **moe),
    )
    return model


@pytest.mark.parametrize("qk_norm, shared, dense", [("per_head", 1, 1), ("none", 2, 0), ("per_head", 0, 2)])
def test_total_count_matches_transformers_glm4_moe(qk_norm, shared, dense):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    hf = Glm4MoeForCausalLM(
        Glm4MoeConfig(
            vocab_size=300,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=80,
            moe_intermediate_size=48,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=shared,
            first_k_dense_replace=dense,
            use_qk_norm=qk_norm == "per_head",
            tie_word_embeddings=False,
            pad_token_id=None,
        )
    )
    model = dict(_v3(shared_experts=shared, first_dense_layers=dense, router="sigmoid"), qk_norm=qk_norm)
    counts = count_params(from_plain(ModelRecipe, model), 300)
    assert counts.all == sum(p.numel() for p in hf.parameters())
    # Active by hand: d=64, head_dim 16, kv 2 x 16; a dense layer's SwiGLU 3 x 64 x 80 is all active.
    attn = 64 * 64 * 2 + 2 * 64 * 32
    norms = 2 * 64 + (2 * 16 if qk_norm == "per_head" else 0)
    moe_layer = attn + norms + 64 * 6 + 2 * 3 * 64 * 48 + shared * 3 * 64 * 48
    dense_layer = attn + norms + 3 * 64 * 80
    assert counts.active == dense * dense_layer + (3 - dense) * moe_layer + 64 + 300 * 64


# moe-ds-1b by hand: OLMoE-1B-7B's shape with 7 routed of 64 experts and 1 shared expert per layer.
D, LAYERS, V, SEQ = 2048, 16, 50_304, 2048
ATTN, NORMS, ROUTER, EXPERT = 4 * D * D, 4 * D, D * 64, 3 * D * 1024
TOTAL = LAYERS * (ATTN + NORMS + ROUTER + 64 * EXPERT + EXPERT) + 2 * V * D + D
ACTIVE = LAYERS * (ATTN + NORMS + ROUTER + 7 * EXPERT + EXPERT) + V * D + D  # no input embedding
FLOPS_PER_TOKEN = 6 * ACTIVE + 12 * LAYERS * D * SEQ


def test_moe_ds_1b_counts_plan_and_audit_arithmetic_by_hand():
    cfg = load_experiment(REPO / "experiments/moe-ds-1b.yaml", check_files=False).config
    counts = params_of_config(cfg)
    assert (counts.all, counts.active) == (TOTAL, ACTIVE) == (7_019_825_152, 1_178_994_688)
    assert flops_per_token(cfg, convention_for(cfg)) == FLOPS_PER_TOKEN
    plan = build_plan(cfg, root=REPO)
    assert plan["compute"]["flops_per_token"] == FLOPS_PER_TOKEN and plan["memory"]["params"] == TOTAL
    text = format_plan(plan)
    assert "1,178,994,688" in text and "shared 6,291,456" in text


def test_cpu_tiny_v3_counts_its_dense_first_layer_whole():
    cfg = load_experiment(REPO / "experiments/cpu-tiny-moe-v3.yaml", check_files=False).config
    counts = params_of_config(cfg)
    # the recipe's comment: layer 0 dense 46,208, layer 1 (MoE) 123,520 (49,792 active), tied 4,096 x 64
    assert (counts.all, counts.active) == (431_936, 358_208)
    assert counts.to_dict()["dense_layer"]["total"] == 46_208
