"""A domain's token pool as the sampler reads it: the manifest's record (`Manifest`, its `Shard`s) and the
pool it describes (`Pool`), memory mapped shard by shard and addressed as one array.

Its own module so that the sampler can name the pool it reads without importing the manifest reader
(which imports the mixture planner, which imports the sampler). Never reads or checks a manifest file:
that is runner.data.manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclass(frozen=True)
class Shard:
    path: Path  # absolute: the manifest stores it relative to its folder
    tokens: int
    documents: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    path: Path
    dir: Path
    domain: str
    tokenizer_sha256: str
    token_dtype: str
    vocab_size: int
    eos_id: int
    pool_tokens: int
    validation_tokens: int
    shards: tuple[Shard, ...]
    validation_shards: tuple[Shard, ...]
    sha256: str
    data: dict  # the manifest as written

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.token_dtype]


class Pool:
    """One split of a domain's tokens, memory mapped shard by shard, addressed as one array."""

    def __init__(self, manifest: Manifest, split: str = "train"):
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        shards = manifest.shards if split == "train" else manifest.validation_shards
        self.manifest, self.split, self.dtype = manifest, split, manifest.dtype
        self._maps = [
            np.memmap(s.path, dtype=self.dtype, mode="r", shape=(s.tokens,)) for s in shards if s.tokens > 0
        ]  # numpy cannot map an empty file
        self._starts = np.cumsum([0] + [len(m) for m in self._maps])
        self.tokens = int(self._starts[-1])

    def __len__(self) -> int:
        return self.tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split, copied out of the shards they span."""
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"range [{start}, {stop}) outside the {self.split} pool of {self.tokens} tokens")
        out = np.empty(stop - start, dtype=self.dtype)
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        for i in range(max(first, 0), len(self._maps)):
            if filled == len(out):
                break
            lo = start + filled - int(self._starts[i])
            n = min(len(self._maps[i]) - lo, len(out) - filled)
            out[filled : filled + n] = self._maps[i][lo : lo + n]
            filled += n
        return out
