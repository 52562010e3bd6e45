"""Where this process reads and writes its modules' compiled bytecode (.pyc): the one choice a
command makes about it, before torch is imported, and its record (run.json `t_startup`'s `bytecode`).

Owns: the check, the cache folder and the record. Python keeps a module's bytecode beside its source
(`__pycache__`) and writes it there on the first import. An environment installed without bytecode
(uv's default, `pip install --no-compile`) where none can be written beside the sources (a container
image's read-only layer, a cluster's shared environment, or `PYTHONDONTWRITEBYTECODE=1`, which many
images set) makes every process compile torch's and transformers' thousands of modules from source
again: seconds of every start (here, on 2 cores, importing the trainer took 3.5 s reading
bytecode and 6.0-6.3 s compiling torch and transformers each time; `bench/bench_startup.py
--uncompiled`). There, and only there, the runner keeps bytecode in a cache folder of its own
(`sys.pycache_prefix`, and `PYTHONPYCACHEPREFIX` for the processes it starts): the first command
compiles once, the later ones read. Nothing is ever written beside the sources.

`RUNNER_PYCACHE`: the folder (default `<runner cache>/pycache`, i.e. `~/.cache/runner/pycache`, made
private: bytecode is code, so a folder another user owns or may write is never used), or `off` to
leave Python's default alone. A `PYTHONPYCACHEPREFIX` the user set is theirs: never
overridden, and recorded as it is.
Never: imports the packages it checks (their specs are found, not executed).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

#: the package whose bytecode decides: most of what a launch's `imports` part compiles. Only it: a
#: cache folder means every module is compiled once more into it, bytecode beside the sources or not
#: (a fill took 9.4 s here), which a small uncompiled package alone does not repay
PROBES = ("torch",)

#: why the runner chose the folder in PYTHONPYCACHEPREFIX (set beside it, inherited by its workers)
WHY = "RUNNER_PYCACHE_WHY"

#: what this process's `settle` found, for `state`: `why` where it wanted a folder and could use none;
#: `warm` where the runner's folder is used (it held the probes' bytecode when this process settled:
#: True, read; False, compiled into it)
_found: dict[str, Any] = {}


def cache_folder(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    setting = env.get("RUNNER_PYCACHE", "")
    if setting and setting != "off":
        return Path(setting).expanduser()
    from runner.hashcache import cache_dir  # noqa: PLC0415

    return cache_dir() / "pycache"


def _writable(folder: str) -> bool:
    return os.access(folder, os.W_OK)


def uncompiled(
    packages: Iterable[str], writable: Callable[[str], bool] = _writable, dont_write: bool = False
) -> list[str]:
    """The packages, of those installed, whose `__init__` has no bytecode beside it for this Python
    and gets none written there (its folder read-only, or `dont_write`): every process compiles them."""
    out = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None)
        if not origin or not origin.endswith(".py"):
            continue
        if os.path.exists(importlib.util.cache_from_source(origin)):
            continue
        folder = os.path.join(os.path.dirname(origin), "__pycache__")  # where Python would write it
        if dont_write or not writable(folder if os.path.isdir(folder) else os.path.dirname(origin)):
            out.append(name)
    return out


def settle(
    packages: Iterable[str] = PROBES,
    env: Mapping[str, str] | None = None,
    writable: Callable[[str], bool] = _writable,
) -> dict[str, Any]:
    """Choose this process's bytecode cache (once, before the heavy imports) and return `state()`."""
    env = os.environ if env is None else env
    if sys.pycache_prefix:
        if _by_runner():  # a worker of a runner that chose it: it may add what is missing too
            sys.dont_write_bytecode = False
            _found.setdefault("warm", not uncompiled(packages, lambda _: False, dont_write=True))
        return state()  # else the user's choice stands
    _found.clear()
    if env.get("RUNNER_PYCACHE") == "off":
        return state()
    missing = uncompiled(packages, writable, dont_write=sys.dont_write_bytecode)
    if not missing:
        return state()
    where = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "their folder is read-only"
    why = f"{', '.join(missing)}: no bytecode beside the sources, and {where}"
    folder = cache_folder(env)
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        problem = None if writable(str(folder)) else "cannot be written either"
        problem = problem or _not_private(folder)
    except OSError:
        problem = "cannot be written either"
    if problem:
        _found["why"] = f"{why}; {folder} {problem}: every process compiles them"
        return state()
    sys.pycache_prefix = str(folder)  # read and written there only, never beside the sources
    sys.dont_write_bytecode = False
    _found["warm"] = not uncompiled(packages, lambda _: False, dont_write=True)  # looked up in the folder now
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)  # the processes this one starts (torchrun's workers)
    os.environ[WHY] = why  # ... and why, so that their record names the runner, not the user
    return state()


def _not_private(folder: Path) -> str | None:
    """Bytecode is code that runs: a cache folder another user owns or may write is not used (what they
    put there would run as this user)."""
    st = folder.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return "belongs to another user"
    if st.st_mode & 0o022:
        return "may be written by other users (chmod go-w)"
    return None


def _by_runner() -> bool:
    return bool(os.environ.get(WHY)) and os.environ.get("PYTHONPYCACHEPREFIX") == sys.pycache_prefix


def state() -> dict[str, Any]:
    """Where this process's bytecode is read and written, as run.json records it: `cache` is
    "beside the sources" (Python's default) or the folder; `written` False where none is written
    (PYTHONDONTWRITEBYTECODE); `by` who chose a folder (runner, or PYTHONPYCACHEPREFIX); `why`; in the
    runner's folder, `warm`: it held torch's bytecode when this process began (read, not compiled)."""
    out: dict[str, Any] = {
        "cache": sys.pycache_prefix or "beside the sources",
        "written": not sys.dont_write_bytecode,
    }
    if sys.pycache_prefix:
        runner = _by_runner()
        out["by"] = "runner" if runner else "PYTHONPYCACHEPREFIX"
        if runner:
            out["why"] = os.environ[WHY]
            if "warm" in _found:
                out["warm"] = _found["warm"]
    elif "why" in _found:
        out["why"] = _found["why"]
    return out
