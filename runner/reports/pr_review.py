"""`runner check-pr`: what a pull request that touches recipes or experiments must satisfy.

Owns the comparison of the working tree with a base git ref: every changed recipe or experiment
bumped its version; no experiment changes meaning (fingerprint) without its own file changing and
its version bumping; everything at the head validates as `runner validate` does (each recipe on its
own; each experiment with its mixture's feasibility over the pool sizes it pins, since CI has no
data). Also the reviewer's summary (`--markdown`): for every experiment a PR adds or changes, the
fingerprinted keys that changed and the plan before and after (runner.planning.plan). Never writes
to the repository.
"""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import yaml

from runner.config.fingerprint import canonical_meaning, diff_keys
from runner.config.load import Experiment
from runner.config.schema import KINDS
from runner.data.manifest import check_experiment_data, said_once
from runner.errors import Problems, RunnerError
from runner.fsio import load_yaml_text
from runner.mdtext import code, text
from runner.planning.plan import build_plan
from runner.planning.resources import load_experiment, load_recipe_file

TRACKED = ("recipes", "experiments")


def _git(root: Path, *args: str, binary: bool = False):
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, check=False)
    if out.returncode:
        raise RunnerError(
            f"git {' '.join(args)}: {out.stderr.decode(errors='replace').strip().splitlines()[-1] if out.stderr else 'failed'}"
        )
    return out.stdout if binary else out.stdout.decode()


def _checkout(cwd: Path) -> Path:
    """The git checkout around `cwd`: check-pr compares its files with a base commit."""
    try:
        return Path(_git(cwd, "rev-parse", "--show-toplevel").strip())
    except RunnerError:
        raise RunnerError(f"{cwd} is not in a git checkout: run check-pr inside the project's clone") from None


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


class Loads:
    """Each experiment loaded once per tree ('head', 'base'): check_pr and the review summary share
    them (a load composes every recipe through the schema, seconds each on a busy machine)."""

    def __init__(self) -> None:
        self.done: dict[tuple[str, str], tuple[Experiment | None, RunnerError | None]] = {}

    def get(self, tree: str, rel: str, path: Path, check_files: bool) -> tuple[Experiment | None, RunnerError | None]:
        """(Experiment, None) or (None, the RunnerError it raised)."""
        if (tree, rel) not in self.done:
            try:
                self.done[(tree, rel)] = (load_experiment(path, check_files=check_files), None)
            except RunnerError as e:
                self.done[(tree, rel)] = (None, e)
        return self.done[(tree, rel)]

    def load(self, tree: str, rel: str, path: Path, check_files: bool) -> Experiment:
        """The Experiment, or its RunnerError raised (the same load as `get`, cached)."""
        exp, err = self.get(tree, rel, path, check_files)
        if exp is None:
            raise err or RunnerError("did not load", file=str(path))
        return exp


def _changed_files(root: Path, base: str) -> dict[str, str]:
    """Recipe and experiment files changed since `base` (committed or not), with their git status letter."""
    changed: dict[str, str] = {}
    for line in _git(root, "diff", "--name-status", "--no-renames", base, "--", *TRACKED).splitlines():
        status, rel = line.split("\t", 1)
        changed[rel] = status[0]
    for rel in _git(root, "ls-files", "--others", "--exclude-standard", "--", *TRACKED).splitlines():
        changed[rel] = "A"
    return changed


def _validate_head(root: Path, problems: list[str], report: list[str], loads: Loads) -> dict[str, str]:
    """Every recipe and experiment at the head validates (warnings go to `report`); returns each
    experiment's fingerprint."""
    head_targets = [p for k in KINDS for p in sorted((root / "recipes" / k).glob("*.yaml"))]
    head_targets += sorted((root / "experiments").rglob("*.yaml"))  # pilots live in experiments/pilots/
    head_fp: dict[str, str] = {}
    warnings: list[str] = []
    for path in head_targets:
        rel = str(path.relative_to(root))
        try:
            if path.parent.name in KINDS:
                pr = Problems()
                load_recipe_file(path, path.parent.name, pr)
                pr.raise_if_any()
            else:
                exp = loads.load("head", rel, path, True)
                head_fp[rel] = exp.fingerprint
                # feasibility over the pinned pool sizes: CI has no data, so without them an
                # experiment whose mixture cannot be met would pass here and fail at launch
                warnings += check_experiment_data(exp)[1]
                report.extend(f"warning: {rel}: {w}" for w in _outside_project(exp))
        except RunnerError as e:
            # a base experiment's or recipe's problem is found again through each experiment using it: said once
            for line in str(e).splitlines():
                line = line.replace(str(root) + "/", "")
                if line not in problems:
                    problems.append(line)
    report.extend(f"warning: {w}" for w in said_once(warnings))  # one line per thing said, not per experiment
    return head_fp


