"""`runner check-pr`: what a pull request that touches recipes or experiments must satisfy.

Owns the comparison of the working tree with a base git ref: every changed recipe or experiment
bumped its version; no experiment changes meaning (fingerprint) without its own file changing and
its version bumping; everything at the head validates as `runner validate` does (each recipe on its
own; each experiment with its mixture's feasibility over the pool sizes it pins, since CI has no
data). Never writes to the repository.
"""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import yaml

from runner.config.load import load_experiment, load_recipe_file
from runner.config.schema import KINDS
from runner.data.manifest import check_experiment_data
from runner.errors import Problems, RunnerError
from runner.fsio import load_yaml_text

TRACKED = ("recipes", "experiments")


def _git(root: Path, *args: str, binary: bool = False):
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, check=False)
    if out.returncode:
        raise RunnerError(
            f"git {' '.join(args)}: {out.stderr.decode(errors='replace').strip().splitlines()[-1] if out.stderr else 'failed'}"
        )
    return out.stdout if binary else out.stdout.decode()


def _is_config(rel: str) -> bool:
    parts = Path(rel).parts
    if not rel.endswith(".yaml"):
        return False
    return (len(parts) == 3 and parts[0] == "recipes" and parts[1] in KINDS) or (
        len(parts) >= 2 and parts[0] == "experiments"
    )


def _version(text: str | None):
    try:
        data = load_yaml_text(text) if text else None
    except (yaml.YAMLError, RunnerError):
        return None
    return data.get("version") if isinstance(data, dict) else None


def _materialize(root: Path, base: str, dest: Path) -> None:
    present = [p for p in TRACKED if _git(root, "ls-tree", "--name-only", base, p).strip()]
    if not present:
        return
    archive = _git(root, "archive", "--format=tar", base, *present, binary=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def _changed_files(root: Path, base: str) -> dict[str, str]:
    """Recipe and experiment files changed since `base` (committed or not), with their git status letter."""
    changed: dict[str, str] = {}
    for line in _git(root, "diff", "--name-status", "--no-renames", base, "--", *TRACKED).splitlines():
        status, rel = line.split("\t", 1)
        changed[rel] = status[0]
    for rel in _git(root, "ls-files", "--others", "--exclude-standard", "--", *TRACKED).splitlines():
        changed[rel] = "A"
    return changed


def _validate_head(root: Path, problems: list[str], report: list[str]) -> dict[str, str]:
    """Every recipe and experiment at the head validates (warnings go to `report`); returns each
    experiment's fingerprint."""
    head_targets = [p for k in KINDS for p in sorted((root / "recipes" / k).glob("*.yaml"))]
    head_targets += sorted((root / "experiments").rglob("*.yaml"))  # pilots live in experiments/pilots/
    head_fp: dict[str, str] = {}
    for path in head_targets:
        rel = str(path.relative_to(root))
        try:
            if path.parent.name in KINDS:
                pr = Problems()
                load_recipe_file(path, path.parent.name, pr)
                pr.raise_if_any()
            else:
                exp = load_experiment(path)
                head_fp[rel] = exp.fingerprint
                # feasibility over the pinned pool sizes: CI has no data, so without them an
                # experiment whose mixture cannot be met would pass here and fail at launch
                report.extend(f"warning: {w}" for w in check_experiment_data(exp)[1])
        except RunnerError as e:
            problems.extend(l.replace(str(root) + "/", "") for l in str(e).splitlines())
    return head_fp


def check_pr(base: str, cwd: Path) -> tuple[list[str], list[str]]:
    """Returns (problems, report lines). Problems are `file: key: message` lines."""
    root = Path(_git(cwd, "rev-parse", "--show-toplevel").strip())
    _git(root, "rev-parse", "--verify", f"{base}^{{commit}}")
    problems: list[str] = []
    report: list[str] = []
    changed = _changed_files(root, base)
    for rel, status in sorted(changed.items()):
        if not _is_config(rel):
            continue
        report.append(f"{ {'A': 'added', 'M': 'modified', 'D': 'deleted'}.get(status, status) }: {rel}")
        if status != "M":
            continue
        old = _version(_git(root, "show", f"{base}:{rel}"))
        new = _version((root / rel).read_text())
        if not isinstance(new, int) or not isinstance(old, int) or new <= old:
            problems.append(
                f"{rel}: version: changed since {base} but its version was not bumped (was {old}, now {new})"
            )
    head_fp = _validate_head(root, problems, report)

    with tempfile.TemporaryDirectory() as tmp:
        base_root = Path(tmp)
        _materialize(root, base, base_root)
        for rel, fp in head_fp.items():
            old_path = base_root / rel
            if not old_path.exists():
                continue
            try:
                old_fp = load_experiment(old_path, check_files=False).fingerprint
            except RunnerError:
                continue
            if old_fp != fp and rel not in changed:
                cause = [r for r in changed if r.startswith(("recipes/", "experiments/"))]
                problems.append(
                    f"{rel}: fingerprint: changes meaning ({old_fp[:12]} -> {fp[:12]}) although the file did not change; "
                    f"changed since {base}: {', '.join(cause) or 'nothing listed'}: bump its version and say why"
                )
            elif old_fp != fp:
                report.append(f"meaning changed: {rel} ({old_fp[:12]} -> {fp[:12]})")
    return problems, report
