"""The fetch record `runner fetch` writes and `runner data prepare` and `runner pin` trust, read as typed data.

Owns: the record's format (`runner-fetch/1`: repository, revision, the commit it resolved to, the
recipe's patterns, and per file its repo path, local path, size, sha256, git blob id, whether it is
an LFS file, and the identity of the file on disk when it was verified: size, mtime, ctime, inode),
reading it (a hand-edited record is one line naming the file and the key, never a KeyError), the
journal a fetch appends one verified file to as it lands (`.runner-fetch.jsonl` beside the record,
so a killed fetch resumes where it stopped), and the cheap re-verification of a fetched file: its
identity unchanged means its bytes are the ones verified (any write changes ctime, which no user
can set back, as for the shard cache in runner.data.integrity); changed, it is hashed again.
Never downloads (runner.data.fetch does) and never edits recipes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.fsio import fsync_dir

RECORD_FORMAT = "runner-fetch/1"
_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TOP = {"repo": str, "repo_type": str, "revision": str, "commit": str, "patterns": list, "files": list}
_FILE = {"path": str, "local": str, "size": int, "sha256": str, "git_oid": str, "lfs": bool}


def identity(path: Path) -> list[int]:
    """What says a file is the one verified: size, mtime, ctime (set on every write), inode."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _kind_problem(value: Any, kind: type) -> str | None:
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"must be an integer, got {value!r}"[:160]
    if kind is not int and not isinstance(value, kind):
        return f"must be a {kind.__name__}, got {type(value).__name__}"
    return None


def parse_file_entry(entry: Any, where: str) -> tuple[str, str] | None:
    """(key, problem) of the first thing wrong with one file entry of a record or journal, else None."""
    if not isinstance(entry, dict):
        return where, f"must be a mapping, got {type(entry).__name__}"
    for key, kind in _FILE.items():
        if key not in entry:
            return f"{where}.{key}", "missing"
        problem = _kind_problem(entry[key], kind)
        if problem:
            return f"{where}.{key}", problem
    if entry["size"] < 0:
        return f"{where}.size", f"must be >= 0, got {entry['size']}"
    if not _HEX64.match(entry["sha256"]):
        return f"{where}.sha256", f"'{entry['sha256'][:80]}' is not a sha256 (64 hex)"
    if not _HEX40.match(entry["git_oid"]):
        return f"{where}.git_oid", f"'{entry['git_oid'][:80]}' is not a git blob id (40 hex)"
    ident = entry.get("identity")
    if ident is not None and not (isinstance(ident, list) and len(ident) == 4 and all(type(v) is int for v in ident)):
        return f"{where}.identity", "must be [size, mtime_ns, ctime_ns, inode]"
    return None


def parse_record(data: Any, path: Path) -> dict:
    """The record, checked key by key; a RunnerError naming `path` and the key otherwise."""
    fix = "run `runner fetch` again (it rewrites this file)"

    def bad(key: str, problem: str) -> RunnerError:
        return RunnerError(f"{problem}: {fix}", file=str(path), key=key)

    if not isinstance(data, dict):
        raise RunnerError(f"not a fetch record (a JSON mapping): {fix}", file=str(path))
    if data.get("format") != RECORD_FORMAT:
        raise bad("format", f"{str(data.get('format'))[:40]!r} is not {RECORD_FORMAT}")
    for key, kind in _TOP.items():
        if key not in data:
            raise bad(key, "missing")
        problem = _kind_problem(data[key], kind)
        if problem:
            raise bad(key, problem)
    if not _HEX40.match(data["commit"]):
        raise bad("commit", f"'{data['commit'][:80]}' is not a 40-hex commit")
    for i, p in enumerate(data["patterns"]):
        if not isinstance(p, str):
            raise bad(f"patterns[{i}]", f"must be a string, got {type(p).__name__}")
    for i, entry in enumerate(data["files"]):
        wrong = parse_file_entry(entry, f"files[{i}]")
        if wrong:
            raise bad(*wrong)
    return data


def read_record_file(path: Path) -> dict | None:
    """The record at `path` (typed: see parse_record), or None when there is none."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise RunnerError(f"cannot read the fetch record: {err}", file=str(path)) from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise RunnerError(
            f"not valid JSON ({err}): run `runner fetch` again (it rewrites this file)", file=str(path)
        ) from None
    return parse_record(data, path)


# ---- the journal: one verified file per line, as it lands -----------------------------------------


def journal_path(record_path: Path) -> Path:
    return record_path.with_suffix(".jsonl")


def read_journal(path: Path) -> list[dict]:
    """The file entries a fetch journaled (a line torn by a kill, or not an entry, vouches for nothing)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if parse_file_entry(entry, "") is None:
            out.append(entry)
    return out


def append_journal(path: Path, entry: dict) -> None:
    """One verified file, durable before the next download starts."""
    new = not path.exists()
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if new:
        fsync_dir(path.parent)


# ---- is a fetched file still the one verified? ---------------------------------------------------


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def still_verified(path: Path, entry: dict) -> bool:
    """Whether `path` holds the bytes `entry` verified: unchanged identity (no read), else its sha256."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size != entry["size"]:
            return False
        if entry.get("identity") == identity(path):
            return True
        return sha256_of(path) == entry["sha256"]
    except OSError:
        return False
