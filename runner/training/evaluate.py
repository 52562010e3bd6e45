"""Per-domain validation: mean token cross-entropy (nats) and bits per byte on fixed samples.

Owns which validation samples are scored (the first `samples_per_domain` windows of each
domain's validation pool, clipped to what exists: the same ones at every evaluation) and the
bits-per-byte arithmetic (summed loss / ln 2 / UTF-8 bytes of the target tokens). Work is split
across ranks and summed; every rank runs the same number of forwards. Runs eager even when the
model is compiled (see `eager_forwards`). Never changes the model's weights or any RNG state.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


def eager_forwards() -> contextlib.AbstractContextManager:
    """Compiled code runs as its eager Python (validation, downstream scoring, samples): evaluation
    under torch.compile would trace an eval graph (model.eval() fails the training graphs' guards)
    and recompile for every new batch size or signature (a domain's last, short micro batch; a
    packed row's 4D mask; the head on scored positions), seconds to minutes each on a GPU, for
    forwards that are a small share of a run. torch < 2.6 has no stance."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, data, acc, micro_batch: int, step: int, exposure_tokens: int) -> list[dict]:
    """One row per domain: {step, exposure_tokens, domain, loss_nats, bpb, samples, tokens}."""
    with eager_forwards():
        return _evaluate(model, data, acc, micro_batch, step, exposure_tokens)


def _evaluate(model, data, acc, micro_batch: int, step: int, exposure_tokens: int) -> list[dict]:
    rank, world = acc.process_index, acc.num_processes
    names = sorted(data.val_samples)
    # Pairs address the validation reader, whose ids index its own (sorted) domains.
    ids = {d: data.val_reader.domains.index(d) for d in names}
    sums = torch.zeros(len(names), 3, dtype=torch.float64)  # loss nats, target tokens, target bytes
    was_training = model.training
    model.eval()
    byte_lengths = torch.as_tensor(data.byte_lengths)
    for j, d in enumerate(names):
        n = data.val_samples[d]
        pairs = [(ids[d], k) for k in range(n)][rank::world]
        # Every rank runs the same number of forwards (FSDP gathers weights collectively in each);
        # a rank short of samples scores its first one again with a zero mask.
        for i in range(0, micro_batch * math.ceil(math.ceil(n / world) / micro_batch), micro_batch):
            chunk = pairs[i : i + micro_batch]
            batch = data.val_reader.read(chunk or [(ids[d], 0)])
            x = torch.as_tensor(batch.input_ids).to(acc.device)
            y = torch.as_tensor(batch.labels)
            mask = torch.as_tensor(batch.loss_mask)
            if not chunk:
                mask = torch.zeros_like(mask)
            with acc.autocast():
                logits = model(input_ids=x).logits
            per_token = (
                F.cross_entropy(logits.float().flatten(0, 1), y.to(acc.device).flatten(), reduction="none")
                .cpu()
                .double()
            )
            m = mask.flatten()
            sums[j, 0] += (per_token * m).sum()
            sums[j, 1] += m.sum()
            sums[j, 2] += byte_lengths[y.flatten()[m]].sum()
    if was_training:
        model.train()
    if world > 1:
        sums = sums.to(acc.device)
        torch.distributed.all_reduce(sums)
        sums = sums.cpu()
    rows = []
    for j, d in enumerate(names):
        loss_sum, tokens, nbytes = (float(v) for v in sums[j])
        rows.append(
            {
                "step": step,
                "exposure_tokens": exposure_tokens,
                "domain": d,
                "loss_nats": loss_sum / tokens if tokens else float("nan"),
                "bpb": loss_sum / math.log(2) / nbytes if nbytes else float("nan"),
                "samples": data.val_samples[d],
                "tokens": int(tokens),
            }
        )
    return rows
