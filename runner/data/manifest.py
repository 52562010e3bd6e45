"""Manifests: the files that pin a domain's token pool, and the pools they describe.

Owns: the manifest format (`runner-manifest/1`), its self-hash, and checking that the shards on
disk are the ones it names. The records it reads into and the memory-mapped pool are in
runner.data.pool.
Never tokenizes and never writes shards (that is `runner.data.prepare`); never trusts a shard
whose size does not match its token count.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from runner.config.load import Experiment
from runner.config.rules import unresolved_revisions
from runner.data.mixture import MixturePlan, plan_mixture
from runner.data.pool import DTYPES, Manifest, Shard
from runner.data.pool import Pool as Pool  # re-exported: the loop imports it from here
from runner.errors import MixtureInfeasible, RunnerError, display_path
from runner.fsio import atomic_write, canonical_json, read_yaml, sha256_file

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


def recipe_key(exp: Experiment, dotted: str) -> tuple[Path | None, str]:
    """(file, key) to name for a resolved key: the recipe file that holds it (`recipes/tokenizer/x.yaml`,
    `sha256`) when the experiment was loaded from recipes, else the experiment and the dotted key."""
    kind, _, rest = dotted.partition(".")
    files = exp.recipe_files
    return (files[kind], rest) if kind in files else (exp.path, dotted)


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
    check_tokenizer_vocabulary(exp)
    if not missing_ok:
        if cfg.tokenizer.sha256 is None:
            file, key = recipe_key(exp, "tokenizer.sha256")
            raise RunnerError(
                f"not pinned: `runner pin {_display(where)}` writes the sha256 of {cfg.tokenizer.path} here",
                file=file,
                key=key,
            )
        for dotted, hub in unresolved_revisions(cfg):
            file, key = recipe_key(exp, dotted)
            raise RunnerError(
                f"'{hub.revision}' is a branch or tag, not a commit: a run must say exactly what it read "
                f"(`runner fetch` then `runner pin {_display(where)}` write the commit)",
                file=file,
                key=key,
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
                    f"not pinned: `runner data prepare` then `runner pin {_display(where)}` write its manifest_sha256 here",
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
        if m.vocab_size > cfg.tokenizer.vocab_size:
            file, vkey = recipe_key(exp, "tokenizer.vocab_size")
            raise RunnerError(
                _vocab_too_small(cfg.tokenizer.vocab_size, m.vocab_size, f"{pin.path} was tokenized with"),
                file=file,
                key=vkey,
            )
        manifests[d] = m
    return manifests, notes


def _vocab_too_small(recipe_vocab: int, ids: int, holder: str) -> str:
    return (
        f"{recipe_vocab:,}, but {holder} {ids:,} ids: the model's embedding and LM head would have no row for "
        f"ids >= {recipe_vocab:,} (an IndexError, a device-side assert on a GPU); set vocab_size: {ids}"
    )


@functools.lru_cache(maxsize=8)
def _tokenizer_ids(path: str, size: int, mtime_ns: int) -> int:
    from runner.data.tokenizer import load_tokenizer, vocab_size_of  # noqa: PLC0415  (tokenizers: only with a file here)

    return vocab_size_of(load_tokenizer(path))


def check_tokenizer_vocabulary(exp: Experiment) -> None:
    """The tokenizer file on this machine emits no id the recipe's `vocab_size` leaves out (a model
    sized for 4,096 ids over a 74,096-id tokenizer crashes at its first batch). Files absent here are
    checked where they are: the manifests' own `vocab_size` is compared by load_experiment_manifests."""
    tok = exp.config.tokenizer
    path = exp.resolve_path(tok.path)
    if not path.is_file():
        return
    if tok.sha256 is not None and sha256_file(path) != tok.sha256:
        return  # validate names the pin mismatch; launch refuses the file
    st = path.stat()
    ids = _tokenizer_ids(str(path), st.st_size, st.st_mtime_ns)
    if ids > tok.vocab_size:
        file, key = recipe_key(exp, "tokenizer.vocab_size")
        raise RunnerError(_vocab_too_small(tok.vocab_size, ids, f"{tok.path} has"), file=file, key=key)


@dataclass(frozen=True)
class PoolSize:
    """A domain's pool and validation sizes in tokens, from its manifest or from the experiment's pins."""

    pool_tokens: int
    validation_tokens: int | None  # None: neither the manifest nor a pin says
    source: str  # "manifest" or "pin"


def pool_sizes(exp, manifests: dict[str, Manifest]) -> dict[str, PoolSize]:
    """Per domain: the manifest's sizes where it is on this machine (a pinned count that disagrees is
    refused: the pin is stale, run `runner pin`), else the counts the experiment pins
    (`data.manifests.D.pool_tokens`, so CI checks feasibility without the data). Domains with
    neither are left out."""
    out: dict[str, PoolSize] = {}
    for d, pin in exp.config.data.manifests.items():
        m = manifests.get(d)
        if m is None:
            if pin.pool_tokens is not None:
                out[d] = PoolSize(pin.pool_tokens, pin.validation_tokens, "pin")
            continue
        for key, actual in (("pool_tokens", m.pool_tokens), ("validation_tokens", m.validation_tokens)):
            pinned = getattr(pin, key)
            if pinned is not None and pinned != actual:
                raise RunnerError(
                    f"pins {pinned:,} but {pin.path} has {actual:,}: run `runner pin {_display(exp.path)}`",
                    file=exp.path,
                    key=f"data.manifests.{d}.{key}",
                )
        out[d] = PoolSize(m.pool_tokens, m.validation_tokens, "manifest")
    return out


