"""Manifests: the files that pin a domain's token pool, and the pools they describe.

Owns: the manifest format (`runner-manifest/1`), its self-hash, checking that the shards on
disk are the ones it names, and reading a pool across shard boundaries by memory map.
Never tokenizes and never writes shards (that is `runner.data.prepare`); never trusts a shard
whose size does not match its token count.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np

from runner.config.load import Experiment, parse_ref, recipe_path
from runner.data.mixture import MixturePlan, plan_mixture
from runner.errors import MixtureInfeasible, RunnerError, display_path
from runner.fsio import atomic_write, canonical_json, sha256_file

FORMAT = "runner-manifest/1"
REQUIRED_KEYS = (
    "format",
    "domain",
    "tokenizer_sha256",
    "token_dtype",
    "vocab_size",
    "eos_id",
    "shards",
    "validation_shards",
    "validation",
    "pool_tokens",
    "documents",
    "validation_tokens",
    "validation_documents",
    "sources",
    "manifest_sha256",
)
SHARD_KEYS = ("path", "tokens", "documents", "sha256")
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def manifest_sha256(fields: dict) -> str:
    """sha256 of the canonical JSON of the manifest without its own `manifest_sha256`."""
    return hashlib.sha256(
        canonical_json({k: v for k, v in fields.items() if k != "manifest_sha256"}).encode("ascii")
    ).hexdigest()


def write_manifest(path: Path, fields: dict) -> str:
    """Seal `fields` with their manifest_sha256 and write them atomically; returns the sha256."""
    sealed = dict(fields)
    sealed["manifest_sha256"] = manifest_sha256(sealed)
    atomic_write(Path(path), (json.dumps(sealed, indent=1, sort_keys=True) + "\n").encode("ascii"))
    return sealed["manifest_sha256"]


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


def _shards(raw, file: str, key: str, folder: Path) -> tuple[Shard, ...]:
    if not isinstance(raw, list):
        raise RunnerError("must be a list of shards", file=file, key=key)
    shards = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or any(k not in entry for k in SHARD_KEYS):
            raise RunnerError(f"shard needs keys {', '.join(SHARD_KEYS)}", file=file, key=f"{key}.{i}")
        path = _shard_path(entry["path"], file, f"{key}.{i}.path")
        counts = []
        for name in ("tokens", "documents"):
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RunnerError(f"must be a whole number >= 0, got {value!r}", file=file, key=f"{key}.{i}.{name}")
            counts.append(value)
        shards.append(Shard(folder / path, counts[0], counts[1], str(entry["sha256"])))
    return tuple(shards)


def _shard_path(raw, file: str, key: str) -> PurePosixPath:
    """A shard path relative to the manifest's folder and inside it: an absolute path or a `..`
    would let a manifest (pinned by its hash) read tokens the data folder does not hold."""
    if not isinstance(raw, str) or not raw or "\\" in raw or "\0" in raw:
        raise RunnerError(f"must be a file name relative to the manifest's folder, got {raw!r}", file=file, key=key)
    path = PurePosixPath(raw)
    if path.is_absolute() or ".." in path.parts or PureWindowsPath(raw).drive:
        raise RunnerError(
            f"{raw!r} leaves the manifest's folder: shard paths are relative to it and stay inside it",
            file=file,
            key=key,
        )
    return path


def _check_shard(shard: Shard, itemsize: int, full: bool) -> None:
    try:
        size_bytes = shard.path.stat().st_size
    except FileNotFoundError:
        raise RunnerError("shard named by the manifest is missing", file=str(shard.path)) from None
    expected_bytes = shard.tokens * itemsize
    if size_bytes != expected_bytes:
        raise RunnerError(
            f"shard is {size_bytes} bytes, the manifest says {shard.tokens} tokens = "
            f"{expected_bytes} bytes (truncated or replaced)",
            file=str(shard.path),
        )
    if full:
        actual = sha256_file(shard.path)
        if actual != shard.sha256:
            raise RunnerError(f"shard sha256 is {actual}, the manifest says {shard.sha256}", file=str(shard.path))


def _read_manifest_json(path: Path, key: str | None) -> dict:
    """The manifest's JSON object, with every required key; `key` names the pin in errors."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunnerError(
            "manifest not found (run `runner data prepare` or `runner data builtin`)", file=path, key=key
        ) from None
    except IsADirectoryError:
        raise RunnerError("is a folder: name the manifest.json in it", file=path, key=key) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RunnerError(f"cannot read the manifest: {e}", file=path, key=key) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RunnerError(f"not valid JSON: {e}", file=path) from None
    except RecursionError:
        raise RunnerError("refused: nested too deeply", file=path) from None
    if not isinstance(data, dict):
        raise RunnerError("manifest must be a JSON object", file=path)
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise RunnerError(f"missing keys: {', '.join(missing)}", file=path)
    return data