def _outside_project(exp) -> list[str]:
    """The Hub sources whose relative local_dir is allowed to leave the project (a reviewer should see it)."""
    return [
        f"mixture.domains.{d}.source.local_dir_outside_project: true: files land in '{spec.source.local_dir}', "
        "outside the project"
        for d, spec in exp.config.mixture.domains.items()
        if spec.source is not None and spec.source.local_dir_outside_project
    ]


def check_pr(base: str, cwd: Path, loads: Loads | None = None) -> tuple[list[str], list[str]]:
    """Returns (problems, report lines). Problems are `file: key: message` lines."""
    loads = loads or Loads()
    root = _checkout(cwd)
    try:
        _git(root, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}")
    except RunnerError:
        raise RunnerError(
            f"{base!r} is not a commit, branch or tag of {root}: name one (`git fetch origin` brings origin/main)",
            key="--base",
        ) from None
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
    head_fp = _validate_head(root, problems, report, loads)

    with tempfile.TemporaryDirectory() as tmp:
        base_root = Path(tmp)
        _materialize(root, base, base_root)
        for rel, fp in head_fp.items():
            old_path = base_root / rel
            if not old_path.exists():
                continue
            old_exp, _ = loads.get("base", rel, old_path, False)
            if old_exp is None:
                continue
            old_fp = old_exp.fingerprint
            if old_fp != fp and rel not in changed:
                cause = [r for r in changed if r.startswith(("recipes/", "experiments/"))]
                problems.append(
                    f"{rel}: fingerprint: changes meaning ({old_fp[:12]} -> {fp[:12]}) although the file did not change; "
                    f"changed since {base}: {', '.join(cause) or 'nothing listed'}: bump its version and say why"
                )
            elif old_fp != fp:
                report.append(f"meaning changed: {rel} ({old_fp[:12]} -> {fp[:12]})")
    return problems, report


# ---- the reviewer's summary ---------------------------------------------------------------------


def review_markdown(base: str, cwd: Path, problems: list[str], loads: Loads | None = None) -> str:
    """Markdown for a pull request's job summary: every experiment the PR adds or changes (its
    resolved config differs from the base's, through its own file or a recipe it uses), with the
    fingerprinted keys that changed and the plan before and after; problems from check_pr first."""
    root = _checkout(cwd)
    lines = [f"## Recipe review against {code(base)}", ""]
    lines += [f"**check-pr: {'FAIL' if problems else 'PASS'}**", ""] + [f"- {code(p)}" for p in problems]
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        base_root = Path(tmp)
        _materialize(root, base, base_root)
        head = {str(p.relative_to(root)): p for p in sorted((root / "experiments").rglob("*.yaml"))}
        old = {str(p.relative_to(base_root)): p for p in sorted((base_root / "experiments").rglob("*.yaml"))}
        loads = loads or Loads()
        for rel in sorted(set(head) | set(old)):
            before, before_err = loads.get("base", rel, old[rel], False) if rel in old else (None, None)
            after, after_err = loads.get("head", rel, head[rel], True) if rel in head else (None, None)
            before_msg = str(before_err).splitlines()[0] if before_err else None
            after_msg = str(after_err).splitlines()[0] if after_err else None
            if before is not None and after is not None and before.to_container() == after.to_container():
                continue
            if rel in old and rel in head and before is None and after is None and before_msg == after_msg:
                continue
            sections.append(_experiment_section(rel, before, before_msg, after, after_msg, root, rel in old))
    if not sections:
        return "\n".join(lines + ["", "No experiment's resolved config changes.", ""])
    return "\n".join(lines + [""] + [line for s in sections for line in s])


