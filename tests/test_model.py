"""The model factory: the recipe's Llama, exact parameter count, no silent backend fallback."""

from __future__ import annotations

import pytest
import torch

from runner.config.schema import ExperimentSchema, HardwareRecipe, ModelRecipe, TokenizerRecipe, TrainSection
from runner.errors import RunnerError
from runner.planning.flops import params_of_config
from runner.training.model import build_model


def cfg(**model):
    base = {
        "arch": "llama",
        "hidden_size": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "intermediate_size": 64,
        "tie_embeddings": True,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "init_std": 0.02,
        "pad_vocab_multiple": 1,
        "attn_implementation": "sdpa",
        "activation_checkpointing": False,
        "compile": False,
    }
    base.update(model)
    return ExperimentSchema(
        model=ModelRecipe(**base),
        tokenizer=TokenizerRecipe(vocab_size=100, eos_id=0),
        train=TrainSection(seq_len=16),
        hardware=HardwareRecipe(accelerator="cpu"),
    )


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_flops_module(tie):
    c = cfg(tie_embeddings=tie)
    model = build_model(c)
    assert sum(p.numel() for p in model.parameters()) == params_of_config(c).all
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    assert model.config.num_key_value_heads == 2 and model.config.max_position_embeddings == 16


def test_vocab_is_padded_and_init_is_seeded():
    torch.manual_seed(0)
    a = build_model(cfg(pad_vocab_multiple=64))
    torch.manual_seed(0)
    b = build_model(cfg(pad_vocab_multiple=64))
    assert a.config.vocab_size == 128
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_missing_attention_backend_is_an_error_not_a_download():
    with pytest.raises(RunnerError, match="model.attn_implementation"):
        build_model(cfg(attn_implementation="flash_attention_2"))


def test_activation_checkpointing_gives_same_gradients():
    x = torch.randint(0, 100, (2, 16))
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        m = build_model(cfg(activation_checkpointing=ac))
        m.train()
        m(input_ids=x).logits.sum().backward()
        grads.append(m.model.embed_tokens.weight.grad.clone())
    assert m.is_activation_checkpointing
    torch.testing.assert_close(grads[0], grads[1])
