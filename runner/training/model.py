"""Model factory: a transformers Llama (or OLMoE, for `arch: olmoe`) built from the resolved model section.

Owns the mapping from recipe keys to `LlamaConfig` / `OlmoeConfig`, the attention backend check, the
training loss path of Llama (`model.cross_entropy`, computed inside the model's forward so DDP and
FSDP see one call), Liger's kernels (`model.kernels`), activation checkpointing and compilation
(whole model or per decoder layer). A mixture of experts (arch olmoe) is transformers' OLMoE, its
loss computed by the loop with the router probe's losses (runner.training.experts), its MoE blocks
the runner's (runner.training.moe). Must never touch
the network: no hub download, no kernel fetch; a backend or kernel package that is not installed is
a RunnerError.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from runner.config.rules import model_vocab_size
from runner.config.schema import ExperimentSchema, checkpointing_mode
from runner.errors import RunnerError
from runner.training import loss as losses
from runner.training.accelerator import check_attention_backend
from runner.training.checkpointing import checkpoint_kwargs
from runner.training.experts import autocast_experts
from runner.training.hf_models import (
    LlamaConfig,
    LlamaForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    masking_utils,
    modeling_llama,
    modeling_olmoe,
)
from runner.training.moe.deepseek import install_deepseek_layers, uses_deepseek_layers
from runner.training.moe.olmoe import install_moe_layers

# transformers' own RoPE: Liger replaces this module-level function, so the model built last in a
# process decides which one runs (a process trains one model; the bench builds them one at a time).
_HF_ROTARY = modeling_llama.apply_rotary_pos_emb
_HF_CAUSAL_MASK = masking_utils.create_causal_mask


class _CausalWithoutMask:
    """Marks the configs of the models build_model makes: every sequence is one causal block (no
    padding, no cache), so their attention needs no mask (see `_causal_mask`). A class attribute:
    it is never serialized with the config."""

    runner_causal_without_mask = True


class RunnerLlamaConfig(_CausalWithoutMask, LlamaConfig):
    pass


class RunnerOlmoeConfig(_CausalWithoutMask, OlmoeConfig):
    pass


def _causal_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' create_causal_mask, except for the runner's models asked for SDPA with neither a
    mask nor a cache: None, so SDPA runs with is_causal=True (its flash kernel, half the work) under
    torch.compile too. transformers returns None there when eager, but while dynamo traces it skips
    that shortcut and builds a full [B, 1, L, L] mask (SDPA then gets attn_mask, is_causal=False: no
    flash kernel) under whole-model compile; regional compile traces only the layers."""
    config = kwargs.get("config")
    if (
        not args
        and getattr(config, "runner_causal_without_mask", False)
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and kwargs.get("attention_mask") is None
        and kwargs.get("cache", kwargs.get("past_key_values")) is None
    ):
        return None
    return _HF_CAUSAL_MASK(*args, **kwargs)


# Module-level names, as transformers' models look them up at call time; other models keep theirs.
modeling_llama.create_causal_mask = _causal_mask
modeling_olmoe.create_causal_mask = _causal_mask


class RunnerLlama(LlamaForCausalLM):
    """transformers' Llama, whose forward also returns the runner's summed training loss.

    `model(input_ids=x)` is transformers' forward (logits; evaluation uses it);
    `model(input_ids=x, score_at=(rows, cols))` the logits [len(rows), vocab] of those positions alone.
    `model(input_ids=x, loss_targets=y, loss_mask=m)` returns sum over m of -log p(y) in fp32,
    computed by `cross_entropy` (runner.training.loss). Same parameters and names as
    LlamaForCausalLM, so checkpoints are interchangeable."""

    cross_entropy = "plain"
    #: `model(..., score_at=(rows, cols))` gives the logits of those positions only (downstream scoring)
    scores_positions = True

    def forward(self, input_ids=None, loss_targets=None, loss_mask=None, score_at=None, **kwargs):
        if score_at is not None:  # the head on the positions scored, not on every context position
            rows, cols = score_at
            return self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state[rows, cols])
        if loss_targets is None:
            return super().forward(input_ids=input_ids, **kwargs)
        if self.cross_entropy == "plain":
            logits = super().forward(input_ids=input_ids, **kwargs).logits
            return losses.plain_loss_sum(logits, loss_targets, loss_mask)
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        if self.cross_entropy == "chunked":
            return losses.chunked_loss_sum(hidden, self.lm_head.weight, loss_targets, loss_mask)
        return losses.liger_loss_sum(hidden, self.lm_head.weight, loss_targets, loss_mask)


