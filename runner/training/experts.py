"""Observing a mixture-of-experts model's routing while it trains, and its router losses.

Owns: the forward hook on every layer's router (`mlp.gate`: the runner's Router, whose RouterOutput
holds the router logits and the top-k experts the layer then uses, or transformers' OlmoeTopKRouter
returning (logits, weights, indices), so what is counted is exactly what was computed), the per-step count of input positions routed to each expert of each layer,
split by the domain of the sample each position belongs to, the router losses added to the
training loss, and the step's commit into the run's ExpertLoad (runner.training.expert_load); and
the experts' matmuls under autocast (`autocast_experts`).

Router losses, per router call, averaged over layers:
- load balancing (Switch Transformer eq. 4): `E * sum_e f_e * P_e`, f_e the share of the call's
  k x T assignments sent to expert e (no gradient), P_e the mean router probability of e over the
  T positions: 1.0 when routing is uniform, E / k when every position goes to the same k experts;
- z-loss (ST-MoE eq. 5): the mean over positions of logsumexp(router logits)^2.
Weighted by `model.moe.router_aux_loss_coef` / `router_z_loss_coef` and averaged over the micro
batches of a step, like the cross-entropy.

Never: counts a forward it was not armed for (evaluation; the recomputed forward of activation
checkpointing runs inside backward, after `disarm`), records autograd work inside a layer (which
would differ between a checkpointed layer's forward and its recomputation), commits a step the
trainer did not commit, or changes what the router decides.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np
import torch

from runner.training.expert_load import ExpertLoad, balance
from runner.training.moe.routers import RouterOutput


def router_losses(logits: torch.Tensor, indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of one router call: logits [T, E], indices [T, k]."""
    logits = logits.float()
    assigned = torch.zeros(n_experts, dtype=torch.float32, device=logits.device)
    assigned.index_add_(0, indices.reshape(-1), torch.ones(indices.numel(), device=logits.device))
    share = assigned / indices.numel()
    aux = n_experts * (share * logits.softmax(dim=-1).mean(dim=0)).sum()
    z = logits.logsumexp(dim=-1).square().mean()
    return aux, z


#: the attribute of a router module where the armed forward's (logits, indices) wait for disarm()
_ROUTED = "_runner_routed"


def _over_layers(reduce, values: np.ndarray) -> float:
    """`reduce` over the layers that routed anything (NaN when none did)."""
    values = values[~np.isnan(values)]
    return float(reduce(values)) if values.size else float("nan")


