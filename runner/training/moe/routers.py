"""Routers of the runner's mixture-of-experts layer (runner.training.moe.layer): small modules that
decide, per input position, which k experts it goes to and with what weight.

The interface every router keeps (other routers are added on it; the layer relies on nothing else):

    class Router(nn.Module):
        n_experts: int          # E
        top_k: int              # k
        def forward(self, hidden: Tensor[T, H], token_ids: Tensor[T] | None = None) -> RouterOutput

    RouterOutput(weights, experts, logits), a NamedTuple:
        weights  Tensor[T, k] float: the weight of each chosen expert's output, already normalised or
                 scaled as the router defines (the layer multiplies and sums, nothing more)
        experts  Tensor[T, k] long: the chosen experts, ids in [0, E)
        logits   Tensor[T, E]: the raw router logits (the router losses of runner.training.experts
                 and the router probe read them; transformers' `output_router_logits` returns them)

`token_ids` are the input ids of the T positions (a hash router needs them); a router that does not
use them ignores them. T is the flattened [sequences x positions] order of the layer's input: row r
is position r % L of sequence r // L. A router holds its parameters under its own names; the OLMoE
router's one weight is `weight` [E, H], so as the layer's `gate` it is `mlp.gate.weight`, the name
transformers' OLMoE checkpoints use.

Never: synchronises with the host (no .item(), .tolist(), data-dependent Python branch), so the
layer compiles as one graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F


class RouterOutput(NamedTuple):
    weights: torch.Tensor  #: [T, k] float, as the router normalises or scales them
    experts: torch.Tensor  #: [T, k] long, expert ids
    logits: torch.Tensor  #: [T, E] raw logits


class Router(nn.Module):
    """Base of the routers: E experts, k of them per position."""

    def __init__(self, n_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be in [1, n_experts={n_experts}]")
        self.n_experts, self.top_k = int(n_experts), int(top_k)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> RouterOutput:
        raise NotImplementedError


class SoftmaxTopKRouter(Router):
    """OLMoE's router (transformers' OlmoeTopKRouter, op for op): logits = hidden @ weight.T, softmax
    in fp32 over all E experts, the k largest probabilities; with `norm_topk_prob` they are divided
    by their sum (OLMoE-1B-7B's config: false). The weights come back in the logits' dtype (bf16
    under bf16 autocast), as transformers' do."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, norm_topk_prob: bool = False, device=None):
        super().__init__(n_experts, top_k)
        self.norm_topk_prob = bool(norm_topk_prob)
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden_size, device=device))

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> RouterOutput:
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterOutput(weights.to(logits.dtype), experts, logits)
