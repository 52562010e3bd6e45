"""The training loss of one micro batch: the LM head and the masked token cross-entropy, summed.

Owns the three ways `model.cross_entropy` computes sum over useful targets of -log p(target) from
the final hidden states:
- `plain`: the head's logits [batch, seq, vocab], upcast to fp32, then cross-entropy (what
  transformers does; the fp32 logits and their log-softmax are the largest tensors of a step);
- `chunked`: the runner's own fused head + loss. Tokens are taken a chunk at a time; a chunk's
  logits exist only while that chunk is computed, and the gradients of the hidden states and of
  the head weight are computed in the same pass (as Liger's fused linear cross-entropy does), so
  the backward needs no logits at all. Same FLOPs as plain, no [batch, seq, vocab] tensor;
- `liger`: Liger's Triton fused linear cross-entropy (CUDA/ROCm only).
Every path returns the SUM in fp32; the caller divides by the GLOBAL useful count
(runner.training.loop), so 1 or N processes and any micro batch compute the same gradient.
Never normalises, reads the config, or touches the optimizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: tokens per chunk of the chunked loss: at 1p3b's vocab (50,304) a chunk's fp32 logits are 206 MB,
#: against 3.3 GB for a micro batch of 8 x 2048 in one piece
CHUNK_TOKENS = 1024
IGNORE_INDEX = -100  # Liger's (and torch's) target id that contributes nothing


def plain_loss_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of masked-in token cross-entropies from full logits [batch, seq, vocab], in fp32."""
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.flatten(), reduction="none")
    return (per_token * mask.flatten()).sum()


def _matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matmul on `t` in (its own dtype without autocast)."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i mask_i * CE(hidden_i @ weight.T, target_i), gradients computed during the forward.

    d/dlogits of the summed loss is mask * (softmax - onehot): computed per chunk, it gives the
    chunk's slice of d/dhidden (g @ W) and a term of d/dW (g.T @ h), accumulated in fp32. The
    backward only scales them by the incoming gradient (the loss divisor)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, chunk_tokens):
        mm_dtype = _matmul_dtype(hidden)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(mm_dtype)
            for start in range(0, n, chunk_tokens):
                end = min(start + chunk_tokens, n)
                h = hidden[start:end].to(mm_dtype)
                t = targets[start:end]
                m = mask[start:end].to(torch.float32)
                logits = (h @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, t[:, None]).squeeze(1)
                total += ((lse - picked) * m).sum()
                if not (want_h or want_w):
                    continue
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' storage
                g[torch.arange(end - start, device=g.device), t] -= 1.0
                g = g.mul_(m[:, None]).to(mm_dtype)
                if grad_h is not None:
                    grad_h[start:end] = (g @ w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += (g.t() @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None


def chunked_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """The runner's fused head + loss: `plain_loss_sum(hidden @ weight.T, ...)` without the logits."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedLinearCrossEntropy.apply(
        hidden.flatten(0, -2), weight, targets.flatten(), mask.flatten(), int(chunk_tokens)
    )


def liger_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Liger's fused linear cross-entropy, summed; masked-out targets become its ignore index."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415  (optional, GPU only)

    ignore = targets.masked_fill(~mask.bool(), IGNORE_INDEX).flatten()
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    return loss(weight, hidden.flatten(0, -2), ignore).float()
