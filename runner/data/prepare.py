"""Data preparation: sources -> tokenized shards + a manifest that pins them.

Owns: reading documents (parquet `text` columns, jsonl lines, plain text files, nanoGPT `.bin`
token files), the deterministic validation split, batch tokenization over worker processes,
crash-safe shard writing and the manifest. Output depends only on the inputs and the tokenizer:
never on worker count, batch size, timestamps or absolute paths. Never holds more than a few
batches of text in memory, and never lets a manifest name a shard that is not complete.
"""

from __future__ import annotations

import ctypes
import gzip
import hashlib
import json
import multiprocessing
import os
import signal
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, overload

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from runner.config.data_recipes import DOMAIN_NAME, DOMAIN_NAME_RULE
from runner.data.fetch import experiment_assets, fetched_files
from runner.data.manifest import FORMAT, write_manifest
from runner.data.pool import DTYPES
from runner.data.tokenizer import load_tokenizer, tokenizer_info
from runner.errors import RunnerError, did_you_mean
from runner.fsio import fsync_dir, sha256_file
from runner.host import usable_cores
from runner.progress import counter

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
KINDS = {".parquet": "parquet", ".jsonl": "jsonl"}
SPLIT_RULE = (
    "validation iff int.from_bytes(sha256(utf8(id if the document has one else text))[:8], 'big') / 2**64 < fraction"
)
DEFAULT_SHARD_TOKENS = 100_000_000
BIN_CHUNK_TOKENS = 1 << 22


@dataclass(frozen=True)
class Source:
    path: Path
    name: str  # recorded in the manifest: relative to the input it was found under
    kind: str  # parquet | jsonl | text | nanogpt-bin


