"""runner.bytecode: where a command's processes read and write compiled modules. Where an
environment has no bytecode beside torch's sources and none gets written there, the runner keeps it in
a cache of its own, so only the first process compiles; elsewhere it leaves Python's default alone,
and what it chose is recorded (run.json `t_startup`'s `bytecode`)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from trainfixtures import REPO

from runner import bytecode
from runner.training import startup


def _package(root: Path, name: str = "fakepkg") -> Path:
    """An installed package with no bytecode beside its sources."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import part\nVALUE = part.X + 1\n")
    (pkg / "part.py").write_text("X = 41\n")
    return pkg


#: a process as `runner` starts one: the choice made before the package is imported, then a worker
CHILD = """
import json, subprocess, sys
from runner import bytecode
site = sys.argv[1]
sys.path.insert(0, site)
chosen = bytecode.settle(packages=("fakepkg",), writable=lambda p: not p.startswith(site))
import fakepkg
worker = subprocess.run([sys.executable, "-c", "from runner import bytecode; import json; "
                         "print(json.dumps(bytecode.settle(packages=('fakepkg',))))"],
                        capture_output=True, text=True, check=True).stdout
print(json.dumps({"chosen": chosen, "value": fakepkg.VALUE, "cached": fakepkg.__cached__,
                  "worker": json.loads(worker)}))
"""