def load_manifest(
    path: str | os.PathLike, expected_sha256: str | None = None, verify: str = "size", key: str | None = None
) -> Manifest:
    """Read and check a manifest. `expected_sha256` is the pinned value (named `key` in errors);
    verify="size" checks every shard's byte size, verify="full" also its sha256."""
    if verify not in ("size", "full"):
        raise ValueError(f"verify must be 'size' or 'full', got {verify!r}")
    path = Path(path)
    file = str(path)
    data = _read_manifest_json(path, key)
    if data["format"] != FORMAT:
        raise RunnerError(f"unknown format {data['format']!r}, expected {FORMAT!r}", file=file, key="format")
    try:
        actual = manifest_sha256(data)
    except ValueError:
        raise RunnerError("holds NaN or infinity: not a manifest prepare wrote", file=file) from None
    if actual != data["manifest_sha256"]:
        raise RunnerError(
            f"content hashes to {actual}, not its recorded {data['manifest_sha256']} (edited after prepare)",
            file=file,
            key="manifest_sha256",
        )
    if expected_sha256 is not None and actual != expected_sha256:
        raise RunnerError(
            f"manifest sha256 is {actual}, pinned {expected_sha256}", file=file, key=key or "manifest_sha256"
        )
    if not isinstance(data["token_dtype"], str) or data["token_dtype"] not in DTYPES:
        raise RunnerError(f"token_dtype must be one of {', '.join(DTYPES)}", file=file, key="token_dtype")
    for name in ("vocab_size", "eos_id", "pool_tokens", "validation_tokens"):
        if isinstance(data[name], bool) or not isinstance(data[name], int) or data[name] < 0:
            raise RunnerError(f"must be a whole number >= 0, got {data[name]!r}", file=file, key=name)
    folder = path.parent
    manifest = Manifest(
        path=path,
        dir=folder,
        domain=str(data["domain"]),
        tokenizer_sha256=str(data["tokenizer_sha256"]),
        token_dtype=data["token_dtype"],
        vocab_size=data["vocab_size"],
        eos_id=data["eos_id"],
        pool_tokens=data["pool_tokens"],
        validation_tokens=data["validation_tokens"],
        shards=_shards(data["shards"], file, "shards", folder),
        validation_shards=_shards(data["validation_shards"], file, "validation_shards", folder),
        sha256=actual,
        data=data,
    )
    for name, shards, total in (
        ("pool_tokens", manifest.shards, manifest.pool_tokens),
        ("validation_tokens", manifest.validation_shards, manifest.validation_tokens),
    ):
        if sum(s.tokens for s in shards) != total:
            raise RunnerError("does not equal the sum of its shards' tokens", file=file, key=name)
    for shard in manifest.shards + manifest.validation_shards:
        _check_shard(shard, manifest.dtype.itemsize, verify == "full")
    return manifest


