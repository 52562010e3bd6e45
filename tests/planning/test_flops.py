"""Parameter counts match transformers' Llama exactly; FLOPs per token match hand counts."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from runner.config.data_recipes import TokenizerRecipe
from runner.config.schema import ExperimentSchema, ModelRecipe, TrainSection
from runner.errors import RunnerError
from runner.planning.flops import DEFAULT_CONVENTION, Convention, count_params, flops_per_token, params_of_config


def tiny_model(**kw):
    m = dict(
        arch="llama",
        hidden_size=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=160,
        tie_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    )
    m.update(kw)
    return ModelRecipe(**m)


def hf_numel(model, vocab):
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=model.hidden_size,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        intermediate_size=model.intermediate_size,
        tie_word_embeddings=model.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        rms_norm_eps=model.rms_norm_eps,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = LlamaForCausalLM(hf_cfg)
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_count_matches_transformers_llama(tied, n_kv_heads):
    model = tiny_model(tie_embeddings=tied, n_kv_heads=n_kv_heads)
    counts = count_params(model, 300)
    assert counts.all == hf_numel(model, 300)


def test_hand_count_untied_and_tied():
    # d=64, L=3, heads 4 (head_dim 16), kv 2 -> kv_dim 32, ff=160, V=300
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64  # 12288
    mlp = 3 * 64 * 160  # 30720
    layer = attn + mlp + 2 * 64  # 43136
    body = 3 * layer + 64  # 129472
    emb = 300 * 64  # 19200
    untied = count_params(tiny_model(), 300)
    assert untied.layer.total == layer
    assert untied.all == emb + body + emb
    assert untied.non_embedding == body + emb
    tied = count_params(tiny_model(tie_embeddings=True), 300)
    assert tied.all == emb + body  # shared matrix counted once
    assert tied.non_embedding == body + emb  # the head is counted, the lookup is not


def test_flops_per_token_conventions_by_hand():
    cfg = ExperimentSchema(
        model=tiny_model(), tokenizer=TokenizerRecipe(vocab_size=300), train=TrainSection(seq_len=128)
    )
    counts = params_of_config(cfg)
    n_all, n_ne = counts.all, counts.non_embedding
    attn = 12 * 3 * 64 * 128
    assert flops_per_token(cfg, Convention("6N", "all")) == 6 * n_all
    assert flops_per_token(cfg, Convention("6N", "non_embedding")) == 6 * n_ne
    assert flops_per_token(cfg, Convention("6N+attn", "non_embedding")) == 6 * n_ne + attn
    assert (
        flops_per_token(cfg, Convention("6N+attn", "non_embedding", attention_causal_half=True)) == 6 * n_ne + attn / 2
    )
    hfu = Convention("6N+attn", "all", recompute_counted=True)
    assert hfu.kind == "HFU"
    assert flops_per_token(cfg, hfu) == 8 * n_all + attn * 8 / 6
    assert flops_per_token(cfg, Convention("6N", "all", recompute_counted=True)) == 8 * n_all


def test_convention_round_trips_and_refuses_unknown_values():
    d = DEFAULT_CONVENTION.to_dict()
    assert set(d) == {"flops_formula", "params_counted", "attention_causal_half", "recompute_counted"}
    assert Convention.from_dict(d) == DEFAULT_CONVENTION
    with pytest.raises(RunnerError, match="flops_formula"):
        Convention(flops_formula="6ND")


def test_bad_shapes_name_the_key():
    with pytest.raises(RunnerError, match="model.n_heads"):
        count_params(tiny_model(n_heads=5), 300)
    with pytest.raises(RunnerError, match="model.n_kv_heads"):
        count_params(tiny_model(n_kv_heads=3), 300)
    with pytest.raises(RunnerError, match="tokenizer.vocab_size"):
        params_of_config(ExperimentSchema(model=tiny_model(), tokenizer=TokenizerRecipe()))


def test_padded_vocab_rows_are_counted():
    cfg = ExperimentSchema(model=tiny_model(pad_vocab_multiple=64), tokenizer=TokenizerRecipe(vocab_size=300))
    assert params_of_config(cfg).embedding == 320 * 64
    assert params_of_config(cfg).all == count_params(tiny_model(), 320).all