def _display(path) -> str:
    return display_path(path) if path is not None else "EXPERIMENT"


#: below this many scored samples a domain's validation loss is mostly noise: its standard error is
#: the spread of per-sample losses / sqrt(samples), a quarter of that spread at 16 samples and more
#: than 70% of it at 2 (the cpu-tiny `legal` domain)
MIN_VALIDATION_SAMPLES = 16


def validation_scored(validation_tokens: int, seq_len: int, samples_per_domain: int) -> tuple[int, int]:
    """(samples, target tokens) a domain's validation loss is averaged over: the first
    `samples_per_domain` windows of its validation pool, clipped to what exists."""
    samples = min(int(samples_per_domain), num_samples(int(validation_tokens), int(seq_len)))
    return samples, samples * int(seq_len)


def small_validation_warning(domain: str, samples: int, tokens: int, samples_asked: int | None = None) -> str | None:
    """The warning for a domain validated on fewer than MIN_VALIDATION_SAMPLES samples, else None.
    `samples_asked` (the eval recipe's samples_per_domain) says whether the data or the recipe limits it."""
    if samples >= MIN_VALIDATION_SAMPLES:
        return None
    if samples == 0:
        return f"domain '{domain}' has no validation samples: its validation loss is never measured"
    fix = (
        "raise eval.samples_per_domain"
        if samples_asked is not None and samples >= samples_asked
        else "hold out more text: `runner data prepare --validation-fraction`"
    )
    return (
        f"domain '{domain}' is validated on {samples} samples ({tokens:,} tokens), fewer than "
        f"{MIN_VALIDATION_SAMPLES}: its validation loss is mostly noise ({fix})"
    )


def small_validation_warnings(exp, sizes: dict[str, PoolSize]) -> list[str]:
    """`file: data.manifests.D: ...` for every domain whose validation set is below the threshold."""
    cfg = exp.config
    asked = cfg.eval.samples_per_domain
    out = []
    for d, size in sorted(sizes.items()):
        if size.validation_tokens is None:
            continue
        samples, tokens = validation_scored(size.validation_tokens, cfg.train.seq_len, asked)
        warning = small_validation_warning(d, samples, tokens, asked)
        if warning:
            out.append(f"{_display(exp.path)}: data.manifests.{d}: {warning}")
    return out


def said_once(warnings: list[str]) -> list[str]:
    """Warnings of several experiments that say the same of the same domain (`<file>: <key>: <text>`:
    the shipped demo's small `legal` validation set, in every experiment built on it) as one line
    naming the files, in the order first seen."""
    groups: dict[str, list[str]] = {}
    for w in warnings:
        file, sep, rest = w.partition(": ")
        groups.setdefault(rest if sep else w, []).append(file if sep else "")
    out = []
    for rest, files in groups.items():
        named = [f for f in files if f]
        if len(named) <= 1:
            out.append(f"{named[0]}: {rest}" if named else rest)
        else:
            shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
            out.append(f"{rest} (in {len(named)} experiments: {shown})")
    return out


def launch_warnings(exp) -> list[str]:
    """What `runner launch` warns about before training: domains with small validation sets."""
    manifests, _ = load_experiment_manifests(exp)
    return small_validation_warnings(exp, pool_sizes(exp, manifests))


def check_experiment_data(exp) -> tuple[list[str], list[str]]:
    """What `runner validate` and `check-pr` check of an experiment's data without training: the pins
    present here (sha256, tokenizer), and the mixture's feasibility over the pools' sizes, from the
    manifests or from the pinned counts. Returns (notes, warnings about small validation sets)."""
    manifests, notes = load_experiment_manifests(exp, missing_ok=True)
    sizes = pool_sizes(exp, manifests)
    if set(sizes) >= set(exp.config.mixture.domains):
        plan_experiment_mixture(exp, sizes)
    return notes, small_validation_warnings(exp, sizes)


def plan_experiment_mixture(
    exp: Experiment, manifests: dict[str, Manifest] | dict[str, PoolSize], exposure_tokens: int | None = None
) -> MixturePlan:
    """The mixture plan of an experiment over its pools (manifests or their pinned sizes), at its own
    budget or at `exposure_tokens` (a pilot's); MixtureInfeasible names the experiment file and, when
    the cap at fault comes from the mixture recipe, the recipe file and key to edit."""
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
        raise MixtureInfeasible(e.detail + _cap_source(exp, e.key), file=str(exp.path), key=e.key) from None


def _cap_source(exp, key: str | None) -> str:
    """' (set in recipes/mixture/x.yaml: domains.D.max_repetition_ratio)' when the recipe holds the cap."""
    rpath = exp.recipe_files.get("mixture")
    if rpath is None or not key or not key.startswith("mixture.domains."):
        return ""
    d = key.split(".")[2]
    try:
        recipe = read_yaml(rpath)
        stated = recipe["domains"][d].get("max_repetition_ratio", 1.0)
    except (RunnerError, KeyError, TypeError, AttributeError):
        return ""
    if float(stated) != float(exp.config.mixture.domains[d].max_repetition_ratio):
        return ""  # the experiment overrides it: the experiment file is the one to edit
    return f" (the cap is set in {display_path(rpath)}: domains.{d}.max_repetition_ratio)"
