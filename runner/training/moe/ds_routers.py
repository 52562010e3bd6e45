"""DeepSeek-style routers of the runner's mixture-of-experts layer, on the routers' interface
(runner.training.moe.routers' Router: `forward(hidden [T, H], token_ids [T] | None) -> RouterOutput(weights
[T, k], experts [T, k], logits [T, E])`).

- `ScoreTopKRouter`: an expert's score is sigmoid (DeepSeek-V3, transformers' Glm4MoeTopkRouter with
  one group) or sqrt(softplus) (DeepSeek-V4, DeepseekV4TopKRouter) of its logit; the k experts of the
  largest `score + bias` are chosen, where the bias (`e_score_correction_bias`, transformers' name, a
  buffer: never trained by autograd) is the auxiliary-loss-free balancing's; the gate weights are the
  unbiased scores of the chosen experts, divided by their sum with `norm_topk_prob`, times
  `routed_scaling_factor`.
- `HashRouter`: DeepSeek-V4's hash-routed layers (DeepseekV4HashRouter): the k experts of a position
  are `tid2eid[token id]`, a fixed table (`hash_table`, built from the run's seed and tokenizer, kept
  in the checkpoint as a persistent buffer); the weights are the chosen experts' scores as above.
- `update_bias`: the balancing update, `b_i += rate * sign(mean load - load_i)`, once per optimizer
  step from the step's load (summed over micro batches and ranks), in place, outside autograd; its
  numpy twin, which the audit replays bit for bit, is runner.training.routing_record.next_bias (the
  sign is taken on integers, `sum(load) - E * load_i`; each step adds exactly +-rate or 0 in float32).
- `sequence_balance_loss`: DeepSeek-V3's sequence-wise balance loss.

Router logits come from fp32 operands, as Glm4Moe's router casts them; without autocast (CPU runs) they
and the scores are fp32. Under autocast, as in transformers' router, the linear still runs in the
autocast dtype (bf16 logits; the saved-tensor probe shows it, runner.planning.memory counts it).
Never: synchronises with the host in a forward (no .item(), no data-dependent branch).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from runner.training.moe.routers import Router, RouterOutput

SCORES = ("sigmoid", "sqrt_softplus", "softmax")
#: Glm4Moe's and DeepSeek-V4's guard against a zero sum of the chosen scores
NORM_EPS = 1e-20


def expert_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """The per-expert scores of logits [T, E] (fp32, or the autocast dtype under autocast)."""
    if score == "sigmoid":
        return logits.sigmoid()
    if score == "sqrt_softplus":
        return F.softplus(logits).sqrt()
    if score == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"score {score!r} is not one of {', '.join(SCORES)}")


class _ScoredRouter(Router):
    """A linear gate [E, H] (`weight`, the name transformers' routers use) and the gate weights of
    chosen experts from their scores."""

    def __init__(
        self,
        hidden_size: int,
        n_experts: int,
        top_k: int,
        score: str,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__(n_experts, top_k)
        if score not in SCORES:
            raise ValueError(f"score {score!r} is not one of {', '.join(SCORES)}")
        self.score = score
        self.norm_topk_prob, self.routed_scaling_factor = bool(norm_topk_prob), float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden_size))

    def _scores(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden.float(), self.weight.float())
        return logits, expert_scores(logits, self.score)

    def _weights(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
        return weights * self.routed_scaling_factor


class ScoreTopKRouter(_ScoredRouter):
    """DeepSeek-V3 (score sigmoid) or V4 (score sqrt_softplus): top-k of score + bias, weights from
    the unbiased scores. The bias moves only by `update_bias` (auxiliary-loss-free balancing); with
    balancing by an auxiliary loss it stays zero."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> RouterOutput:
        logits, scores = self._scores(hidden)
        choice = scores.detach() + self.e_score_correction_bias  # the bias steers the choice, never a weight
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        return RouterOutput(self._weights(scores, experts), experts, logits)


class HashRouter(_ScoredRouter):
    """DeepSeek-V4's hash routing: experts = tid2eid[token id] (a fixed [vocab, k] table, in the
    state dict so a checkpoint carries it); weights from the learned gate's scores of those experts."""

    tid2eid: torch.Tensor

    def __init__(self, *args, table: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        if table.ndim != 2 or table.shape[1] != self.top_k:
            raise ValueError(f"hash table of shape {list(table.shape)}, want [vocab, {self.top_k}]")
        self.register_buffer("tid2eid", table.to(torch.long).clone())

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> RouterOutput:
        if token_ids is None:
            raise ValueError("a hash-routed layer needs the token ids of its positions")
        logits, scores = self._scores(hidden)
        experts = self.tid2eid[token_ids.reshape(-1)]
        return RouterOutput(self._weights(scores, experts), experts, logits)


def hash_table(
    vocab_size: int, n_experts: int, top_k: int, seed: int, tokenizer_sha256: str, layer: int
) -> torch.Tensor:
    """The fixed token id -> k distinct experts table of one hash-routed layer: [vocab_size, k] int64,
    a pure function of the run's seed, its pinned tokenizer (sha256) and the layer index (numpy's
    PCG64 over a SeedSequence of the three; each row the first k of a uniform permutation of E)."""
    digest = int(hashlib.sha256(f"{tokenizer_sha256}".encode()).hexdigest(), 16)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), digest, int(layer)])))
    keys = rng.random((int(vocab_size), int(n_experts)))
    return torch.from_numpy(np.argsort(keys, axis=1, kind="stable")[:, : int(top_k)].astype(np.int64))


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing, in place: `b_i += rate * sign(mean(load) - load_i)` with `load`
    [E] the step's positions routed to each expert (summed over micro batches and ranks). The sign is
    taken on integers (sum - E * load_i), so no rounding can flip it; fp32 adds, as
    runner.training.routing_record.next_bias."""
    load = load.to(torch.int64)
    direction = torch.sign(load.sum() - load.numel() * load).to(torch.float32)
    bias.add_(direction * torch.tensor(rate, dtype=torch.float32, device=bias.device))


def sequence_balance_loss(logits: torch.Tensor, experts: torch.Tensor, seq_len: int, score: str) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20) of one router call, averaged over its
    sequences: per sequence, `sum_i f_i P_i` with f_i = E / (k L) x positions routed to expert i and
    P_i the mean over its L positions of score_i / sum_j score_j. 1.0 when routing is uniform."""
    n_experts, k = logits.shape[-1], experts.shape[-1]
    scores = expert_scores(logits.float(), score)
    share = (scores / scores.sum(dim=-1, keepdim=True)).view(-1, seq_len, n_experts).mean(dim=1)  # [B, E]
    counts = torch.zeros(share.shape, dtype=torch.float32, device=logits.device)
    rows = torch.arange(share.shape[0], device=logits.device).repeat_interleave(seq_len * k)
    counts.index_put_((rows, experts.reshape(-1)), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
    f = counts * n_experts / (k * seq_len)
    return (f * share).sum(dim=-1).mean()
