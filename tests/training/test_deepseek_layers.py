"""The DeepSeek-style layers the model factory builds (runner.training.moe.deepseek) against
transformers' own: a V3-style model is Glm4MoeForCausalLM by logits (same state dict), a V4-style
block is DeepseekV4SparseMoeBlock's (hash-routed and learned, with the SwiGLU clip and the shared
expert); what Glm4Moe cannot hold is refused naming the keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runner.config.load import load_experiment
from runner.errors import RunnerError
from runner.export.glm4moe import glm4moe_config, glm4moe_state
from runner.training.model import build_model

REPO = Path(__file__).resolve().parents[2]


def _cfg(name: str, **model):
    cfg = load_experiment(REPO / f"experiments/{name}.yaml", check_files=False).config
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model)) if model else cfg


def _move_biases(model) -> None:
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("qk_norm", ["per_head", "none"])
def test_a_v3_style_model_is_glm4_moe_by_its_state_dict(qk_norm):
    from transformers import Glm4MoeForCausalLM

    cfg = _cfg("cpu-tiny-moe-v3", qk_norm=qk_norm)
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    _move_biases(ours)
    theirs = Glm4MoeForCausalLM._from_config(glm4moe_config(cfg), dtype=torch.float32).eval()
    theirs.load_state_dict(glm4moe_state(ours.state_dict(), theirs), strict=True)
    ids = torch.randint(0, cfg.tokenizer.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(input_ids=ids).logits, ours(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert type(ours.model.layers[0].mlp).__name__ == "DenseMLP"  # first_dense_layers: 1


def test_v4_style_blocks_are_deepseek_v4_s_sparse_moe_block():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    cfg = _cfg("cpu-tiny-moe-ds")
    moe = cfg.model.moe
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    _move_biases(ours)
    config = DeepseekV4Config(
        vocab_size=ours.config.vocab_size,
        hidden_size=64,
        moe_intermediate_size=moe.expert_intermediate_size,
        n_routed_experts=moe.n_experts,
        num_experts_per_tok=moe.experts_per_token,
        n_shared_experts=1,
        routed_scaling_factor=moe.routed_scaling_factor,
        swiglu_limit=moe.swiglu_limit,
        num_hidden_layers=2,
        mlp_layer_types=["hash_moe", "moe"],
        num_attention_heads=4,
        head_dim=16,
    )
    ids = torch.randint(0, cfg.tokenizer.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 24, 64)
    for index in (0, 1):
        block = ours.model.layers[index].mlp
        with torch.no_grad():  # weights large enough that the SwiGLU clip at 10 bites
            for name, p in block.named_parameters():
                p.mul_(1.0 if name.startswith("gate.") else 60.0)
            gate_up = hidden.reshape(-1, 64) @ block.experts.gate_up_proj[0].T
            assert float(gate_up.abs().max()) > moe.swiglu_limit
        theirs = DeepseekV4SparseMoeBlock(config, index).eval()
        theirs.load_state_dict(block.state_dict(), strict=True)
        ours.model(input_ids=ids)  # the pre-hook keeps the ids where the hash layer reads them
        with torch.no_grad():
            torch.testing.assert_close(block(hidden), theirs(hidden, ids), rtol=1e-4, atol=1e-4)
    assert "model.layers.0.mlp.gate.tid2eid" in ours.state_dict()


def test_glm4_moe_refuses_v4_parts_naming_each_key():
    with pytest.raises(RunnerError) as err:
        glm4moe_config(_cfg("cpu-tiny-moe-ds"))
    line = str(err.value)
    assert len(line.splitlines()) == 1
    for key in ("model.moe.router", "model.moe.hash_layers", "model.moe.swiglu_limit", "model.qk_norm"):
        assert key in line, line


def test_the_deepseek_layers_compile_whole_with_no_host_sync():
    """Regional compile with fullgraph (maybe_compile's choice for arch olmoe): the hash-routed and the
    learned layer, shared expert and clip included, trace without a break or a host sync, and compute
    what the eager model computes."""
    from test_moe_layer import SyncWatch

    from runner.training.model import maybe_compile

    cfg = _cfg("cpu-tiny-moe-ds", compile=True, compile_scope="regional")
    torch.manual_seed(0)
    eager = build_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=False)))
    torch.manual_seed(0)
    model = build_model(cfg)
    watch = SyncWatch()
    torch._dynamo.reset()
    maybe_compile(model, cfg, backend=watch)
    ids = torch.randint(0, cfg.tokenizer.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    for m in (model, eager):
        m(input_ids=ids).logits.square().mean().backward()
    assert watch.graphs["forward"] >= 1 and watch.graphs["backward"] >= 1 and watch.syncs == []
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