def _child(site: Path, cache: Path, *flags: str, **env: str) -> tuple[dict, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", bytecode.WHY)}
    proc = subprocess.run(
        [sys.executable, *flags, "-c", CHILD, str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**base, "PYTHONPATH": str(REPO), "RUNNER_PYCACHE": str(cache), "PYTHONDONTWRITEBYTECODE": "1", **env},
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_an_uncompiled_read_only_package_is_compiled_once_into_the_runners_cache(tmp_path):
    site, cache = tmp_path / "site", tmp_path / "cache"
    pkg = _package(site)
    first, _ = _child(site, cache)
    assert first["value"] == 42
    chosen = first["chosen"]
    assert chosen["cache"] == str(cache) and chosen["by"] == "runner" and chosen["written"] is True
    assert chosen["warm"] is False  # nothing in the cache yet: this process compiles into it
    assert chosen["why"] == "fakepkg: no bytecode beside the sources, and PYTHONDONTWRITEBYTECODE is set"
    cached = Path(first["cached"])
    assert cached.is_file() and cache in cached.parents  # written to the cache, made private ...
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert not (pkg / "__pycache__").exists()  # ... and never beside the sources
    # a worker it starts inherits the choice and names the runner as its author, not the user
    assert first["worker"] == {**chosen, "warm": True}  # its parent had compiled fakepkg by then
    # the next process reads it: the import system says it loaded the code object from the cache
    second, trace = _child(site, cache, "-v")
    assert second["value"] == 42 and second["cached"] == first["cached"] and second["chosen"]["warm"] is True
    assert f"code object from {first['cached']}" in trace or f"code object from '{first['cached']}'" in trace
    # off: Python's default, nothing cached (and, with nothing written, nothing beside the sources either)
    off, _ = _child(site, tmp_path / "unused", RUNNER_PYCACHE="off")
    assert off["chosen"] == {"cache": "beside the sources", "written": False}
    assert not (tmp_path / "unused").exists() and not (pkg / "__pycache__").exists()


def test_the_choice_is_made_only_where_every_process_would_compile(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    site = tmp_path / "site"
    _package(site)
    monkeypatch.syspath_prepend(str(site))
    # bytecode written beside the sources on the first import: nothing to do
    assert bytecode.uncompiled(["fakepkg"], writable=lambda p: True) == []
    # a read-only folder, or a Python that writes none: every process compiles it
    assert bytecode.uncompiled(["fakepkg"], writable=lambda p: False) == ["fakepkg"]
    assert bytecode.uncompiled(["fakepkg"], writable=lambda p: True, dont_write=True) == ["fakepkg"]
    # bytecode there already (compiled at install, as pip does): nothing to do, read-only or not
    import py_compile

    origin = str(site / "fakepkg" / "__init__.py")
    py_compile.compile(origin, cfile=__import__("importlib.util").util.cache_from_source(origin))
    assert bytecode.uncompiled(["fakepkg"], writable=lambda p: False, dont_write=True) == []
    # a package not installed, or a module that is no package of sources: never counted
    assert bytecode.uncompiled(["no_such_package_here", "math"], writable=lambda p: False) == []
    # torch here was installed with its bytecode: a launch here leaves Python's default alone
    assert bytecode.uncompiled(bytecode.PROBES, dont_write=True) == []


def test_a_cache_that_cannot_be_written_is_said_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(bytecode, "_found", {})  # what it says stays in this test
    site = tmp_path / "site"
    _package(site)
    monkeypatch.syspath_prepend(str(site))
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder would be: mkdir fails
    got = bytecode.settle(
        packages=("fakepkg",), env={"RUNNER_PYCACHE": str(blocker / "pycache")}, writable=lambda p: False
    )
    assert sys.pycache_prefix is None and "PYTHONPYCACHEPREFIX" not in os.environ
    assert got["cache"] == "beside the sources" and got["why"].endswith(
        "cannot be written either: every process compiles them"
    )
    assert got["why"].startswith("fakepkg: no bytecode beside the sources, and ")


def test_a_cache_folder_others_may_write_is_never_used(tmp_path, monkeypatch):
    """Bytecode is code that runs: one planted in a folder another user may write would run as this one."""
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(bytecode, "_found", {})
    site = tmp_path / "site"
    _package(site)
    monkeypatch.syspath_prepend(str(site))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    got = bytecode.settle(
        packages=("fakepkg",), env={"RUNNER_PYCACHE": str(shared)}, writable=lambda p: p == str(shared)
    )
    assert sys.pycache_prefix is None and got["why"].endswith(
        f"{shared} may be written by other users (chmod go-w): every process compiles them"
    )
    monkeypatch.setattr(os, "getuid", lambda: 12345)  # a folder of another user
    shared.chmod(0o700)
    got = bytecode.settle(
        packages=("fakepkg",), env={"RUNNER_PYCACHE": str(shared)}, writable=lambda p: p == str(shared)
    )
    assert sys.pycache_prefix is None and "belongs to another user" in got["why"]


def test_a_prefix_the_user_set_is_theirs(tmp_path):
    code = "from runner import bytecode; import json; print(json.dumps(bytecode.settle(packages=('torch',))))"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONPYCACHEPREFIX": str(tmp_path / "mine")}
    env.pop(bytecode.WHY, None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["cache"] == str(tmp_path / "mine") and got["by"] == "PYTHONPYCACHEPREFIX" and "why" not in got


def test_the_startup_record_and_report_say_where_bytecode_was_cached():
    clock = startup.StartupClock(origin=0.0)
    rec = clock.record(1)
    assert rec["bytecode"] == bytecode.state()  # what this process ran with, recorded as it is
    why = "torch: no bytecode beside the sources"
    cached = {"cache": "/c/pycache", "written": True, "by": "runner", "why": why, "warm": True}
    attempt = {"attempt": 1, "seconds": 3.0, "parts": {"imports": 2.0}, "first_step_seconds": 1.0, "bytecode": cached}
    line = startup.report_lines({"t_startup": startup.merged(None, attempt)})[0]
    assert line.endswith(f"; bytecode cached in /c/pycache (read from it: {why}).")
    filled = {**attempt, "bytecode": {**cached, "warm": False}}
    assert f"(compiled into it: {why})" in startup.report_lines({"t_startup": startup.merged(None, filled)})[0]
    plain = {**attempt, "bytecode": {"cache": "beside the sources", "written": True}}
    assert "bytecode" not in startup.report_lines({"t_startup": startup.merged(None, plain)})[0]
    unusable = {**attempt, "bytecode": {"cache": "beside the sources", "written": False, "why": "torch: ...; X cannot"}}
    line = startup.report_lines({"t_startup": startup.merged(None, unusable)})[0]
    assert line.endswith("; bytecode compiled by every process (torch: ...; X cannot).")
    users = {**attempt, "bytecode": {"cache": "/mine", "written": True, "by": "PYTHONPYCACHEPREFIX"}}
    assert startup.report_lines({"t_startup": startup.merged(None, users)})[0].endswith(
        "; bytecode cached in /mine (set by PYTHONPYCACHEPREFIX)."
    )
