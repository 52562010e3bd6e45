"""Maintainer script: regenerate the built-in corpus snapshot from a CPython 3.11 installation.

Owns: which real, PSF-licensed texts make up the three built-in domains, and writing them into
runner/builtin/assets/: prose and legal as deterministic gzip jsonl, code as a zstd parquet file
in the FineWeb-Edu column layout (shipped as bytes, because parquet writers stamp their version
into the file and the manifests record each source's sha256), and with `--tokenizer` the
built-in byte-level BPE (vocab 4096) trained on all three. Runs only when a maintainer refreshes
the snapshot (`python -m runner.data.builtin.snapshot [--tokenizer]`); the build never calls it, so
built-in data does not depend on the user's Python or pyarrow version.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import sys
import sysconfig
import zipfile
from pathlib import Path
from pydoc_data.topics import topics

import pyarrow as pa
import pyarrow.parquet as pq

from runner.data.builtin.build import ASSETS
from runner.data.tokenizer import train_tokenizer, write_trained

CODE_TARGET_BYTES = 1_500_000
CODE_MAX_FILE_BYTES = 60_000  # many mid-sized modules rather than a few giants
SKIPPED_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "__pycache__",
    "turtledemo",
    "config-3.11-x86_64-linux-gnu",
    "lib-dynload",
    "ensurepip",
}
LICENSE_MARKERS = re.compile(
    r"Permission (is hereby granted|to use, copy, modify)|Redistribution and use"
    r"|WITHOUT ANY WARRANTY|THE SOFTWARE IS PROVIDED|Licensed to PSF"
)


def _stdlib() -> Path:
    if sys.version_info[:2] != (3, 11):
        raise SystemExit("the snapshot is defined on CPython 3.11's standard library")
    return Path(sysconfig.get_paths()["stdlib"])


def _py_files(stdlib: Path) -> list[Path]:
    files = [p for p in stdlib.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(stdlib).parts)]
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def code_documents(stdlib: Path) -> list[dict]:
    docs, total_bytes = [], 0
    for p in _py_files(stdlib):
        raw = p.read_bytes()
        if len(raw) > CODE_MAX_FILE_BYTES or len(raw) < 2_000:
            continue
        docs.append({"id": f"cpython-3.11/Lib/{p.relative_to(stdlib).as_posix()}", "text": raw.decode("utf-8")})
        total_bytes += len(raw)
        if total_bytes >= CODE_TARGET_BYTES:
            break
    return docs


def prose_documents() -> list[dict]:
    return [{"id": f"pydoc_data.topics/{name}", "text": topics[name]} for name in sorted(topics)]


def _license_block(text: str) -> str | None:
    """The contiguous comment block that holds a license notice, without its `#` markers."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#") and LICENSE_MARKERS.search(line):
            lo, hi = i, i
            while lo > 0 and lines[lo - 1].lstrip().startswith("#"):
                lo -= 1
            while hi + 1 < len(lines) and lines[hi + 1].lstrip().startswith("#"):
                hi += 1
            block = [re.sub(r"^\s*#+ ?", "", l) for l in lines[lo : hi + 1]]
            return "\n".join(block).strip() + "\n"
    return None


def legal_documents(stdlib: Path) -> list[dict]:
    docs = [{"id": "cpython-3.11/LICENSE.txt", "text": (stdlib / "LICENSE.txt").read_text("utf-8")}]
    for wheel in sorted((stdlib / "ensurepip" / "_bundled").glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for name in sorted(z.namelist()):
                if name.split("/")[-1].startswith("LICENSE"):
                    docs.append({"id": f"cpython-3.11/ensurepip/{name}", "text": z.read(name).decode("utf-8")})
    for p in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        if SKIPPED_DIRS.intersection(p.relative_to(stdlib).parts):
            continue
        block = _license_block(p.read_text("utf-8", errors="replace"))
        if block and len(block) > 200:
            docs.append({"id": f"cpython-3.11/Lib/{p.relative_to(stdlib).as_posix()}#license", "text": block})
    return docs


def gzip_jsonl(docs: list[dict]) -> bytes:
    """Same documents -> same bytes: no mtime or file name in the gzip header."""
    payload = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(payload)
    return buf.getvalue()


def fineweb_parquet(docs: list[dict], path: Path) -> None:
    """FineWeb-Edu's columns; fields with no meaning for stdlib files are null, not invented."""
    rel = [d["id"].removeprefix("cpython-3.11/") for d in docs]
    n = len(docs)
    table = pa.table(
        {
            "text": pa.array([d["text"] for d in docs], pa.string()),
            "id": pa.array([d["id"] for d in docs], pa.string()),
            "dump": pa.array([f"cpython-{sys.version.split()[0]}"] * n, pa.string()),
            "url": pa.array([f"https://github.com/python/cpython/blob/3.11/{r}" for r in rel], pa.string()),
            "date": pa.array([None] * n, pa.string()),
            "file_path": pa.array(rel, pa.string()),
            "language": pa.array(["en"] * n, pa.string()),
            "language_score": pa.array([None] * n, pa.float64()),
            "token_count": pa.array([None] * n, pa.int64()),
            "score": pa.array([None] * n, pa.float64()),
            "int_score": pa.array([None] * n, pa.int64()),
        }
    )
    # Two row groups so the reader's streaming path is exercised.
    pq.write_table(table, path, compression="zstd", compression_level=19, row_group_size=(n + 1) // 2)


def main() -> None:
    stdlib = _stdlib()
    ASSETS.mkdir(exist_ok=True)
    domains = {"code": code_documents(stdlib), "prose": prose_documents(), "legal": legal_documents(stdlib)}
    for domain, docs in domains.items():
        if domain == "code":
            target = ASSETS / "code.parquet"
            fineweb_parquet(docs, target)
        else:
            target = ASSETS / f"{domain}.jsonl.gz"
            target.write_bytes(gzip_jsonl(docs))
        raw_bytes = sum(len(d["text"].encode("utf-8")) for d in docs)
        print(f"{domain}: {len(docs)} documents, {raw_bytes} raw bytes, {target.stat().st_size} bytes stored")
    if "--tokenizer" in sys.argv[1:]:
        texts = [d["text"] for docs in domains.values() for d in docs]
        tokenizer = train_tokenizer(texts, vocab_size=4096)
        paths = write_trained(
            tokenizer, ASSETS, "builtin", "byte-level BPE, vocab 4096, trained on the built-in CPython 3.11 snapshot"
        )
        print("tokenizer:", *paths)


if __name__ == "__main__":
    main()
