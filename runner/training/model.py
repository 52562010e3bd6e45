"""Model factory: a transformers Llama built from the resolved model section.

Owns the mapping from recipe keys to `LlamaConfig`, the attention backend check, activation
checkpointing and compilation. Must never touch the network: no hub download, no kernel fetch;
a backend that is not installed is a RunnerError.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from runner.config.rules import model_vocab_size
from runner.config.schema import ExperimentSchema
from runner.errors import RunnerError
from runner.training.backends import check_attention_backend


def llama_config(cfg: ExperimentSchema) -> LlamaConfig:
    """The LlamaConfig of a resolved experiment (vocab: the tokenizer's, padded per the recipe; context from train)."""
    m = cfg.model
    if m.arch != "llama":
        raise RunnerError(f"unsupported arch {m.arch!r} (only 'llama')", key="model.arch")
    return LlamaConfig(
        vocab_size=model_vocab_size(cfg),
        hidden_size=m.hidden_size,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        intermediate_size=m.intermediate_size,
        tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        rms_norm_eps=m.rms_norm_eps,
        max_position_embeddings=cfg.train.seq_len,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=m.init_std,
        eos_token_id=cfg.tokenizer.eos_id,
        bos_token_id=None,
        pad_token_id=None,
        use_cache=False,
    )


def build_model(cfg: ExperimentSchema) -> LlamaForCausalLM:
    """A freshly initialised Llama (weights from torch's current RNG; seed it before calling)."""
    backend = cfg.model.attn_implementation
    # Refuses an unknown or uninstalled backend before transformers could reach for the hub.
    check_attention_backend(backend, "cpu" if cfg.hardware.accelerator == "cpu" else None)
    config = llama_config(cfg)
    # from_config writes the chosen backend into the config it is given: hand it a copy.
    model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=backend, dtype=torch.float32)
    if cfg.model.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def maybe_compile(model: torch.nn.Module, cfg: ExperimentSchema) -> torch.nn.Module:
    """torch.compile when the model recipe asks for it (never on by default on CPU tests)."""
    if cfg.model.compile:
        model.compile()
    return model
