"""The runner's sparse mixture-of-experts block: route, permute once, two grouped matmuls, un-permute.

Owns the forward of one MoE MLP over the T = sequences x positions rows of its input [..., H]:
1. route: `gate(hidden [T, H], token_ids) -> RouterOutput(weights [T, k], experts [T, k], logits [T, E])`
   (any runner.training.moe.routers.Router);
2. permute once: the T x k (row, expert) pairs sorted by expert (a stable sort, so within an expert
   rows keep their order and each row's contributions are later summed in expert order), the rows
   gathered in that order; per-expert counts by `torch.histc` on the device and their cumulative
   sum as the grouped matmuls' offsets;
3. experts (GroupedExperts): one grouped matmul for the fused gate+up projection of every expert,
   SiLU(gate) x up, one grouped matmul for the down projection. Under autocast the expert weights
   are cast to the autocast dtype here, inside the layer (so inside the compiled region when the
   decoder layer is compiled: inductor fuses the cast; the fp32 parameters get the gradients);
   `torch.nn.functional.grouped_mm` is not autocast-enabled, so without this it would run fp32;
4. un-permute: each pair's output times its router weight, summed per row with `index_add_` into an
   output of the input's dtype (fp32 accumulation under autocast, as transformers' eager loop).

Parameter names and layouts are transformers' OLMoE ones: `gate.weight` [E, H] (the router's),
`experts.gate_up_proj` [E, 2I, H] (gate rows first, then up), `experts.down_proj` [E, H, I], so a
checkpoint of transformers' OlmoeForCausalLM and of the runner's model are the same state dict.

Never: synchronises with the host in forward or backward (no .item(), .tolist(), bincount,
nonzero or data-dependent Python branch; CPU tests compile it with fullgraph=True), drops a
position (no capacity factor: every row reaches its k experts), or changes what the router chose.
Shapes: torch's grouped_mm wants 16-byte aligned strides (H and I multiples of 8 in bf16, 4 in fp32).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from runner.training.moe.routers import Router


def _torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch >= 2.10's public name, else 2.9's private one (same kernel); looked up at call time,
    so tests can watch the dtypes it gets."""
    mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return mm(x, w, offs=offsets)


# torch's grouped_mm runs fp32 eagerly (CPU), but its meta function, which torch.compile traces
# with, accepts bf16 only. So other dtypes go through these two opaque ops: one node each in a
# compiled graph, the same eager kernel inside (and without compile too, so both run the same).
@torch.library.custom_op("runner::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _torch_grouped_mm(x, w, offsets)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("runner::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per group g: x[rows of g].T @ grad[rows of g] -> [G, K, N]."""
    return _torch_grouped_mm(x.t(), grad, offsets)


@_grouped_mm_weight_grad.register_fake
def _grouped_mm_weight_grad_fake(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offsets.shape[0], x.shape[1], grad.shape[1])


def _grouped_mm_setup(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # the kernel refuses a broadcast (stride 0) gradient
    grad_x = _grouped_mm_op(grad, w.transpose(-2, -1), offsets) if ctx.needs_input_grad[0] else None
    grad_w = _grouped_mm_weight_grad(x, grad, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, K] @ w [G, K, N] per group -> [S, N]; group g owns rows offsets[g-1]:offsets[g]
    (rows past offsets[-1] are not computed). bf16: torch's grouped_mm as is (traced by compile);
    other dtypes: the same kernel behind runner::grouped_mm."""
    if x.dtype == torch.bfloat16:
        return _torch_grouped_mm(x, w, offsets)
    return _grouped_mm_op(x, w, offsets)


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where autocast is on, else the weights'."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class GroupedExperts(nn.Module):
    """E SwiGLU experts of hidden H and intermediate I as two stacked weights (transformers' OLMoE
    fused layout), run over expert-sorted rows by grouped matmuls."""

    def __init__(self, n_experts: int, hidden_size: int, intermediate_size: int, device=None):
        super().__init__()
        self.n_experts, self.hidden_size, self.intermediate_size = n_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate_size, hidden_size, device=device))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, intermediate_size, device=device))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [S, H] sorted by expert, offsets [E] int32 cumulative counts -> [S, H] in the compute dtype."""
        dtype = compute_dtype(x, self.gate_up_proj)
        gate_up = grouped_mm(x.to(dtype), self.gate_up_proj.to(dtype).transpose(-2, -1), offsets)
        gate, up = gate_up.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.down_proj.to(dtype).transpose(-2, -1), offsets)


class MoELayer(nn.Module):
    """A sparse MoE MLP: `gate` (a Router) picks k experts per row, `experts` (GroupedExperts) run
    them. `logits_tap` is called on the router logits (an identity by default; the OLMoE adapter
    puts one there that transformers' output_router_logits recorder recognises).

    forward(hidden [..., H], token_ids [...] | None = None) -> [..., H], the input's dtype."""

    def __init__(self, router: Router, experts: GroupedExperts, logits_tap: nn.Module | None = None):
        super().__init__()
        if router.n_experts != experts.n_experts:
            raise ValueError(f"router of {router.n_experts} experts, experts module of {experts.n_experts}")
        self.gate = router
        self.experts = experts
        self.router_logits = logits_tap if logits_tap is not None else nn.Identity()

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        route = self.gate(x, token_ids.reshape(-1) if token_ids is not None else None)
        self.router_logits(route.logits)
        k = route.experts.shape[-1]
        n_experts = self.experts.n_experts
        sorted_experts, order = torch.sort(route.experts.reshape(-1), stable=True)
        rows = order // k  # the input row of each expert-sorted pair
        # histc counts on the device (bincount syncs on CUDA); CPU's histc takes floats only, CUDA's
        # deterministic one ints only. Ids < 2^24 are exact in fp32.
        ids = sorted_experts.float() if x.device.type in ("cpu", "mps") else sorted_experts.int()
        counts = torch.histc(ids, bins=n_experts, min=0, max=n_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out = self.experts(x[rows], offsets)
        out = out * route.weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, rows, out.to(x.dtype)).reshape(shape)
