"""The DeepSeek-style routers against transformers' own (Glm4MoeTopkRouter, DeepseekV4TopKRouter,
DeepseekV4HashRouter), the hash table's determinism, and the balancing bias update (torch and the
audit's numpy replay agree bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.training.moe.ds_routers import (
    HashRouter,
    ScoreTopKRouter,
    hash_table,
    sequence_balance_loss,
    update_bias,
)
from runner.training.routing_record import next_bias

H, E, K, T, V = 32, 8, 2, 40, 50


def _by_expert(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, weights) of each row sorted by expert id: topk(sorted=False) may order them either way."""
    order = experts.argsort(dim=-1)
    return experts.gather(1, order), weights.gather(1, order)


def _same(ours, theirs_weights, theirs_experts):
    e1, w1 = _by_expert(ours.weights, ours.experts)
    e2, w2 = _by_expert(theirs_weights, theirs_experts)
    assert torch.equal(e1, e2)
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-7)


def _bias() -> torch.Tensor:
    return torch.linspace(-0.3, 0.3, E)[torch.randperm(E, generator=torch.Generator().manual_seed(1))]


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_router_is_glm4_moe_s_with_one_group(norm):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    torch.manual_seed(0)
    config = Glm4MoeConfig(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=1,
        topk_group=1,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    theirs = Glm4MoeTopkRouter(config)
    ours = ScoreTopKRouter(H, E, K, "sigmoid", norm_topk_prob=norm, routed_scaling_factor=2.5)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.copy_(_bias())
    ours.load_state_dict(theirs.state_dict())  # the same names: weight, e_score_correction_bias
    hidden = torch.randn(T, H)
    logits, weights, experts = theirs(hidden)
    out = ours(hidden)
    torch.testing.assert_close(out.logits, logits)
    _same(out, weights, experts)
    # The bias moved the choice (so the comparison covered it) but not the weights' source.
    plain = ScoreTopKRouter(H, E, K, "sigmoid", norm_topk_prob=norm, routed_scaling_factor=2.5)
    plain.weight.data.copy_(theirs.weight)
    assert not torch.equal(plain(hidden).experts.sort(-1).values, out.experts.sort(-1).values)


def _v4_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=K,
        vocab_size=V,
        routed_scaling_factor=1.5,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
    )


def test_sqrt_softplus_router_is_deepseek_v4_s():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    torch.manual_seed(0)
    theirs = DeepseekV4TopKRouter(_v4_config())
    ours = ScoreTopKRouter(H, E, K, "sqrt_softplus", norm_topk_prob=True, routed_scaling_factor=1.5)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.copy_(_bias())
    ours.load_state_dict(theirs.state_dict())
    hidden = torch.randn(T, H)
    logits, weights, experts = theirs(hidden)
    out = ours(hidden)
    torch.testing.assert_close(out.logits, logits)
    _same(out, weights, experts)


def test_hash_router_is_deepseek_v4_s_with_the_runner_s_table():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    torch.manual_seed(0)
    table = hash_table(V, E, K, seed=1234, tokenizer_sha256="ab" * 32, layer=0)
    theirs = DeepseekV4HashRouter(_v4_config())
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.tid2eid.copy_(table)
    ours = HashRouter(H, E, K, "sqrt_softplus", norm_topk_prob=True, routed_scaling_factor=1.5, table=table)
    ours.load_state_dict(theirs.state_dict())
    hidden, ids = torch.randn(T, H), torch.randint(0, V, (T,))
    logits, weights, experts = theirs(hidden, ids)
    out = ours(hidden, ids)
    assert torch.equal(out.experts, experts) and torch.equal(out.experts, table[ids])
    torch.testing.assert_close(out.weights, weights, rtol=1e-6, atol=1e-7)
    assert "tid2eid" in ours.state_dict()  # travels with the checkpoint


def test_hash_table_is_a_pure_function_of_seed_tokenizer_and_layer():
    a = hash_table(V, E, K, 7, "ab" * 32, 0)
    assert a.shape == (V, K) and a.dtype == torch.int64 and int(a.min()) >= 0 and int(a.max()) < E
    assert all(len(set(row)) == K for row in a.tolist())  # k distinct experts per token
    assert torch.equal(a, hash_table(V, E, K, 7, "ab" * 32, 0))
    for other in (
        hash_table(V, E, K, 8, "ab" * 32, 0),
        hash_table(V, E, K, 7, "cd" * 32, 0),
        hash_table(V, E, K, 7, "ab" * 32, 1),
    ):
        assert not torch.equal(a, other)


def test_bias_update_follows_the_sign_of_the_load_and_the_numpy_replay_bit_for_bit():
    bias = torch.zeros(4)
    load = torch.tensor([10, 30, 20, 20])  # mean 20: under, over, even, even
    update_bias(bias, load, 0.001)
    assert bias.tolist() == pytest.approx([0.001, -0.001, 0.0, 0.0])
    rng = np.random.default_rng(0)
    b_t, b_np = torch.zeros(E), np.zeros(E, dtype=np.float32)
    for _ in range(200):
        step = rng.integers(0, 1000, E)
        update_bias(b_t, torch.from_numpy(step), 0.001)
        b_np = next_bias(b_np, step, 0.001)
    assert np.array_equal(b_t.numpy(), b_np) and b_np.dtype == np.float32


def test_sequence_balance_loss_is_one_when_uniform_and_larger_when_skewed():
    seq_len = 8
    uniform_logits = torch.zeros(2 * seq_len, 4)
    spread = torch.tensor([[0, 1], [2, 3]] * seq_len)  # every expert twice per pair of positions
    assert sequence_balance_loss(uniform_logits, spread, seq_len, "sigmoid").item() == pytest.approx(1.0)
    skewed = torch.tensor([[0, 1]] * (2 * seq_len))
    logits = torch.tensor([[3.0, 3.0, -3.0, -3.0]]).repeat(2 * seq_len, 1)
    assert sequence_balance_loss(logits, skewed, seq_len, "sigmoid").item() > 1.5
