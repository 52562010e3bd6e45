"""What a step reads: the run's data (pools, sampler, readers, byte lengths) and each step's batch,
cut from the sampler's global batch by its step_grid (what rank_slice returns).

Owns loading the data a run trains and evaluates on, and the host's part of a step (this rank's
tensors, its useful targets per domain, every rank's processed positions), computed before the
step in the prefetch thread. Never decides what data a step sees (the sampler does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from runner.config.load import Experiment
from runner.data.integrity import ShardVerifier
from runner.data.manifest import Pool, load_experiment_manifests, num_samples
from runner.data.sampler import BatchReader, MixtureSampler
from runner.data.tokenizer import load_tokenizer, token_byte_lengths
from runner.errors import RunnerError


@dataclass
class Data:
    domains: list[str]
    samples: dict[str, int]
    sampler: MixtureSampler
    reader: BatchReader
    val_reader: BatchReader | None
    val_samples: dict[str, int]
    byte_lengths: np.ndarray
    verifier: ShardVerifier | None = None  # hashing the shards in the background, or None

    def verification_failed(self, say: Callable[[str], None], wait: bool) -> float:
        """1.0 when this rank's shard verification found a mismatch (wait: once every shard is hashed)."""
        verifier = self.verifier
        if verifier is None:
            return 0.0
        if wait and not verifier.done():
            say("data: the checkpoint waits for the shards' sha256 verification to finish")
            while not verifier.join(timeout=60):
                say(f"data: {verifier.progress()}")
        if verifier.done() and not verifier.announced and verifier.failure() is None:
            verifier.announced = True
            say(verifier.summary())
        return float(verifier.failure() is not None)

    def raise_failure(self) -> NoReturn:
        """This rank's mismatch, or the line that another node's was (each node names its own)."""
        failure = self.verifier.failure() if self.verifier is not None else None
        raise failure or RunnerError(
            "a shard differs from its manifest's sha256 on another node (its error line names it)"
        )


def load_data(exp: Experiment, seq_len: int, verify: bool = False) -> Data:
    cfg = exp.config
    manifests, _ = load_experiment_manifests(exp)
    pools = {d: Pool(m, "train") for d, m in manifests.items()}
    val_pools = {d: Pool(m, "validation") for d, m in manifests.items() if m.validation_shards}
    samples = {d: num_samples(p.tokens, seq_len) for d, p in pools.items()}
    ratios = {d: v.target_ratio for d, v in cfg.mixture.domains.items()}
    sampler = MixtureSampler(samples, ratios, cfg.seed, cfg.train.global_batch_sequences)
    val_samples = {d: min(cfg.eval.samples_per_domain, num_samples(p.tokens, seq_len)) for d, p in val_pools.items()}
    tok = load_tokenizer(exp.resolve_path(cfg.tokenizer.path), cfg.tokenizer.sha256)
    return Data(
        domains=list(sampler.domains),
        samples=samples,
        sampler=sampler,
        reader=BatchReader(pools, seq_len),
        val_reader=BatchReader(val_pools, seq_len) if val_pools else None,
        val_samples={d: n for d, n in val_samples.items() if n > 0},
        byte_lengths=np.asarray(token_byte_lengths(tok), dtype=np.int64),
        verifier=ShardVerifier(manifests.values()).start() if verify else None,
    )


def domain_positions(pairs, domains: list[str], seq_len: int) -> dict[str, int]:
    """Input positions per domain of (domain_id, sample) pairs: a list, or an array [..., 2]."""
    counts = np.bincount(np.asarray(pairs, dtype=np.int64).reshape(-1, 2)[:, 0], minlength=len(domains))
    return {d: int(counts[i]) * seq_len for i, d in enumerate(domains)}


@dataclass
class HostBatch:
    """The host's part of a step, all computed before the step (in the prefetch thread)."""

    global_pairs: np.ndarray  # the whole global batch [B, 2]
    tensors: tuple  # this rank's input_ids, labels, loss_mask [accum * micro, L] (pinned on a GPU run)
    useful: torch.Tensor  # float64 [domains]: this rank's useful targets per domain
    processed: list  # per micro step: input positions per domain, all ranks
    domain_ids: np.ndarray  # int64 [accum * micro]: the domain of each of this rank's sequences


def read_step(data: Data, step: int, world: int, accum: int, micro: int, rank: int, pin: bool) -> HostBatch:
    """The global batch of `step` as the sampler's step_grid cuts it (its rank_slice): contiguous
    [rank][micro step][sequence] blocks. This rank reads its block; processed counts every rank's."""
    grid = data.sampler.step_grid(step, world, accum)
    assert grid.shape[2] == micro, "the recipe's checks make world x accum x micro the global batch"
    global_pairs = grid.reshape(-1, 2)
    batch = data.reader.read(grid[rank])
    tensors = tuple(torch.as_tensor(a) for a in (batch.input_ids, batch.labels, batch.loss_mask))
    if pin:
        # Page-locked memory makes the copy to the device asynchronous: it overlaps the step's start.
        tensors = tuple(t.pin_memory() for t in tensors)
    useful = torch.zeros(len(data.domains), dtype=torch.float64)
    useful.index_add_(0, torch.as_tensor(batch.domain_ids), tensors[2].sum(1).double())
    processed = [domain_positions(grid[:, m], data.domains, data.reader.seq_len) for m in range(accum)]
    return HostBatch(global_pairs, tensors, useful, processed, np.asarray(batch.domain_ids, dtype=np.int64))
