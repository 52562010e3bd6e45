"""Export of a DeepSeek-V3-style mixture of experts as transformers' Glm4MoeForCausalLM.

Owns: which runs Glm4Moe can hold (`unexportable`: its router is V3's line for line: sigmoid
scores, the balancing bias on the choice only, group top-k (here one group), norm_topk_prob, routed
scaling; its q/k norms are per head or none; its shared experts one MLP of moe_intermediate_size x
n_shared_experts; dense first layers via first_k_dense_replace), the config that says so
(`glm4moe_config`: n_group = topk_group = 1, partial_rotary_factor 1.0, whose default is 0.5), and the
state dict (the runner's DeepSeek layers already carry Glm4Moe's names: runner.training.moe.deepseek).
A run with parts only DeepSeek-V4 has (sqrt-softplus scores, hash-routed layers, the SwiGLU clip),
OLMoE's full-width q/k norms, or softmax routing is refused in one line naming the keys.
Never: changes a weight (the folder is checked against the run's model by logits, as every export).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Glm4MoeConfig

from runner.config.rules import model_vocab_size
from runner.config.schema import ExperimentSchema
from runner.errors import RunnerError


def unexportable(cfg: ExperimentSchema) -> list[str]:
    """`key (value)` of every setting Glm4MoeForCausalLM cannot express; [] when it can hold the run."""
    m, moe = cfg.model, cfg.model.moe
    assert moe is not None
    keys = []
    if moe.router != "sigmoid":
        keys.append(f"model.moe.router ({moe.router}; Glm4Moe scores by sigmoid)")
    if moe.hash_layers:
        keys.append(f"model.moe.hash_layers ({moe.hash_layers})")
    if moe.swiglu_limit is not None:
        keys.append(f"model.moe.swiglu_limit ({moe.swiglu_limit})")
    if m.qk_norm in (None, "full"):
        keys.append("model.qk_norm (full: OLMoE's over all heads; Glm4Moe's are per_head or none)")
    width = moe.shared_experts * moe.shared_intermediate_size
    if width % moe.expert_intermediate_size:
        keys.append(
            f"model.moe.shared_expert_intermediate_size ({width} shared width is no multiple of "
            f"expert_intermediate_size {moe.expert_intermediate_size})"
        )
    return keys


def glm4moe_config(cfg: ExperimentSchema) -> Glm4MoeConfig:
    """The Glm4MoeConfig of a V3-style run; a RunnerError naming the keys it cannot hold."""
    m, moe = cfg.model, cfg.model.moe
    assert moe is not None
    keys = unexportable(cfg)
    if keys:
        raise RunnerError(
            "transformers' Glm4MoeForCausalLM cannot hold " + ", ".join(keys) + ": refusing to export",
            key=keys[0].split(" ")[0],
        )
    # Glm4MoeConfig takes these as kwargs only: full rotary (its default is half), no MTP layers
    extra: dict[str, Any] = {
        "partial_rotary_factor": 1.0,
        "num_nextn_predict_layers": 0,
        "head_dim": m.hidden_size // m.n_heads,
    }
    return Glm4MoeConfig(
        vocab_size=model_vocab_size(cfg),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        moe_intermediate_size=moe.expert_intermediate_size,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.train.seq_len,
        initializer_range=m.init_std,
        rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta, "partial_rotary_factor": 1.0},
        attention_bias=False,
        n_routed_experts=moe.n_experts,
        num_experts_per_tok=moe.experts_per_token,
        n_shared_experts=moe.shared_experts * moe.shared_intermediate_size // moe.expert_intermediate_size,
        routed_scaling_factor=moe.routed_scaling_factor,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=moe.first_dense_layers,
        norm_topk_prob=moe.norm_topk_prob,
        use_qk_norm=m.qk_norm == "per_head",
        eos_token_id=cfg.tokenizer.eos_id,
        bos_token_id=None,
        pad_token_id=None,
        use_cache=False,
        **extra,
    )


def glm4moe_state(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """The run's state dict as `model` (a Glm4MoeForCausalLM) loads it strictly: the names are the
    same; a model without shared experts has Glm4Moe's empty (zero-width) shared MLP added."""
    out = dict(state)
    for name, tensor in model.state_dict().items():
        if name not in out and tensor.numel() == 0:
            out[name] = tensor
    return out
