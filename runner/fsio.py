"""Bytes on disk: hashing, canonical JSON, and writes that readers see whole or not at all.

Owns the durability rules every writer shares (temp file, fsync, rename, fsync the folder).
Never decides what is written or where.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml

from runner.errors import RunnerError


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, ASCII, no NaN: the form every sha256 of a JSON object is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def fsync_dir(folder: str | os.PathLike) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write via a temp file, fsync, rename, fsync the folder: readers see all or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: str | os.PathLike) -> Any:
    """Parsed JSON, or a RunnerError naming the file: missing or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunnerError("missing", file=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunnerError(f"not valid JSON: {err}", file=str(path)) from None


def read_yaml(path: str | os.PathLike) -> Any:
    """Parsed YAML, or a RunnerError naming the file: missing or not valid YAML."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise RunnerError("missing", file=str(path)) from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise RunnerError(f"not valid YAML: {err}", file=str(path)) from None


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write(path, json.dumps(data, indent=1).encode())


def read_jsonl(path: str | os.PathLike, *, skip_torn: bool = False) -> list[Any]:
    """One JSON value per line; a missing file is empty; a bad line is a RunnerError naming it.

    `skip_torn` drops bad lines instead: for append-only journals a kill may have torn mid-write,
    read before `repair_jsonl_tail` runs."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                if not skip_torn:
                    raise RunnerError(f"line {n}: not valid JSON: {err}", file=str(path)) from None
    return rows


def repair_jsonl_tail(path: str | os.PathLike) -> None:
    """Drop a last line torn by a SIGKILL, so lines appended later stay one JSON value each."""
    path = Path(path)
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])
