"""The model factory: the recipe's Llama, exact parameter count, no silent backend fallback."""

from __future__ import annotations

import pytest
import torch

from runner.config.data_recipes import TokenizerRecipe
from runner.config.schema import ExperimentSchema, HardwareRecipe, ModelRecipe, TrainSection
from runner.errors import RunnerError
from runner.planning.flops import params_of_config
from runner.training.model import build_model, is_activation_checkpointing, maybe_compile


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
    assert is_activation_checkpointing(m)
    torch.testing.assert_close(grads[0], grads[1])


def _loss_and_grads(model, x, y, mask):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=x, loss_targets=y, loss_mask=mask)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False])
def test_chunked_cross_entropy_gives_the_plain_loss_and_gradients(tie):
    x, y = torch.randint(0, 100, (3, 16)), torch.randint(0, 100, (3, 16))
    mask = torch.rand(3, 16) > 0.2  # some targets do not count
    results = {}
    for ce in ("plain", "chunked"):
        torch.manual_seed(0)
        results[ce] = _loss_and_grads(build_model(cfg(tie_embeddings=tie, cross_entropy=ce)), x, y, mask)
    (loss_p, grads_p), (loss_c, grads_c) = results["plain"], results["chunked"]
    # the same sum the trainer divides by the global useful count, from transformers' own logits
    torch.manual_seed(0)
    reference = build_model(cfg(tie_embeddings=tie))
    logits = reference(input_ids=x).logits.float()
    by_hand = (
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") * mask.flatten()
    ).sum()
    torch.testing.assert_close(loss_p, by_hand.detach())
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-6, atol=1e-5)
    assert grads_p.keys() == grads_c.keys()
    for name, g in grads_p.items():  # fp32 summation order differs: tolerance relative to the tensor's scale
        torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)


def test_chunked_cross_entropy_under_bf16_autocast_stays_within_bf16_tolerance():
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    results = {}
    for ce in ("plain", "chunked"):
        torch.manual_seed(0)
        model = build_model(cfg(cross_entropy=ce))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[ce] = _loss_and_grads(model, x, y, mask)
    torch.testing.assert_close(results["chunked"][0], results["plain"][0], rtol=1e-2, atol=1e-2)
    for name, g in results["plain"][1].items():
        torch.testing.assert_close(results["chunked"][1][name], g, rtol=5e-2, atol=2e-3, msg=name)


def test_regional_compile_compiles_each_decoder_layer_and_not_the_model():
    model = maybe_compile(
        build_model(cfg(compile=True, compile_scope="regional")), cfg(compile=True, compile_scope="regional")
    )
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert model._compiled_call_impl is None
    whole = maybe_compile(build_model(cfg(compile=True)), cfg(compile=True))
    assert whole._compiled_call_impl is not None
    assert all(layer._compiled_call_impl is None for layer in whole.model.layers)
    off = maybe_compile(build_model(cfg()), cfg())
    assert off._compiled_call_impl is None


def test_liger_kernels_without_the_package_are_an_error_not_a_download(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_liger(name, *args, **kwargs):
        if name.startswith("liger_kernel"):
            raise ImportError("No module named 'liger_kernel'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_liger)
    with pytest.raises(RunnerError, match="liger-kernel is not importable") as err:
        build_model(cfg(kernels="liger"))
    assert err.value.key == "model.kernels"