def _fp(exp) -> str:
    return code(exp.fingerprint[:12]) if exp is not None else "-"


def _experiment_section(rel, before, before_err, after, after_err, root: Path, existed: bool) -> list[str]:
    status = "deleted" if after is None and after_err is None else ("modified" if existed else "added")
    lines = [f"### {code(rel)} ({status})", ""]
    if after_err:
        lines += [f"Does not validate at the head: {code(after_err)}", ""]
    if before is not None and after is not None:
        same = before.fingerprint == after.fingerprint
        lines += [f"Fingerprint {_fp(before)} -> {_fp(after)}" + (" (same training)" if same else ""), ""]
        lines += _key_changes(before.to_container(), after.to_container())
    elif after is not None:
        lines += [f"Fingerprint {_fp(after)}", ""]
    if status != "deleted":
        lines += _plan_table(before, after, root)
    return lines


def _value(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "(absent)"
        node = node[part]
    return node


def _key_changes(before: dict, after: dict) -> list[str]:
    meaning = diff_keys(canonical_meaning(before), canonical_meaning(after))
    other = [k for k in diff_keys(before, after) if k not in meaning]
    lines = []
    if meaning:
        lines += ["| fingerprinted key | before | after |", "|---|---|---|"]
        lines += [
            f"| {code(k, in_table=True)} | {text(_value(before, k))} | {text(_value(after, k))} |" for k in meaning
        ]
    else:
        lines.append("No fingerprinted key changed: the same training.")
    if other:
        lines += [
            "",
            "Not fingerprinted (labels, recipe references, operational keys): " + ", ".join(code(k) for k in other),
        ]
    return lines + [""]


def _plan_rows(exp, root: Path) -> dict[str, object] | str:
    """The figures a reviewer weighs, or the one line saying why there is no plan."""
    if exp is None:
        return {}
    try:
        plan = build_plan(exp.config, root=root)
    except RunnerError as e:
        return f"no plan: {str(e).splitlines()[0]}"
    t, mem, mix = plan["time"]["assumed"], plan["memory"], plan["mixture"]
    feasible = {"planned": "feasible", "infeasible": "INFEASIBLE"}.get(mix["status"], "not checked")
    if mix["status"] == "planned":
        worst = max(mix["domains"].items(), key=lambda kv: kv[1]["epochs"])
        feasible += f" (most epochs: {worst[0]} {worst[1]['epochs']:.2f})"
    elif mix["status"] == "infeasible":
        feasible += ": " + mix["line"].split("INFEASIBLE: ", 1)[-1]
    else:
        feasible += ": manifests not on this machine"
    return {
        "parameters": plan["params"]["all"],
        "exposure tokens": plan["compute"]["exposure_tokens"],
        f"FLOPs ({plan['convention']['flops_formula']})": plan["compute"]["flops_per_token"]
        * plan["compute"]["exposure_tokens"],
        f"wall-clock hours (MFU {t['mfu']:.0%} assumed)": t["wall_hours"],
        "device-hours": t["device_hours"],
        "cost (USD)": t["cost_usd"],
        "memory per device (GiB)": mem["total_bytes"] / 2**30,
        "fits in device memory": "yes" if mem["fits"] else "NO",
        "mixture": feasible,
    }


def _fmt(v) -> str:
    if isinstance(v, str):
        return text(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    return f"{v:.4g}"


def _plan_table(before, after, root: Path) -> list[str]:
    a, b = _plan_rows(before, root), _plan_rows(after, root)
    notes = [x for x in (a, b) if isinstance(x, str)]
    a = a if isinstance(a, dict) else {}
    b = b if isinstance(b, dict) else {}
    lines = ["| plan | before | after | change |", "|---|---|---|---|"]
    for key in b or a:
        x, y = a.get(key), b.get(key)
        change = ""
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x:
            change = f"{(y - x) / x:+.1%}" if y != x else "same"
        lines.append(f"| {key} | {'-' if x is None else _fmt(x)} | {'-' if y is None else _fmt(y)} | {change} |")
    return lines + [""] + [f"_{text(n)}_" for n in notes] + ([""] if notes else [])