class RouterProbe:
    """Counts routed positions per (layer, domain, expert) for the forwards it is armed for."""

    def __init__(self, routers: list[torch.nn.Module], load: ExpertLoad, seq_len: int, aux_coef: float, z_coef: float):
        self.load = load
        self.seq_len = seq_len
        self.aux_coef, self.z_coef = aux_coef, z_coef
        self.n_layers, self.n_experts = load.n_layers, load.n_experts
        self._pending: torch.Tensor | None = None  # [layers, domains * experts] int64, on the model's device
        self._loss_sums: torch.Tensor | None = None  # [aux, z, forwards] float64
        self._row_keys: torch.Tensor | None = None  # [1, positions, 1]: domain * E of each routed row
        self._layer_keys: torch.Tensor | None = None  # [layers, 1, 1]: layer * D * E
        self._routers = list(routers)
        self._armed = False
        # One hook object for every layer, holding no layer index, that only writes: under regional
        # compile the decoder layers share one compiled graph while what the graph reads is the same
        # for all of them (a per-layer index, or a list the hook appends to, is guarded on: a
        # recompile per layer, past torch's limit of 8, and the layers past it run uncompiled).
        self._handles = [r.register_forward_hook(self._observe) for r in routers]

    def _buffers(self, device: torch.device) -> None:
        # Made once, on the first armed forward's device (which never changes within a run; a
        # device comparison would not do: torchrun's CPU device is cpu:0, a CPU tensor's is cpu).
        if self._pending is None:
            self._pending = torch.zeros(
                (self.n_layers, len(self.load.domains) * self.n_experts), dtype=torch.int64, device=device
            )
            self._loss_sums = torch.zeros(3, dtype=torch.float64, device=device)
            self._layer_keys = torch.arange(self.n_layers, device=device)[:, None, None] * self._pending.shape[1]

    def arm(self, domain_ids: np.ndarray, device: torch.device) -> None:
        """The next forward is a training forward of sequences from these domains (ids, one per sequence)."""
        self._buffers(device)
        ids = torch.as_tensor(np.asarray(domain_ids, dtype=np.int64)).to(device)
        # The router sees [sequences x positions] rows in order: row r belongs to sequence r // L.
        self._row_keys = (ids.repeat_interleave(self.seq_len) * self.n_experts)[None, :, None]
        self._forget_routing()
        self._armed = True

    def _forget_routing(self) -> None:
        for router in self._routers:
            router.__dict__[_ROUTED] = None

    def _observe(self, module, args, output) -> None:
        # Only kept here: counting and losses happen in disarm(), outside the layer. Autograd work
        # done inside would be missing from an activation-checkpointed layer's recomputation, which
        # must match its forward; and one count for all layers is one kernel instead of one per layer.
        # Kept on the router module itself (one attribute write: no read the compiled graph guards on).
        if self._armed:
            if isinstance(output, RouterOutput):  # the runner's routers (runner.training.moe)
                logits, indices = output.logits, output.experts
            else:  # transformers' OlmoeTopKRouter: (logits, top-k weights, top-k indices)
                logits, _, indices = output
            setattr(module, _ROUTED, (logits, indices))

    def _count(self, indices: list[torch.Tensor]) -> None:
        """Add one forward's routing (each layer's [positions, k] expert indices) to the step's counts."""
        assert self._pending is not None and self._layer_keys is not None and self._row_keys is not None  # armed
        keys = (self._layer_keys + self._row_keys + torch.stack(indices)).reshape(-1)  # layer*D*E + domain*E + expert
        # index_add_ into a fixed-size buffer: no device-to-host sync (bincount on CUDA has one).
        self._pending.view(-1).index_add_(0, keys, torch.ones_like(keys))

    def disarm(self) -> torch.Tensor:
        """End of the armed forward: its weighted router loss (add it to the loss before backward)."""
        self._armed = False
        routed = [router.__dict__.get(_ROUTED) for router in self._routers]
        self._forget_routing()  # the tensors are the step's only: do not keep them alive past it
        if any(r is None for r in routed) or len(routed) != self.n_layers:
            ran = sum(r is not None for r in routed)
            raise RuntimeError(f"{ran} of {self.n_layers} routers ran in a training forward")
        calls = [r for r in routed if r is not None]
        self._count([indices for _, indices in calls])
        losses = [router_losses(logits, indices, self.n_experts) for logits, indices in calls]
        aux = torch.stack([a for a, _ in losses]).mean()
        z = torch.stack([b for _, b in losses]).mean()
        assert self._loss_sums is not None  # made by the arm() before this forward
        self._loss_sums += torch.stack([aux.detach().double(), z.detach().double(), aux.new_ones(()).double()])
        return self.aux_coef * aux + self.z_coef * z

    def commit(self, acc) -> dict[str, float]:
        """The step is committed: add its routed positions (every rank's) to the run's load; return
        the step's figures for the metrics record."""
        routed, sums = self._pending, self._loss_sums
        if routed is None or sums is None:  # no armed forward yet on this rank
            self._buffers(acc.device)
            routed, sums = self._pending, self._loss_sums
            assert routed is not None and sums is not None
        if acc.num_processes > 1:
            torch.distributed.all_reduce(routed)
            torch.distributed.all_reduce(sums)
        # A copy: on CPU .numpy() shares the buffer that discard() zeroes.
        step = routed.cpu().numpy().reshape(self.load.routed.shape).copy()
        self.load.add(step)
        aux, z, forwards = sums.tolist()
        self.discard()
        per_layer = balance(step.sum(axis=1))  # all domains together, one row per layer
        return {
            "router_aux_loss": aux / max(forwards, 1.0),
            "router_z_loss": z / max(forwards, 1.0),
            "expert_load_imbalance": _over_layers(np.max, per_layer["imbalance"]),
            "expert_load_cv": _over_layers(np.mean, per_layer["cv"]),
            "expert_idle_capacity": _over_layers(np.mean, per_layer["idle_capacity"]),
        }

    def discard(self) -> None:
        """Forget the uncommitted step (after a commit, or when the step is lost)."""
        if self._pending is not None and self._loss_sums is not None:
            self._pending.zero_()
            self._loss_sums.zero_()

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.load.state_dict()

    def load_state_dict(self, state, where: str) -> None:
        self.load.load_state_dict(state, where)
        self.discard()


_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


class _CastExperts:
    """An experts module as the grouped-matmul forward reads it, its weights cast to `dtype`."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self._module = module
        for name in _EXPERT_WEIGHTS:
            weight = getattr(module, name, None)
            if isinstance(weight, torch.Tensor):
                setattr(self, name, weight.to(dtype))  # differentiable: the fp32 parameter gets the gradient

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _autocast_forward(module: torch.nn.Module, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward; on the grouped_mm path under autocast, with its weights in the
    autocast dtype. torch's grouped_mm is not autocast-enabled and transformers casts the input to the
    weight's dtype, so fp32 weights made every expert matmul fp32 (on a GPU: torch's per-expert fp32
    loop with a host sync instead of the bf16 grouped kernel). Cast per forward, as autocast does for
    a Linear's weight; the input is cast to the weights' dtype by transformers."""
    from transformers.integrations.moe import grouped_mm_experts_forward  # noqa: PLC0415  (OLMoE runs only)

    device, config = hidden_states.device.type, cast(Any, module.config)
    if config._experts_implementation != "grouped_mm" or not torch.is_autocast_enabled(device):
        return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
    view = _CastExperts(module, torch.get_autocast_dtype(device))
    return grouped_mm_experts_forward(view, hidden_states, top_k_index, top_k_weights)  # type: ignore[arg-type]


def autocast_experts(model: torch.nn.Module) -> None:
    """Every decoder layer's experts of transformers' OLMoE run `_autocast_forward` (set on the
    instances: other models in the process keep transformers' own)."""
    for layer in cast(torch.nn.ModuleList, model.get_submodule("model.layers")):
        experts: Any = cast(Any, layer).mlp.experts
        experts.forward = functools.partial(_autocast_forward, experts)


def attach(model: torch.nn.Module, cfg, domains: list[str]) -> RouterProbe | None:
    """A probe on every router of an `arch: olmoe` model (before it is wrapped or sharded); None for a dense one."""
    if cfg.model.arch != "olmoe":
        return None
    moe = cfg.model.moe
    inner: Any = model
    routers = [layer.mlp.gate for layer in inner.model.layers]
    load = ExpertLoad(domains, len(routers), moe.n_experts, moe.experts_per_token)
    return RouterProbe(routers, load, cfg.train.seq_len, moe.router_aux_loss_coef, moe.router_z_loss_coef)