def find_sources(inputs: Sequence[str | os.PathLike | Source], input_format: str = "auto") -> list[Source]:
    """Expand inputs (files or folders, walked in sorted order; Sources as given) into sources, in order."""
    sources = []
    for given in inputs:
        if isinstance(given, Source):  # named by the caller (a fetched file: its path in the repo)
            sources.append(given)
            continue
        root = Path(given)
        if root.is_dir():
            files = sorted(
                (p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")),
                key=lambda p: p.relative_to(root).as_posix(),
            )
            for p in files:
                kind = _kind(p, input_format, strict=False)
                if kind:
                    sources.append(Source(p, f"{root.resolve().name}/{p.relative_to(root).as_posix()}", kind))
        elif root.is_file():
            sources.append(Source(root, root.name, _kind(root, input_format, strict=True)))
        else:
            raise RunnerError("input not found" if not root.exists() else "not a file or a folder", file=str(root))
    if not sources:
        raise RunnerError(f"no readable sources in {', '.join(map(str, inputs))}", key="input")
    return sources


@overload
def _kind(path: Path, input_format: str, strict: Literal[True]) -> str: ...
@overload
def _kind(path: Path, input_format: str, strict: Literal[False]) -> str | None: ...
def _kind(path: Path, input_format: str, strict: bool) -> str | None:
    """The reader of `path`; with `strict` (a file named on its own) every file has one."""
    if input_format == "nanogpt-bin":
        return "nanogpt-bin" if (strict or path.suffix == ".bin") else None
    if input_format != "auto":
        raise RunnerError(f"unknown input format {input_format!r} (auto or nanogpt-bin)", key="input_format")
    if path.suffix in KINDS:
        return KINDS[path.suffix]
    if path.name.endswith(".jsonl.gz"):
        return "jsonl"  # read through gzip
    if strict and path.suffix in (".gz", ".zst", ".bz2", ".xz"):
        raise RunnerError(
            f"a compressed file ({path.suffix}): decompress it first (e.g. `gunzip {path.name}`); "
            "only .jsonl.gz is read as it is",
            file=str(path),
        )
    if strict or path.suffix in TEXT_SUFFIXES:
        return "text"
    return None


def iter_documents(source: Source, batch_docs: int = 1024) -> Iterator[tuple[str, str]]:
    """Yield (split key, text) per document: the key is the document id, or its text without one."""
    if source.kind == "parquet":
        pf = _parquet_file(source)
        names = pf.schema_arrow.names
        columns = ["text"] + (["id"] if "id" in names else [])
        row = 0
        for batch in pf.iter_batches(batch_size=batch_docs, columns=columns):
            texts = batch.column("text").to_pylist()
            ids = batch.column("id").to_pylist() if "id" in columns else [None] * len(texts)
            for doc_id, text in zip(ids, texts):
                if text is None:
                    raise RunnerError(f"row {row}: text is null", file=str(source.path), key="text")
                yield (text if doc_id is None else str(doc_id)), text
                row += 1
    elif source.kind == "jsonl":
        yield from _jsonl_documents(source)
    elif source.kind == "text":
        try:
            text = source.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise RunnerError(f"not UTF-8 text: {e}", file=str(source.path)) from None
        yield text, text
    else:
        raise ValueError(f"{source.kind} sources hold tokens, not documents")


def _jsonl_documents(source: Source) -> Iterator[tuple[str, str]]:
    """A jsonl source's documents, a `.jsonl.gz` one read through gzip."""
    gz = source.path.name.endswith(".gz")
    try:
        with gzip.open(source.path, "rt", encoding="utf-8") if gz else open(source.path, encoding="utf-8") as f:
            yield from _json_lines(f, source)
    except UnicodeDecodeError as e:
        raise RunnerError(f"not UTF-8 text: {e}", file=str(source.path)) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise RunnerError(f"not a readable gzip file ({e})", file=str(source.path)) from None


def _json_lines(f, source: Source) -> Iterator[tuple[str, str]]:
    for line_no, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RunnerError(f"line {line_no}: needs a JSON object with `text` ({e})", file=str(source.path)) from None
        if not isinstance(text, str):
            raise RunnerError(f"line {line_no}: `text` is not a string", file=str(source.path), key="text")
        doc_id = record.get("id")
        yield (text if doc_id is None else str(doc_id)), text


def _parquet_file(source: Source):
    """The parquet file of a source, refused unless it has a `text` column of strings (FineWeb-Edu's
    layout). Reads the footer only, so prepare checks every source before it writes anything."""

    try:
        pf = pq.ParquetFile(source.path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise RunnerError(f"not a parquet file: {e}", file=str(source.path)) from None
    schema = pf.schema_arrow
    if "text" not in schema.names:
        raise RunnerError(f"no `text` column (columns: {', '.join(schema.names)})", file=str(source.path), key="text")
    kind = schema.field("text").type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise RunnerError(f"`text` column holds {kind}, not strings", file=str(source.path), key="text")
    return pf


def check_sources(sources: list[Source]) -> None:
    """What can be checked before any output is touched: every parquet source's `text` column."""
    for source in sources:
        if source.kind == "parquet":
            _parquet_file(source)


def is_validation(key: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64 < fraction


class ShardWriter:
    """Writes one split as fixed-size shards: temp file, fsync, rename. Boundaries depend only on
    the token stream, so any batching gives the same bytes."""

    def __init__(self, out_dir: Path, prefix: str, shard_tokens: int, dtype: np.dtype):
        self.out_dir, self.prefix, self.shard_tokens, self.dtype = out_dir, prefix, shard_tokens, dtype
        self.shards: list[dict] = []
        self._file: BinaryIO | None = None

    def _open(self) -> BinaryIO:
        self._final = self.out_dir / f"{self.prefix}-{len(self.shards):05d}.bin"
        self._tmp = self.out_dir / f".{self._final.name}.tmp"
        self._file = open(self._tmp, "wb")
        self._tokens, self._documents, self._hash = 0, 0, hashlib.sha256()
        return self._file

    def _close(self) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(self._tmp, self._final)
        fsync_dir(self.out_dir)
        self.shards.append(
            {
                "path": self._final.name,
                "tokens": self._tokens,
                "documents": self._documents,
                "sha256": self._hash.hexdigest(),
            }
        )

    def write(self, tokens: np.ndarray, doc_ends: np.ndarray) -> None:
        """Append tokens; `doc_ends` are offsets (exclusive) in `tokens` where documents end."""
        tokens = tokens.astype(self.dtype, copy=False)
        pos = 0
        while pos < len(tokens):
            f = self._file or self._open()
            take = min(self.shard_tokens - self._tokens, len(tokens) - pos)
            chunk = tokens[pos : pos + take].tobytes()
            f.write(chunk)
            self._hash.update(chunk)
            self._documents += int(np.count_nonzero((doc_ends > pos) & (doc_ends <= pos + take)))
            self._tokens += take
            pos += take
            if self._tokens == self.shard_tokens:
                self._close()

    def finish(self) -> list[dict]:
        if self._file is not None:
            self._close()
        return self.shards


# Worker state: each process loads the tokenizer once.
_TOKENIZER: Any = None  # a tokenizers.Tokenizer once _init_worker ran
_EOS_ID: int | None = None
_DTYPE: np.dtype | None = None


PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


def die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent dies. A SIGKILLed prepare (finished by rerunning
    it) otherwise leaves workers that print BrokenPipeError tracebacks and tokenize on for nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: workers still end when their task pipe closes
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _init_worker(tokenizer_path: str, eos_id: int, dtype: str, threads_ok: bool) -> None:
    global _TOKENIZER, _EOS_ID, _DTYPE
    die_with_parent()
    if not threads_ok:
        # One process per core already: tokenizers' own thread pool would oversubscribe them.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER = load_tokenizer(tokenizer_path)
    # Document text that spells "<|endoftext|>" must stay text, never become a separator.
    _TOKENIZER.encode_special_tokens = True
    _EOS_ID, _DTYPE = eos_id, DTYPES[dtype]


def tokenize_batch(batch: tuple[list[str], list[str], float]):
    """Batch of documents -> per split (tokens with EOS after each document, document lengths)."""
    keys, texts, fraction = batch
    encode = getattr(_TOKENIZER, "encode_batch_fast", _TOKENIZER.encode_batch)  # no offsets needed
    encodings = encode(texts, add_special_tokens=False)
    out: dict[bool, tuple[list[int], list[int]]] = {True: ([], []), False: ([], [])}
    for key, enc in zip(keys, encodings):
        ids, lengths = out[is_validation(key, fraction)]
        doc = enc.ids
        doc.append(_EOS_ID)
        ids.extend(doc)
        lengths.append(len(doc))
    return {
        split: (np.array(ids, dtype=_DTYPE), np.array(lengths, dtype=np.int64)) for split, (ids, lengths) in out.items()
    }


def _batches(sources: list[Source], batch_docs: int, fraction: float):
    keys, texts = [], []
    for source in sources:
        for key, text in iter_documents(source, batch_docs):
            keys.append(key)
            texts.append(text)
            if len(texts) == batch_docs:
                yield keys, texts, fraction
                keys, texts = [], []
    if texts:
        yield keys, texts, fraction


def _ordered_results(batches, workers: int, init_args: tuple[str, int, str]):
    """Tokenize batches in order; at most 2 batches per worker in flight keeps memory flat."""
    if workers <= 1:
        _init_worker(*init_args, threads_ok=True)
        yield from map(tokenize_batch, batches)
        return
    ctx = multiprocessing.get_context("spawn")  # no inherited tokenizer thread pools
    with ctx.Pool(workers, initializer=_init_worker, initargs=(*init_args, False)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(tokenize_batch, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _refuse_another_domains_folder(out_dir: Path, domain: str) -> None:
    """A rerun rewrites its own domain's folder; a folder whose manifest.json holds another domain
    (`--out data/builtin/code --domain d`), or is no manifest of ours (a web app's, which a rerun removed),
    is refused before anything there is touched."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunnerError("exists and is not a folder: give the folder for the shards and manifest.json", file=out_dir)
    manifest = out_dir / "manifest.json"
    if not manifest.exists():
        return
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or data.get("format") != FORMAT:  # a manifest.json of anything else: removed
        raise RunnerError(
            f"is not a manifest `runner data prepare` wrote ({FORMAT}): preparing here would remove it; "
            "give another --out",
            file=manifest,
        )
    held = data.get("domain")
    if held != domain:
        raise RunnerError(
            f"holds domain {held!r}, not {domain!r}: preparing here would replace its shards; "
            "give another --out (a domain's folder is rewritten only by that domain)",
            file=manifest,
        )


def _clear_outputs(out_dir: Path) -> None:
    """A rerun rewrites every shard; drop the old manifest first so it never names a shard mid-rewrite."""
    manifest = out_dir / "manifest.json"
    if manifest.exists():
        manifest.unlink()
        fsync_dir(out_dir)
    for p in out_dir.iterdir():
        if p.name.startswith((".train-", ".validation-")) and p.name.endswith(".bin.tmp"):
            p.unlink()


def _remove_stale_shards(out_dir: Path, keep: set[str]) -> None:
    for p in out_dir.iterdir():
        if p.name.startswith(("train-", "validation-")) and p.suffix == ".bin" and p.name not in keep:
            p.unlink()


def prepare(
    domain: str,
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    inputs: Sequence[str | os.PathLike | Source],
    tokenizer_sha256: str | None = None,
    validation_fraction: float = 0.02,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    batch_docs: int = 256,
    input_format: str = "auto",
    progress: bool | None = None,
) -> tuple[Path, str]:
    """Tokenize `inputs` into `out_dir`; returns (manifest path, manifest_sha256). Just over 60 lines:
    its checks of every input come before the first write, in one place."""
    if not DOMAIN_NAME.fullmatch(domain):
        raise RunnerError(f"{domain[:120]!r} is not a domain name ({DOMAIN_NAME_RULE})", key="--domain")
    if not 0.0 <= validation_fraction < 1.0:
        raise RunnerError(f"must be in [0, 1), got {validation_fraction}", key="validation_fraction")
    if shard_tokens <= 0 or batch_docs <= 0:
        raise RunnerError("shard_tokens and batch_docs must be positive", key="shard_tokens")
    load_tokenizer(tokenizer_path, tokenizer_sha256)  # refuses a tokenizer that is not the pinned one
    info = tokenizer_info(tokenizer_path)
    dtype = DTYPES[info["token_dtype"]]
    sources = find_sources(inputs, input_format)
    check_sources(sources)  # a bad source is refused before the old outputs are cleared
    out_dir = Path(out_dir)
    _refuse_another_domains_folder(out_dir, domain)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_outputs(out_dir)
    writers = {
        False: ShardWriter(out_dir, "train", shard_tokens, dtype),
        True: ShardWriter(out_dir, "validation", shard_tokens, dtype),
    }
    documents = {False: 0, True: 0}
    # A bar on a terminal, a line a minute in a log file (progress=None); progress=False: silent.
    bar = counter(f"prepare {domain}", "tokens", enabled=progress)
    with bar:
        if input_format == "nanogpt-bin":
            for source in sources:
                split = source.path.name.startswith("val")  # nanoGPT's train.bin / val.bin
                documents[split] += _copy_bin(source, writers[split], info, bar)
        else:
            workers = usable_cores() if workers is None else min(workers, usable_cores())
            init = (str(tokenizer_path), info["eos_id"], info["token_dtype"])
            for result in _ordered_results(_batches(sources, batch_docs, validation_fraction), workers, init):
                for split, (tokens, lengths) in result.items():
                    writers[split].write(tokens, np.cumsum(lengths))
                    documents[split] += len(lengths)
                    bar.update(len(tokens))
    shards, validation_shards = writers[False].finish(), writers[True].finish()
    _remove_stale_shards(out_dir, {s["path"] for s in shards + validation_shards})
    split_rule = "nanoGPT val*.bin files" if input_format == "nanogpt-bin" else SPLIT_RULE
    fields = {
        "format": FORMAT,
        "domain": domain,
        "tokenizer_sha256": info["sha256"],
        "token_dtype": info["token_dtype"],
        "vocab_size": info["vocab_size"],
        "eos_id": info["eos_id"],
        **_pool_fields(shards, validation_shards, documents, {"fraction": validation_fraction, "rule": split_rule}),
        "sources": [{"path": s.name, "kind": s.kind, "sha256": sha256_file(s.path)} for s in sources],
    }
    manifest_path = out_dir / "manifest.json"
    return manifest_path, write_manifest(manifest_path, fields)


def _pool_fields(shards: list[dict], validation_shards: list[dict], documents: dict[bool, int], split: dict) -> dict:
    """The manifest's shards and totals of both splits (validation: True in `documents`)."""
    return {
        "shards": shards,
        "validation_shards": validation_shards,
        "validation": split,
        "pool_tokens": sum(s["tokens"] for s in shards),
        "documents": documents[False],
        "validation_tokens": sum(s["tokens"] for s in validation_shards),
        "validation_documents": documents[True],
    }


def _copy_bin(source: Source, writer: ShardWriter, info: dict, bar) -> int:
    """Re-shard a nanoGPT uint16 token file; documents are counted by their EOS tokens."""
    size_bytes = source.path.stat().st_size
    if size_bytes % 2:
        raise RunnerError(f"{size_bytes} bytes is not a whole number of uint16 tokens", file=str(source.path))
    if size_bytes == 0:
        return 0
    tokens = np.memmap(source.path, dtype="<u2", mode="r")
    documents = 0
    for start in range(0, len(tokens), BIN_CHUNK_TOKENS):
        chunk = np.asarray(tokens[start : start + BIN_CHUNK_TOKENS])
        if int(chunk.max()) >= info["vocab_size"]:
            raise RunnerError(
                f"token id {int(chunk.max())} is outside the tokenizer's vocabulary of {info['vocab_size']}",
                file=str(source.path),
            )
        ends = np.flatnonzero(chunk == info["eos_id"]) + 1
        writer.write(chunk, ends)
        documents += len(ends)
        bar.update(len(chunk))
    return documents


def prepare_experiment(exp, domains: list[str] | None = None, **options) -> list[tuple[str, Path, str]]:
    """`runner data prepare EXPERIMENT`: tokenize each domain's fetched source files (in repo-path
    order, named by their repo paths) with the experiment's tokenizer into the folder of the
    manifest it pins. `options` go to `prepare`. Returns (domain, manifest path, manifest_sha256)."""
    cfg = exp.config
    assets = {a.name: a for a in experiment_assets(exp) if a.key.startswith("mixture.")}
    chosen = list(domains or sorted(assets))
    if not chosen:
        raise RunnerError(
            "no domain names a Hub source (mixture.domains.*.source): prepare with --domain --tokenizer --input --out",
            file=exp.path,
        )
    for d in chosen:
        if d not in assets:
            raise RunnerError(
                f"domain '{d}' names no source{did_you_mean(d, list(assets))}: prepare it with --tokenizer --input --out",
                file=exp.path,
                key=f"mixture.domains.{d}.source",
            )
        if Path(cfg.data.manifests[d].path).name != "manifest.json":
            raise RunnerError(
                "prepare writes manifest.json: name the pin so", file=exp.path, key=f"data.manifests.{d}.path"
            )
    out = []
    for d in chosen:
        record, paths = fetched_files(exp, assets[d])
        sources = [Source(p, f["path"], _kind(p, "auto", strict=True)) for p, f in zip(paths, record["files"])]
        manifest = exp.resolve_path(cfg.data.manifests[d].path)
        path, sha256 = prepare(
            d,
            exp.resolve_path(cfg.tokenizer.path),
            manifest.parent,
            sources,
            tokenizer_sha256=cfg.tokenizer.sha256,
            **options,
        )
        out.append((d, path, sha256))
    return out
