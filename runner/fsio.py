"""Bytes on disk: hashing, canonical JSON, bounded YAML, and writes that readers see whole or not at all.

Owns the durability rules every writer shares (temp file, fsync, rename, fsync the folder) and the
one way YAML is parsed (size, nesting and alias expansion bounded, so a hostile file is refused in
milliseconds instead of hanging whatever walks it). Never decides what is written or where.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from runner.errors import RunnerError, display_path


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


def new_or_empty_folder(path: str | os.PathLike) -> bool:
    """Nothing at `path`, or an empty folder: where a command may put a folder of its own without
    losing anything (export's --out, report's --dest, compare's --out)."""
    path = Path(path)
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def some_names(names: list[str], shown: int = 3) -> str:
    """The first `shown` of `names` for a one-line refusal: `a, b, c ...`."""
    return ", ".join(names[:shown]) + (" ..." if len(names) > shown else "")


def existing_ancestor(path: str | os.PathLike) -> Path:
    """The nearest of `path`'s parents that exists (a link counts, dangling or not): where a folder for
    `path` would be made (export's --out probes it)."""
    return next(p for p in Path(path).absolute().parents if os.path.lexists(p))


def _file_above(path: Path) -> Path | None:
    """The parent of `path` that exists and is not a folder (so nothing can be made under it), if any."""
    ancestor = existing_ancestor(path)
    return None if ancestor.is_dir() else ancestor


def check_output_file(path: str | os.PathLike, key: str) -> Path:
    """`path` as a file a command may write (a --markdown FILE): not a folder, and under no file;
    otherwise one RunnerError naming the flag, before anything is written."""
    path = Path(path)
    if path.is_dir():
        raise RunnerError(f"{path} is a folder: give the file to write", key=key)
    blocker = _file_above(path)
    if blocker is not None:
        raise RunnerError(f"{path} cannot be written: {display_path(blocker)} is a file, not a folder", key=key)
    return path


def check_output_folder(path: str | os.PathLike, key: str) -> Path:
    """`path` as a folder a command may write files into (fit's --out): a folder or nothing yet, under
    no file; otherwise one RunnerError naming the flag, before anything is written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunnerError(f"{path} exists and is not a folder: give a folder", key=key)
    blocker = _file_above(path)
    if blocker is not None:
        raise RunnerError(f"{path} cannot be made: {display_path(blocker)} is a file, not a folder", key=key)
    return path


def staging_folder(dest: str | os.PathLike) -> Path:
    """An empty folder beside `dest` to build its next content in (`replace_folder` puts it in place);
    what a killed writer left beside `dest` before is removed first."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.*-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staged = dest.parent / f".{dest.name}.staged-{os.getpid()}"
    staged.mkdir()
    return staged


def replace_folder(staged: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Put a complete folder in place of `dest` by renames: a reader, or a writer killed at any point,
    sees the old folder, the new one, or none (never part of one). Its files are fsynced first."""
    staged, dest = Path(staged), Path(dest)
    for f in staged.rglob("*"):
        if f.is_file():
            fsync_file(f)
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    if dest.exists():
        os.rename(dest, old)
    os.rename(staged, dest)
    fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


def read_json(path: str | os.PathLike) -> Any:
    """Parsed JSON, or a RunnerError naming the file: missing or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunnerError("missing", file=str(path)) from None
    except IsADirectoryError:
        raise RunnerError("is a folder, not a JSON file", file=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunnerError(f"not valid JSON: {err}", file=str(path)) from None
    except RecursionError:
        raise RunnerError("refused: nested too deeply", file=str(path)) from None


# Bounds on any YAML the project reads. The largest file it writes itself, a run's resolved
# experiment.yaml, is ~3 KB, ~300 nodes and 5 levels deep; these are >100x that, and small enough
# that checking them is instant. A billion-laughs file (9 levels of 10 aliases) expands to 10^9 nodes.
YAML_MAX_BYTES = 16 << 20
YAML_MAX_NODES = 100_000  #: nodes after expanding every alias
YAML_MAX_DEPTH = 64  #: nesting of mappings and lists
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Refused(ValueError):
    """A YAML document outside the bounds."""


def _expanded_size(root) -> int:
    """Nodes of the document with every alias expanded (a tree count of the node graph), or a
    RunnerError for a recursive alias or nesting beyond YAML_MAX_DEPTH. Iterative: never recurses."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, 1, False)]
    while stack:
        node, depth, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = _yaml_children(node)
            sizes[key] = 1 + sum(sizes[id(k)] for k in kids)
            if sizes[key] > YAML_MAX_NODES:
                raise _Refused(f"expands to more than {YAML_MAX_NODES:,} nodes (aliases repeated beyond the bound)")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise _Refused("an alias refers to a node that contains it (recursive alias)")
        if depth > YAML_MAX_DEPTH:
            raise _Refused(f"nested deeper than {YAML_MAX_DEPTH} levels")
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((k, depth + 1, False) for k in _yaml_children(node) if id(k) not in sizes)
    return sizes[id(root)]


def _refuse_duplicate_keys(root, source: Any) -> None:
    """A RunnerError naming the dotted key and both lines where a mapping holds a key twice: PyYAML
    keeps the last one silently (`seed: 1` then `seed: 2` would train with seed 2). Iterative; an
    alias's node is walked once."""
    seen: set[int] = set()
    stack = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else None
                if name is not None and key.tag != "tag:yaml.org,2002:merge":
                    dotted = f"{path}.{name}" if path else name
                    line = key.start_mark.line + 1
                    if name in first:
                        raise RunnerError(
                            f"duplicate key: lines {first[name]} and {line} both set it (YAML keeps the last "
                            "silently): keep one",
                            file=source,
                            key=dotted,
                        )
                    first[name] = line
                    stack.append((value, dotted))
                else:
                    stack.append((value, path))


def _yaml_children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load_yaml_text(text: str, source: Any = None) -> Any:
    """`yaml.safe_load` with bounds: a RunnerError naming `source` for a document that is larger,
    deeper or expands (through aliases) further than the YAML_MAX_* bounds. Syntax errors stay
    yaml.YAMLError, for callers that report the line."""
    if len(text) > YAML_MAX_BYTES:
        raise RunnerError(
            f"{len(text):,} characters: larger than the {YAML_MAX_BYTES:,} a recipe may hold", file=source
        )
    loader = _YAML_LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        _refuse_duplicate_keys(node, source)
        return loader.construct_document(node)
    except _Refused as err:
        raise RunnerError(f"refused: {err}", file=source) from None
    except (ValueError, OverflowError) as err:  # e.g. a date that does not exist, a 5,000-digit integer
        raise RunnerError(f"not valid YAML: {err}", file=source) from None
    except RecursionError:
        raise RunnerError(f"refused: nested deeper than {YAML_MAX_DEPTH} levels", file=source) from None
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike) -> Any:
    """Parsed YAML (bounded: see load_yaml_text), or a RunnerError naming the file: missing,
    unreadable or not valid YAML."""
    try:
        return load_yaml_text(Path(path).read_text(encoding="utf-8"), source=str(path))
    except FileNotFoundError:
        raise RunnerError("missing", file=str(path)) from None
    except IsADirectoryError:
        raise RunnerError("is a folder, not a YAML file", file=str(path)) from None
    except yaml.YAMLError as err:
        raise RunnerError(yaml_error_line(err), file=str(path)) from None
    except UnicodeDecodeError as err:
        raise RunnerError(f"not UTF-8 text: {err.reason} at byte {err.start}", file=str(path)) from None


def yaml_error_line(err: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: its line and problem (PyYAML's own text spans lines)."""
    mark = getattr(err, "problem_mark", None)
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    return f"line {mark.line + 1}: not valid YAML: {problem}" if mark else f"not valid YAML: {problem}"


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
            except (json.JSONDecodeError, RecursionError) as err:
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
