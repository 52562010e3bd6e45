"""The runner's MoE layer inside transformers' OLMoE: each decoder layer's `mlp` replaced by a
runner.training.moe.layer.MoELayer holding the same Parameter objects under the same names.

Owns the swap (after transformers built and initialised the model, so the initial weights, the RNG
draws and every state-dict key are what they were) and the router-logits tap that keeps
transformers' `output_router_logits=True` (its `router_logits` and `aux_loss`) working: transformers
records the output of every `OlmoeTopKRouter` module, so the tap is one, holding no parameter.
Never: changes a parameter's value, name or shape, or the router's decisions.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from runner.training.hf_models import modeling_olmoe
from runner.training.moe.layer import GroupedExperts, MoELayer
from runner.training.moe.routers import SoftmaxTopKRouter

# transformers >= 5 records its OlmoeTopKRouter's outputs; a version without it records nothing here.
_RECORDED_ROUTER: type[nn.Module] = getattr(modeling_olmoe, "OlmoeTopKRouter", nn.Module)


class RouterLogitsTap(_RECORDED_ROUTER):  # type: ignore[misc,valid-type]
    """Returns the router logits it is given. An OlmoeTopKRouter by class only (no weight): what
    transformers' output recorder hooks to collect `router_logits`."""

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def runner_moe_block(block: Any, config: Any) -> MoELayer:
    """An OlmoeSparseMoeBlock's parameters (the same objects) in a MoELayer with OLMoE's router."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"the runner's experts are SwiGLU; OLMoE config has hidden_act {config.hidden_act!r}")
    n_experts, hidden = block.gate.weight.shape
    # Made on the meta device (no memory): their parameters are replaced by the block's at once.
    router = SoftmaxTopKRouter(hidden, n_experts, config.num_experts_per_tok, bool(config.norm_topk_prob), "meta")
    router.weight = block.gate.weight
    intermediate = block.experts.down_proj.shape[-1]
    experts = GroupedExperts(n_experts, hidden, intermediate, "meta")
    experts.gate_up_proj = block.experts.gate_up_proj
    experts.down_proj = block.experts.down_proj
    return MoELayer(router, experts, logits_tap=RouterLogitsTap())


def install_moe_layers(model: nn.Module) -> None:
    """Every decoder layer of an OlmoeForCausalLM runs the runner's MoELayer (in place)."""
    inner: Any = model
    for layer in cast(nn.ModuleList, inner.model.layers):
        layer.mlp = runner_moe_block(layer.mlp, inner.config)
