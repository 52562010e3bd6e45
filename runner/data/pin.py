"""`runner pin EXPERIMENT`: write what an experiment trains on into its recipe files, as data.

Owns: computing the pins from the files on this machine (the tokenizer's sha256; each manifest's
manifest_sha256, pool_tokens and validation_tokens; the Hub commits `runner fetch` resolved),
finding the file and key each pinned value lives in (the experiment, its `base:` chain, overrides,
its recipes), editing those YAML files in place (runner.config.yamltext keeps comments and
layout), bumping each changed file's version and every reference to it (`recipes.KIND: name@N`,
`base: name@N`, transitively), and the diff. Idempotent: when the pins already hold, no file is
touched. Never downloads (runner.data.fetch), tokenizes (runner.data.prepare) or trusts a file
whose provenance disagrees with its record (a tokenizer changed since its fetch, a pool prepared
from other files than were fetched, a pool tokenized with another tokenizer).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner.config.load import find_project_root, load_experiment, parse_ref
from runner.config.rules import ResourceRules
from runner.config.schema import KINDS
from runner.config.yamltext import set_value
from runner.data.fetch import experiment_assets, fetched_files
from runner.data.manifest import load_manifest, recipe_key
from runner.errors import RunnerError, display_path
from runner.fsio import atomic_write, sha256_file


@dataclass
class PinResult:
    changes: dict[Path, tuple[str, str]] = field(default_factory=dict)  #: file -> (old text, new text)
    notes: list[str] = field(default_factory=list)

    def diff(self) -> str:
        out: list[str] = []
        for path, (old, new) in sorted(self.changes.items()):
            name = display_path(path)
            out += difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{name}", f"b/{name}")
        return "".join(out)


def compute_pins(exp) -> tuple[list[tuple[str, Any]], list[str]]:
    """(resolved key, value) for every pin this machine can vouch for, and notes for the rest."""
    cfg = exp.config
    pins: list[tuple[str, Any]] = []
    notes: list[str] = []
    tok_file, tok_key = recipe_key(exp, "tokenizer.path")
    tok_path = exp.resolve_path(cfg.tokenizer.path)
    if not tok_path.is_file():
        raise RunnerError(
            f"{cfg.tokenizer.path} is not here: `runner fetch` it (or put it there)", file=tok_file, key=tok_key
        )
    tok_sha = sha256_file(tok_path)
    pins.append(("tokenizer.sha256", tok_sha))
    assets = {a.name: a for a in experiment_assets(exp)}
    if "tokenizer" in assets:
        record, _ = fetched_files(exp, assets["tokenizer"])
        if record["files"][0]["sha256"] != tok_sha:
            raise RunnerError(
                f"{cfg.tokenizer.path} changed since `runner fetch` verified it: fetch it again",
                file=tok_file,
                key=tok_key,
            )
        pins.append(("tokenizer.hub.revision", record["commit"]))
    for d, pin in cfg.data.manifests.items():
        key = f"data.manifests.{d}"
        mpath = exp.resolve_path(pin.path)
        if not mpath.exists():
            if pin.sha256 is None:
                raise RunnerError(f"{pin.path} is not here: run `runner data prepare` first", file=exp.path, key=key)
            notes.append(f"{display_path(exp.path)}: {key}: {pin.path} is not here: its pins are left as they are")
            continue
        m = load_manifest(mpath, verify="size", key=f"{key}.sha256")
        if m.tokenizer_sha256 != tok_sha:
            raise RunnerError(
                f"{pin.path} was tokenized with tokenizer {m.tokenizer_sha256[:12]}..., {cfg.tokenizer.path} is "
                f"{tok_sha[:12]}...: run `runner data prepare` again",
                file=exp.path,
                key=key,
            )
        if d in assets:
            record, _ = fetched_files(exp, assets[d])
            if [s["sha256"] for s in m.data["sources"]] != [f["sha256"] for f in record["files"]]:
                raise RunnerError(
                    f"{pin.path} was prepared from other files than `runner fetch` downloaded: run "
                    f"`runner data prepare {display_path(exp.path)}` again",
                    file=exp.path,
                    key=key,
                )
            pins.append((f"mixture.domains.{d}.source.revision", record["commit"]))
        pins += [(f"{key}.sha256", m.sha256), (f"{key}.pool_tokens", m.pool_tokens)]
        pins.append((f"{key}.validation_tokens", m.validation_tokens))
    return pins, notes


def _resolved(cfg, dotted: str) -> Any:
    """The resolved value at a dotted key: attributes for sections, items for named domains."""
    node = cfg
    for k in dotted.split("."):
        node = node[k] if isinstance(node, Mapping) else getattr(node, k)
    return node


def _chain(path: Path, root: Path) -> list[tuple[Path, dict]]:
    """The experiment file and its `base:` files, most derived first, each with its raw YAML."""
    out = []
    while True:
        data = yaml.safe_load(path.read_text()) or {}
        out.append((path, data))
        if "base" not in data:
            return out
        path = root / "experiments" / f"{parse_ref(data['base'])[0]}.yaml"


def _has(data: Any, keys: list[str]) -> bool:
    for k in keys:
        if not isinstance(data, dict) or k not in data:
            return False
        data = data[k]
    return True


def locate(exp, chain: list[tuple[Path, dict]], dotted: str) -> tuple[Path, list[str]]:
    """The file and key path a resolved key is written in, most derived file first: a manifest's
    pins beside the `path` that names it; otherwise an override, else the experiment section that
    states the key, else its recipe."""
    section, *rest = dotted.split(".")
    if section == "data":  # data.manifests.D.K: whoever names D's manifest owns its pins
        for path, data in chain:
            for prefix in (["overrides", "data"], ["data"]):
                if _has(data, [*prefix, *rest[:2], "path"]):
                    return path, [*prefix, *rest]
        raise RunnerError("no file of the experiment names this manifest", file=exp.path, key=dotted)
    for path, data in chain:
        if _has(data, ["overrides", section, *rest]):
            return path, ["overrides", section, *rest]
    if section in KINDS:
        return exp.recipe_files[section], rest
    for path, data in chain:
        if _has(data, [section, *rest]):
            return path, [section, *rest]
    raise RunnerError("no file of the experiment states it", file=exp.path, key=dotted)


def _bump_versions(texts: dict[Path, str], originals: dict[Path, str], root: Path) -> None:
    """Bump each changed file's version once and every reference to it, until nothing new changes."""
    experiments = sorted((root / "experiments").rglob("*.yaml"))
    raw = {p: yaml.safe_load(originals.setdefault(p, p.read_text())) or {} for p in experiments}
    queue, bumped = list(texts), set()
    while queue:
        path = queue.pop(0)
        if path in bumped:
            continue
        bumped.add(path)
        data = yaml.safe_load(originals.setdefault(path, path.read_text()))
        old, new = data["version"], data["version"] + 1
        texts[path] = set_value(texts.get(path, originals[path]), ["version"], new, file=str(path))
        kind = path.parent.name if path.parent.parent == root / "recipes" else None
        for exp_path, exp_data in raw.items():
            if kind and (exp_data.get("recipes") or {}).get(kind) == f"{path.stem}@{old}":
                keys = ["recipes", kind]
            elif not kind and path.parent == root / "experiments" and exp_data.get("base") == f"{path.stem}@{old}":
                keys = ["base"]
            else:
                continue
            texts[exp_path] = set_value(
                texts.get(exp_path, originals[exp_path]), keys, f"{path.stem}@{new}", file=str(exp_path)
            )
            queue.append(exp_path)


def pin_experiment(path: str | Path, *, write: bool = True, resources: ResourceRules | None = None) -> PinResult:
    """Pin what this machine holds for the experiment; `write=False` only computes the diff. `resources`:
    the rules that need FLOPs or the peak table, checked on load with the rest (the CLI hands them in)."""
    path = Path(path)
    exp = load_experiment(path, check_files=False, resources=resources)  # a changed tokenizer is what pin is for
    root = find_project_root(path.parent)
    pins, notes = compute_pins(exp)
    chain = _chain(path.resolve(), root)  # resolved: the same file is one key of `texts`
    originals: dict[Path, str] = {}
    texts: dict[Path, str] = {}
    for dotted, value in pins:
        if _resolved(exp.config, dotted) == value:
            continue
        file, keys = locate(exp, chain, dotted)
        text = texts.get(file) or originals.setdefault(file, file.read_text())
        texts[file] = set_value(text, keys, value, file=str(file))
    if texts:
        _bump_versions(texts, originals, root)
    result = PinResult({p: (originals[p], t) for p, t in texts.items() if t != originals[p]}, notes)
    if write:
        for p, (_, new) in result.changes.items():
            atomic_write(p, new.encode())
    return result