def num_samples(pool_tokens: int, seq_len: int) -> int:
    """Samples of length L in a pool: each needs L inputs plus one more target token."""
    return max(0, (pool_tokens - 1) // seq_len)


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


def load_experiment_manifests(
    exp: Experiment, *, verify: str = "size", missing_ok: bool = False
) -> tuple[dict[str, Manifest], list[str]]:
    """The manifests an experiment pins, each checked against its pin and against the experiment's
    tokenizer (a pool tokenized with another tokenizer would train on wrong ids).

    With `missing_ok` (validation on a machine without the data), unpinned or absent manifests
    become notes; otherwise (launch) they are errors. Returns (manifests by domain, notes)."""
    cfg = exp.config
    where = exp.path
    manifests: dict[str, Manifest] = {}
    notes: list[str] = []
    if cfg.tokenizer.sha256 is None and not missing_ok:
        # The pin belongs in the tokenizer recipe, which every experiment using it shares.
        ref = cfg.recipes.get("tokenizer")
        recipe = recipe_path(exp.project_root, "tokenizer", parse_ref(ref)[0]) if ref else None
        if recipe is None or not recipe.exists():
            raise RunnerError("not pinned: pin it in the tokenizer recipe", file=where, key="tokenizer.sha256")
        raise RunnerError(
            f"not pinned: put the sha256 of {cfg.tokenizer.path} here (`sha256sum` prints it), then bump "
            f"this recipe's version and the references to it ({display_path(where)} uses it)",
            file=recipe,
            key="sha256",
        )
    for d, pin in cfg.data.manifests.items():
        key = f"data.manifests.{d}"
        path = exp.resolve_path(pin.path)
        if path.is_dir():
            raise RunnerError(f"{pin.path!r} is a folder: name the manifest.json in it", file=where, key=f"{key}.path")
        if pin.sha256 is None or not path.exists():
            what = "not pinned" if pin.sha256 is None else f"{pin.path} is not on this machine"
            if missing_ok:
                notes.append(f"{display_path(where)}: {key}: {what}: checked at launch")
                continue
            if pin.sha256 is None:
                raise RunnerError(
                    "not pinned: put the manifest_sha256 that `runner data prepare` printed here",
                    file=where,
                    key=f"{key}.sha256",
                )
        m = load_manifest(path, expected_sha256=pin.sha256, verify=verify, key=f"{key}.sha256")
        if cfg.tokenizer.sha256 is not None and m.tokenizer_sha256 != cfg.tokenizer.sha256:
            raise RunnerError(
                f"{pin.path} was tokenized with tokenizer {m.tokenizer_sha256[:12]}..., the experiment "
                f"pins {str(cfg.tokenizer.sha256)[:12]}...: prepare it again with the pinned tokenizer",
                file=where,
                key=key,
            )
        if m.token_dtype != cfg.tokenizer.token_dtype:
            raise RunnerError(
                f"{pin.path} holds {m.token_dtype} tokens, the tokenizer recipe says {cfg.tokenizer.token_dtype}",
                file=where,
                key=key,
            )
        manifests[d] = m
    return manifests, notes


def plan_experiment_mixture(
    exp: Experiment, manifests: dict[str, Manifest], exposure_tokens: int | None = None
) -> MixturePlan:
    """The mixture plan of an experiment over its manifests, at its own budget or at
    `exposure_tokens` (a pilot's); MixtureInfeasible names the file."""
    cfg = exp.config
    L = cfg.train.seq_len
    try:
        return plan_mixture(
            {d: num_samples(m.pool_tokens, L) for d, m in manifests.items()},
            {d: v.target_ratio for d, v in cfg.mixture.domains.items()},
            {d: v.max_repetition_ratio for d, v in cfg.mixture.domains.items()},
            cfg.train.exposure_tokens if exposure_tokens is None else exposure_tokens,
            L,
            cfg.train.global_batch_sequences,
        )
    except MixtureInfeasible as e:
        if e.file is not None or exp.path is None:
            raise
        raise MixtureInfeasible(e.detail, file=str(exp.path), key=e.key) from None
