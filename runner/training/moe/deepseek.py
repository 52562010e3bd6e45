"""DeepSeek-style decoder layers inside transformers' OLMoE: what `model.moe`'s DeepSeek keys build.

Owns, for a model whose recipe sets them (`uses_deepseek_layers`), the swap of each decoder layer's
parts after transformers built and initialised OlmoeForCausalLM:
- MLP of the first `first_dense_layers` layers: a dense SwiGLU (`DenseMLP`, `gate_proj`/`up_proj`/
  `down_proj`) of `model.intermediate_size`;
- MLP of the others: `DeepseekMoE`, the runner's MoELayer (runner.training.moe.layer: the same fast
  routed path) with a DeepSeek router (runner.training.moe.ds_routers: sigmoid / sqrt-softplus
  top-k with the balancing bias, or the hash router in the first `hash_layers` of them), experts
  clipped by `swiglu_limit` (`ClippedGroupedExperts`), plus `shared_experts` (one SwiGLU of
  shared_experts x shared_expert_intermediate_size, every position through it, as DeepSeek's);
- q/k norms: OLMoE's over all heads (`qk_norm` full), per head (`PerHeadRMSNorm`) or none.
The parameter names are transformers' Glm4Moe ones (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, `mlp.shared_experts.*_proj.weight`, a dense
layer's `mlp.*_proj.weight`, `self_attn.q_norm.weight` [head_dim]), so a V3-style model exports to
Glm4MoeForCausalLM by its state dict (runner.export.glm4moe). A hash router's table is a persistent
buffer (`mlp.gate.tid2eid`): the checkpoint carries it.
A hash router needs each position's token id: a forward pre-hook on the decoder stack keeps the
input ids of the current forward where the hash layers read them (`TokenIds`).
Never: changes an OLMoE model (no DeepSeek key set: `install_deepseek_layers` is not called).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from runner.config.schema import ExperimentSchema
from runner.training.moe.ds_routers import HashRouter, ScoreTopKRouter, hash_table
from runner.training.moe.layer import GroupedExperts, MoELayer, compute_dtype, grouped_mm
from runner.training.moe.routers import SoftmaxTopKRouter


def uses_deepseek_layers(cfg: ExperimentSchema) -> bool:
    """Whether the model recipe sets any DeepSeek-style key away from OLMoE's (or q/k norms other than OLMoE's)."""
    moe = cfg.model.moe
    if cfg.model.arch != "olmoe" or moe is None:
        return False
    return (
        moe.router != "softmax"
        or moe.balancing != "aux_loss"
        or moe.sequence_aux_loss_coef > 0
        or moe.shared_experts > 0
        or moe.routed_scaling_factor != 1.0
        or moe.norm_topk_prob
        or moe.first_dense_layers > 0
        or moe.hash_layers > 0
        or moe.swiglu_limit is not None
        or cfg.model.qk_norm not in (None, "full")
    )


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) x up, with DeepSeek-V4's clip (gate at most `limit`, up within +-limit) when set."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class DenseMLP(nn.Module):
    """A SwiGLU MLP under Glm4MoeMLP's names (a dense first layer, or the shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class ClippedGroupedExperts(GroupedExperts):
    """GroupedExperts with DeepSeek-V4's SwiGLU clip (DeepseekV4Experts._apply_gate)."""

    def __init__(self, n_experts: int, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__(n_experts, hidden_size, intermediate_size)
        self.limit = float(limit)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x, self.gate_up_proj)
        gate_up = grouped_mm(x.to(dtype), self.gate_up_proj.to(dtype).transpose(-2, -1), offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return grouped_mm(_swiglu(gate, up, self.limit), self.down_proj.to(dtype).transpose(-2, -1), offsets)


class TokenIds:
    """The input ids of the model's current forward, for the hash routers (set by a pre-hook)."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None


class DeepseekMoE(MoELayer):
    """Routed experts (the MoELayer's path) plus the shared experts every position passes through."""

    def __init__(
        self, router: nn.Module, experts: GroupedExperts, shared: DenseMLP | None, tokens: TokenIds | None = None
    ):
        super().__init__(cast(Any, router), experts)
        self.shared_experts = shared
        self._tokens = tokens  # only a hash-routed layer reads the token ids

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        if token_ids is None and self._tokens is not None:
            token_ids = self._tokens.ids
        out = super().forward(hidden, token_ids)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


class PerHeadRMSNorm(nn.Module):
    """RMSNorm of each head's slice of a [..., heads x head_dim] projection, one gain of head_dim
    shared by the heads (Glm4Moe's q_norm / k_norm with use_qk_norm), OLMoE's arithmetic."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.head_dim, self.variance_epsilon = head_dim, eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        h = x.reshape(*shape[:-1], -1, self.head_dim).to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h.to(dtype)).reshape(shape)


def _router(cfg: ExperimentSchema, hidden: int, moe_index: int, vocab: int) -> nn.Module:
    moe = cfg.model.moe
    assert moe is not None
    n, k = moe.n_experts, moe.experts_per_token
    score_args = dict(norm_topk_prob=moe.norm_topk_prob, routed_scaling_factor=moe.routed_scaling_factor)
    if moe_index < moe.hash_layers:
        table = hash_table(vocab, n, k, cfg.seed, str(cfg.tokenizer.sha256), moe_index)
        return HashRouter(hidden, n, k, moe.router, table=table, **score_args)
    if moe.router == "softmax" and moe.routed_scaling_factor == 1.0 and moe.balancing == "aux_loss":
        return SoftmaxTopKRouter(hidden, n, k, moe.norm_topk_prob)
    return ScoreTopKRouter(hidden, n, k, moe.router, **score_args)


@torch.no_grad()
def _init(module: nn.Module, std: float) -> None:
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or isinstance(module, PerHeadRMSNorm):
            continue
        p.normal_(0.0, std)


def install_deepseek_layers(model: nn.Module, cfg: ExperimentSchema) -> TokenIds:
    """Every decoder layer of a freshly built OlmoeForCausalLM as the recipe's DeepSeek keys ask (in
    place; new parts initialised from torch's RNG, normal(0, init_std) like transformers'). Returns
    the token-id holder the hash layers read."""
    m, moe = cfg.model, cfg.model.moe
    assert moe is not None
    inner: Any = model
    config = inner.config
    hidden, head_dim = m.hidden_size, m.hidden_size // m.n_heads
    tokens = TokenIds()
    layer: Any
    for index, layer in enumerate(inner.model.layers):
        attn = layer.self_attn
        if m.qk_norm == "none":
            attn.q_norm, attn.k_norm = nn.Identity(), nn.Identity()
        elif m.qk_norm == "per_head":
            attn.q_norm = PerHeadRMSNorm(head_dim, m.rms_norm_eps)
            attn.k_norm = PerHeadRMSNorm(head_dim, m.rms_norm_eps)
        if index < moe.first_dense_layers:
            layer.mlp = DenseMLP(hidden, m.intermediate_size)
            _init(layer.mlp, m.init_std)
            continue
        moe_index = index - moe.first_dense_layers
        block: Any = layer.mlp
        router = _router(cfg, hidden, moe_index, config.vocab_size)
        cast(Any, router).weight = block.gate.weight  # OLMoE's initialised router weight, the same Parameter
        if moe.swiglu_limit is None:
            experts = GroupedExperts(moe.n_experts, hidden, moe.expert_intermediate_size)
        else:
            experts = ClippedGroupedExperts(moe.n_experts, hidden, moe.expert_intermediate_size, moe.swiglu_limit)
        experts.gate_up_proj = block.experts.gate_up_proj
        experts.down_proj = block.experts.down_proj
        shared = None
        if moe.shared_experts:
            shared = DenseMLP(hidden, moe.shared_experts * moe.shared_intermediate_size, moe.swiglu_limit)
            _init(shared, m.init_std)
        layer.mlp = DeepseekMoE(router, experts, shared, tokens if isinstance(router, HashRouter) else None)

    def keep_ids(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens.ids = ids

    inner.model.register_forward_pre_hook(keep_ids, with_kwargs=True)
    return tokens


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every mixture-of-experts layer, in layer order (dense layers have none)."""
    inner: Any = model
    return [layer.mlp.gate for layer in inner.model.layers if hasattr(layer.mlp, "gate")]
