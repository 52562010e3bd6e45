"""Built-in data: a small, real, three-domain corpus built offline into pools and manifests.

Owns: turning the shipped snapshot (runner/builtin/assets/) into sources in three formats
(code -> parquet in FineWeb-Edu columns, prose -> jsonl, legal -> one text file per document)
and running the real `prepare` on each, so every reader is exercised. Same snapshot and
tokenizer -> byte-identical manifests on every run and machine. Never reads the user's Python
installation (that is the maintainer's `snapshot.py`) and never touches the network.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

from runner.data.datacard import BUILTIN, write_datacard
from runner.data.prepare import prepare
from runner.errors import RunnerError
from runner.fsio import sha256_file, some_names

ASSETS = (
    Path(__file__).resolve().parents[2] / "builtin" / "assets"
)  # runner/builtin/assets: package data, a path recipes pin
TOKENIZER_PATH = ASSETS / "tokenizer.json"
DOMAINS = ("code", "prose", "legal")
VALIDATION_FRACTION = 0.05
# Small shards, so the built-in code pool spans several and readers cross shard boundaries.
SHARD_TOKENS = 1 << 18


def _jsonl_records(name: str) -> list[dict]:
    with gzip.open(ASSETS / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_sources(sources_dir: Path) -> dict[str, Path]:
    """Write each domain's source in its own format; returns domain -> input path for prepare."""
    code = sources_dir / "code" / "code.parquet"
    code.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ASSETS / "code.parquet", code)

    prose = sources_dir / "prose" / "prose.jsonl"
    prose.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"id": r["id"], "text": r["text"]}, ensure_ascii=False) + "\n"
        for r in _jsonl_records("prose.jsonl.gz")
    ]
    prose.write_bytes("".join(lines).encode("utf-8"))

    legal = sources_dir / "legal"
    if legal.exists():
        shutil.rmtree(legal)  # a stale file would silently join the domain (_refuse_foreign_domains: only ours)
    legal.mkdir(parents=True)
    for name, record in _legal_files():
        (legal / name).write_bytes(record["text"].encode("utf-8"))
    return {"code": code, "prose": prose, "legal": legal}


def _legal_files() -> list[tuple[str, dict]]:
    """(file name, record) of each built-in legal document, as sources/legal/ holds it."""
    out = []
    for i, record in enumerate(_jsonl_records("legal.jsonl.gz")):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", record["id"].removeprefix("cpython-3.11/")).strip("-")
        out.append((f"{i:03d}-{slug}.txt", record))
    return out


def _refuse_foreign_domains(out_dir: Path, tokenizer_sha256: str) -> None:
    """`--out data` where data/code holds a domain of the user's own (another tokenizer's manifest) is
    refused before anything is written: the build rewrites OUT/code, OUT/prose, OUT/legal and
    OUT/sources/legal whole (a sources/legal/ holding any file but the built-in documents is refused too)."""
    for domain in DOMAINS:
        manifest = out_dir / domain / "manifest.json"
        try:
            held = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue  # none, or unreadable: rebuilt as before
        if not isinstance(held, dict) or held.get("tokenizer_sha256") != tokenizer_sha256:
            raise RunnerError(
                "holds a domain of another tokenizer, not the built-in corpus: `data builtin` would replace it; "
                "give another --out",
                file=manifest,
            )
    legal = out_dir / "sources" / "legal"
    if legal.is_dir():
        ours = {name for name, _ in _legal_files()}
        other = sorted(p.name for p in legal.iterdir() if p.name not in ours or not p.is_file())
        if other:
            raise RunnerError(
                f"holds {some_names(other)}, not the built-in legal documents: "
                "`data builtin` replaces this folder whole; give another --out",
                file=legal,
            )


def build_builtin(out_dir: str | Path = "data/builtin", progress: bool | None = False) -> dict[str, tuple[Path, str]]:
    """Build every built-in domain under `out_dir`; returns {domain: (manifest path, manifest_sha256)}."""
    out_dir = Path(out_dir)
    tokenizer_sha256 = sha256_file(TOKENIZER_PATH)
    _refuse_foreign_domains(out_dir, tokenizer_sha256)
    inputs = write_sources(out_dir / "sources")
    # In-process tokenization: the corpus is small, and worker start-up would dominate.
    built = {
        domain: prepare(
            domain,
            TOKENIZER_PATH,
            out_dir / domain,
            [inputs[domain]],
            tokenizer_sha256=tokenizer_sha256,
            validation_fraction=VALIDATION_FRACTION,
            shard_tokens=SHARD_TOKENS,
            workers=0,
            progress=progress,
        )
        for domain in DOMAINS
    }
    for domain in DOMAINS:  # what each domain is and its licence, beside the manifest (pinned by nothing)
        write_datacard(out_dir / domain, domain, BUILTIN[domain])
    return built