def llama_config(cfg: ExperimentSchema) -> RunnerLlamaConfig:
    """The LlamaConfig of a resolved experiment (vocab: the tokenizer's, padded per the recipe; context from train)."""
    m = cfg.model
    if m.arch != "llama":
        raise RunnerError(f"unsupported arch {m.arch!r} (only 'llama')", key="model.arch")
    return RunnerLlamaConfig(
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


def olmoe_config(cfg: ExperimentSchema) -> RunnerOlmoeConfig:
    """The OlmoeConfig of a resolved `arch: olmoe` experiment. Router losses are the runner's
    (runner.training.experts adds them to the loss), so transformers' own stays off."""
    m, moe = cfg.model, cfg.model.moe
    assert moe is not None  # arch olmoe: validated with its moe section
    return RunnerOlmoeConfig(
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


def experts_implementation(cfg: ExperimentSchema) -> str:
    """transformers' expert kernel, for the model built with transformers' experts (the bench's
    reference row, `_build_olmoe(..., experts=...)`): one grouped matmul on accelerators; on CPU
    its reference per-expert loop."""
    return "eager" if cfg.hardware.accelerator == "cpu" else "grouped_mm"


def _build_olmoe(cfg: ExperimentSchema, backend: str, experts: str | None = None) -> OlmoeForCausalLM:
    """OLMoE in fp32. By default (`experts` None) each decoder layer's MoE block is the runner's
    (runner.training.moe: grouped matmuls on every device, the expert weights cast to the autocast
    dtype inside the layer). `experts` "eager" or "grouped_mm" keeps transformers' block with that
    experts implementation instead (the path trained before; its grouped experts run in the
    autocast dtype under autocast: runner.training.experts.autocast_experts). Same initial weights,
    same state-dict keys either way."""
    model = OlmoeForCausalLM._from_config(
        copy.deepcopy(olmoe_config(cfg)),
        attn_implementation=backend,
        experts_implementation=experts or experts_implementation(cfg),
        dtype=torch.float32,
    )
    if experts is None:
        install_moe_layers(model)
    else:
        autocast_experts(model)
    return model


def build_model(cfg: ExperimentSchema) -> RunnerLlama | OlmoeForCausalLM:
    """A freshly initialised model (weights from torch's current RNG; seed it before calling): the
    runner's Llama (its loss inside the forward), or transformers' OLMoE for arch olmoe."""
    backend = cfg.model.attn_implementation
    # Refuses an unknown or uninstalled backend before transformers could reach for the hub.
    check_attention_backend(backend, "cpu" if cfg.hardware.accelerator == "cpu" else None)
    model: RunnerLlama | OlmoeForCausalLM
    if cfg.model.arch == "olmoe":
        if cfg.model.kernels != "none" or cfg.model.cross_entropy != "plain":
            raise RunnerError(
                "arch olmoe runs transformers' OLMoE: kernels none and cross_entropy plain only",
                key="model.kernels" if cfg.model.kernels != "none" else "model.cross_entropy",
            )
        model = _build_olmoe(cfg, backend)
        if uses_deepseek_layers(cfg):  # DeepSeek-style routers, shared experts, dense first layers
            install_deepseek_layers(model, cfg)
    else:
        # from_config writes the chosen backend into the config it is given: hand it a copy.
        config = llama_config(cfg)
        llama = RunnerLlama._from_config(copy.deepcopy(config), attn_implementation=backend, dtype=torch.float32)
        llama.cross_entropy = cfg.model.cross_entropy
        apply_kernels(llama, cfg.model.kernels)
        model = llama
    mode = checkpointing_mode(cfg.model.activation_checkpointing)
    if mode != "none":
        enable_activation_checkpointing(model, mode)
    return model


def enable_activation_checkpointing(model: Any, mode: str = "full") -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant): all of them
    (`full`), or all but the matmul and attention outputs (`selective`, runner.training.checkpointing).
    transformers 5.2x names it `activation_checkpointing_enable` (`gradient_checkpointing_enable`
    its deprecated alias); 5.17, the GPU image's, has only `gradient_checkpointing_enable`: whichever exists."""
    kwargs = checkpoint_kwargs(mode)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_activation_checkpointing(model: Any) -> bool:
    """Whether `enable_activation_checkpointing` is on, under either transformers' name."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(on if on is not None else model.is_gradient_checkpointing)


def apply_kernels(model: LlamaForCausalLM, kernels: str) -> None:
    """Liger's RMSNorm and SwiGLU on this model's modules, and its RoPE for the process; `none`
    puts transformers' RoPE back (a model built earlier in the process may have swapped it)."""
    if kernels == "none":
        modeling_llama.apply_rotary_pos_emb = _HF_ROTARY
        return
    if kernels != "liger":
        raise RunnerError(f"unknown kernels {kernels!r}; one of none, liger", key="model.kernels")
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: PLC0415  (optional, GPU only)
    except Exception as exc:  # not installed, or a build that fails to import
        raise RunnerError(
            f"liger-kernel is not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "nothing is downloaded: pip install liger-kernel, or set model.kernels: none",
            key="model.kernels",
        ) from None
    classes = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    apply_liger_kernel_to_llama(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
    )
    # Liger also swaps the module's classes: later models of kernels none must get transformers' own.
    modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP = classes  # type: ignore[misc]


def maybe_compile(model: torch.nn.Module, cfg: ExperimentSchema, *, backend: Any = "inductor") -> torch.nn.Module:
    """torch.compile as the model recipe asks: the whole model as one graph, or each decoder layer
    alone (`compile_scope: regional`: the 24 layers of 1p3b share one compiled graph, so compiling
    costs one layer's time, not the model's). Never on by default on CPU tests. `backend`: torch's
    (tests pass a graph-inspecting one; the recipe's mode applies to inductor only)."""
    if not cfg.model.compile:
        return model
    options: dict[str, Any] = {"mode": cfg.model.compile_mode} if backend == "inductor" else {"backend": backend}
    if cfg.model.compile_scope == "regional":
        inner: Any = getattr(model, "module", model)  # under DDP the layers are the wrapped model's
        # A MoE layer (the runner's, runner.training.moe) traces as one graph: fullgraph, so a graph
        # break is an error, not a silent split around an uncompiled piece.
        fullgraph = cfg.model.arch == "olmoe"
        # Under activation checkpointing the layer's forward is traced inside the checkpoint
        # operator, where a write to an outer object (the router probe's, transformers' kernel
        # hub context) would have to be replayed by the recomputation: it must not be (the
        # probe is disarmed by then), as eager checkpointing does not count it either.
        if fullgraph and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        for layer in inner.model.layers:
            layer.compile(fullgraph=fullgraph, **options)
        return model
    model.compile(**options)
    return model
