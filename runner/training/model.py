"""Model factory: a transformers Llama (or OLMoE, for `arch: olmoe`) built from the resolved model section.

Owns the mapping from recipe keys to `LlamaConfig` / `OlmoeConfig`, the attention backend check,
activation checkpointing and compilation. Must never touch the network: no hub download, no kernel fetch;
a backend that is not installed is a RunnerError.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, OlmoeConfig, OlmoeForCausalLM

from runner.config.rules import model_vocab_size
from runner.errors import RunnerError
from runner.training.backends import check_attention_backend


def llama_config(cfg) -> LlamaConfig:
    """The LlamaConfig of a resolved experiment (vocab: the tokenizer's, padded per the recipe; context from train)."""
    m = cfg.model
    if m.arch != "llama":
        raise RunnerError(f"unsupported arch {m.arch!r} (only 'llama')", key="model.arch")
    return LlamaConfig(
        vocab_size=model_vocab_size(cfg),
        hidden_size=int(m.hidden_size),
        num_hidden_layers=int(m.n_layers),
        num_attention_heads=int(m.n_heads),
        num_key_value_heads=int(m.n_kv_heads),
        intermediate_size=int(m.intermediate_size),
        tie_word_embeddings=bool(m.tie_embeddings),
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        rms_norm_eps=float(m.rms_norm_eps),
        max_position_embeddings=int(cfg.train.seq_len),
        attention_bias=False,
        mlp_bias=False,
        initializer_range=float(m.init_std),
        eos_token_id=int(cfg.tokenizer.eos_id),
        bos_token_id=None,
        pad_token_id=None,
        use_cache=False,
    )


def olmoe_config(cfg) -> OlmoeConfig:
    """The OlmoeConfig of a resolved `arch: olmoe` experiment. Router losses are the runner's
    (runner.training.experts adds them to the loss), so transformers' own stays off."""
    m, moe = cfg.model, cfg.model.moe
    return OlmoeConfig(
        vocab_size=model_vocab_size(cfg),
        hidden_size=m.hidden_size,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        intermediate_size=moe.expert_intermediate_size,
        num_experts=moe.n_experts,
        num_experts_per_tok=moe.experts_per_token,
        norm_topk_prob=False,
        output_router_logits=False,
        router_aux_loss_coef=moe.router_aux_loss_coef,
        tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        rms_norm_eps=m.rms_norm_eps,
        max_position_embeddings=cfg.train.seq_len,
        attention_bias=False,
        initializer_range=m.init_std,
        eos_token_id=cfg.tokenizer.eos_id,
        bos_token_id=None,
        pad_token_id=None,
        use_cache=False,
    )


def experts_implementation(cfg) -> str:
    """transformers' expert kernel: one grouped matmul on accelerators; on CPU its reference
    per-expert loop, no slower there (olmoe-tiny's forward + backward, side by side: 666 vs 694 ms
    on one loaded core)."""
    return "eager" if cfg.hardware.accelerator == "cpu" else "grouped_mm"


def _build_olmoe(cfg, backend: str) -> OlmoeForCausalLM:
    return OlmoeForCausalLM._from_config(
        copy.deepcopy(olmoe_config(cfg)),
        attn_implementation=backend,
        experts_implementation=experts_implementation(cfg),
        dtype=torch.float32,
    )


def build_model(cfg) -> LlamaForCausalLM | OlmoeForCausalLM:
    """A freshly initialised model (weights from torch's current RNG; seed it before calling)."""
    backend = str(cfg.model.attn_implementation)
    # Refuses an unknown or uninstalled backend before transformers could reach for the hub.
    check_attention_backend(backend, "cpu" if cfg.hardware.accelerator == "cpu" else None)
    if cfg.model.arch == "olmoe":
        model = _build_olmoe(cfg, backend)
    else:
        # from_config writes the chosen backend into the config it is given: hand it a copy.
        model = LlamaForCausalLM._from_config(
            copy.deepcopy(llama_config(cfg)), attn_implementation=backend, dtype=torch.float32
        )
    if bool(cfg.model.activation_checkpointing):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def maybe_compile(model, cfg):
    """torch.compile when the model recipe asks for it (never on by default on CPU tests)."""
    if bool(cfg.model.compile):
        model.compile()
    return model
