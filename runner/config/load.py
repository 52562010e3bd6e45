"""Loading recipes and experiments: reading YAML, checking it against the schema, composing.

Owns: reading `recipes/<kind>/<name>.yaml` and `experiments/<name>.yaml`, merging them in a fixed
order (schema defaults, tokenizer, mixture, model, optim, hardware, eval, the experiment's own
sections, then overrides), refusing anything that is not pure, well-typed data with
`file: dotted.key: message`, turning the result into the schema's frozen dataclasses (the typed
config every stage reads), and rebuilding an experiment from a run's saved resolved config.
Types (choices included) are checked here, generically from the schema's annotations; value rules
are each section's `validate` and runner.config.rules'. Never touches data, models or trackers.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import threading
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.config.fingerprint import fingerprint
from runner.config.rules import ResourceRules, check_recipe, validate_experiment
from runner.config.schema import EXPERIMENT_KEYS, KINDS, LABEL_KEYS, RECIPE_SCHEMAS, ExperimentSchema, literal_choices
from runner.config.section import Recipe
from runner.errors import Problems, RunnerError, did_you_mean, display_path, join_key, shown
from runner.fsio import load_yaml_text, read_yaml

_RESOLVER_CALL = re.compile(r"\$\{[^}]*:")  # ${name:...} runs code; ${a.b} is plain data
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")  # an experiment name quoted in a hint
#: a recipe's name: the stem of its file in recipes/KIND/ (a reference never reaches outside that folder)
RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
RECIPE_NAME_RULE = "a letter or digit, then letters, digits, '_', '.', '-'; at most 100; no path"


@dataclass
class Experiment:
    """A resolved, validated experiment: its typed config (frozen) and its fingerprint."""

    config: ExperimentSchema
    fingerprint: str
    path: Path | None
    project_root: Path
    notes: list[str] = field(default_factory=list)  #: non-fatal findings (e.g. pins not verifiable here)
    #: kind -> the recipe file it was composed from (empty for a saved config): where a fix goes
    recipe_files: dict[str, Path] = field(default_factory=dict)

    def to_container(self) -> dict[str, Any]:
        """The resolved config as plain data, in schema order: what a run folder saves as experiment.yaml."""
        return dataclasses.asdict(self.config)

    def resolve_path(self, p: str) -> Path:
        q = Path(p)
        return q if q.is_absolute() else self.project_root / q


def find_project_root(start: Path) -> Path:
    """The nearest folder at or above `start` that holds `recipes/`; else the current folder."""
    start = start.resolve()
    for d in [start, *start.parents]:
        if (d / "recipes").is_dir():
            return d
    return Path.cwd().resolve()


def repo_root(start: Path | None = None) -> Path:
    """The enclosing git checkout of `start` (default cwd), else `start` itself: where the default MLflow
    store lives and what a published run.json's paths are made relative to (find_project_root: where recipes are)."""
    start = Path(start or Path.cwd()).resolve()
    for p in (start, *start.parents):
        if (p / ".git").exists():
            return p
    return start


def _read_yaml(path: Path, problems: Problems) -> dict | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        problems.add(path, "", "file not found")
        return None
    except UnicodeDecodeError as e:
        problems.add(path, "", f"not UTF-8 text: {e.reason} at byte {e.start}")
        return None
    except OSError as e:
        problems.add(path, "", f"cannot read: {e.strerror}")
        return None
    try:
        data = load_yaml_text(text)  # bounded: a billion-laughs file is refused, not expanded
    except RunnerError as e:
        problems.add(path, e.key or "", e.detail)
        return None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "YAML"
        problems.add(path, where, f"not valid YAML: {getattr(e, 'problem', e)}")
        return None
    if not isinstance(data, dict):
        problems.add(path, "", "must be a YAML mapping")
        return None
    _check_pure(data, "", path, problems)
    return data


def _check_pure(node: Any, key: str, path: Path, problems: Problems) -> None:
    """Recipes are data: no resolvers (env lookups, code), no object paths."""
    if isinstance(node, dict):
        for k, v in node.items():
            if not isinstance(k, str):
                problems.add(path, f"{key}{k}", "keys must be strings")
                continue
            if k in ("_target_", "_CLASS_", "_partial_"):
                problems.add(path, join_key(key, k), "object paths are not allowed: recipes are pure data")
            _check_pure(v, join_key(key, k), path, problems)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_pure(v, f"{key}[{i}]", path, problems)
    elif isinstance(node, str) and _RESOLVER_CALL.search(node):
        problems.add(
            path, key, f"'{node}' calls a resolver: recipes are pure data, only ${{other.key}} interpolation is allowed"
        )


def _schema_fields(schema) -> dict[str, Any]:
    """Field name -> resolved type (the module uses postponed annotations, so resolve them)."""
    return typing.get_type_hints(schema)


def _check_keys(node: Any, schema, prefix: str, file: Path, problems: Problems, *, choices: bool = False) -> None:
    """Unknown keys and wrong types, with the dotted key and a 'did you mean'."""
    if not isinstance(node, dict):
        problems.add(file, prefix, f"must be a mapping, got {type(node).__name__}")
        return
    fields = _schema_fields(schema)
    for k, v in node.items():
        key = join_key(prefix, k)
        if k not in fields:
            problems.add(file, key, f"unknown key{did_you_mean(k, fields)}")
            continue
        _check_value(v, fields[k], key, file, problems, choices=choices)


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _scalar_ok(v: Any, typ: type) -> bool:
    if typ is bool:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    return isinstance(v, (int, float)) if typ is float else isinstance(v, typ)


def _check_value(v: Any, typ: Any, key: str, file: Path, problems: Problems, *, choices: bool = False) -> None:
    """`v` against the field type `typ`. A `Literal` is a string here; with `choices` (the composed
    experiment, where a recipe's value and the overrides meet) it must also be one of its values."""
    args = typing.get_args(typ)
    optional = typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        typ = next(a for a in args if a is not type(None))
    if v is None:
        if not optional:
            problems.add(file, key, "must not be null")
        return
    if isinstance(v, str) and (v.startswith("${") or v == "???"):
        return  # interpolation (checked after resolution) or missing (reported later)
    origin = typing.get_origin(typ)
    options = literal_choices(typ)
    if options is not None:
        if not isinstance(v, str):
            problems.add(file, key, f"must be one of {', '.join(options)}, got {shown(v)}")
        elif choices and v not in options:
            problems.add(file, key, f"'{v}' is not one of {', '.join(options)}{did_you_mean(v, options)}")
    elif dataclasses.is_dataclass(typ):
        _check_keys(v, typ, key, file, problems, choices=choices)
    elif origin is dict:
        if not isinstance(v, dict):
            problems.add(file, key, f"must be a mapping, got {type(v).__name__}")
            return
        item_type = typing.get_args(typ)[1]
        for name, item in v.items():
            _check_value(item, item_type, join_key(key, name), file, problems, choices=choices)
    elif origin is list:
        item_type = typing.get_args(typ)[0]
        if not isinstance(v, list) or not all(_scalar_ok(x, item_type) for x in v):
            problems.add(file, key, f"must be a list of {_SCALARS[item_type].split(' ', 1)[1]}s, got {shown(v)}")
    elif typ in _SCALARS and not _scalar_ok(v, typ):
        problems.add(file, key, f"must be {_SCALARS[typ]}, got {shown(v)}{_yaml_hint(v, typ)}")


def _yaml_hint(v: Any, typ: Any) -> str:
    """Why YAML gave a value of the wrong type, where it is the usual reason: a number where text is
    meant, or text that is a number to Python but not to YAML 1.1 (`3e-4` and `1.0e308` are strings
    there: a float needs a dot and a signed exponent, `3.0e-4`)."""
    if typ is str and isinstance(v, (int, float)):
        return " (quote it: YAML read it as a number)"
    if typ in (int, float) and isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return ""
        if typ is int:
            return " (YAML reads it as text: write the integer in full, e.g. 26_000_000_000)"
        return " (YAML reads it as text: write a number with a dot and a signed exponent, e.g. 3.0e-4 or 1.0e+9)"
    return ""


def parse_ref(ref: Any, folder: str = "recipes/KIND/") -> tuple[str, int]:
    """`llama-1p3b@2` -> ('llama-1p3b', 2); NAME is a file's stem in `folder`, never a path."""
    if not isinstance(ref, str) or ref.count("@") != 1:
        raise ValueError(f"'{ref}' must be NAME@VERSION, e.g. llama-tiny@1")
    name, ver = ref.split("@")
    if not name or not ver.isdigit():
        raise ValueError(f"'{ref}' must be NAME@VERSION with an integer version")
    if not RECIPE_NAME.fullmatch(name):
        raise ValueError(f"{ref[:120]!r}: NAME must be a file name in {folder} ({RECIPE_NAME_RULE})")
    return name, int(ver)


def _check_name(data: dict, path: Path, problems: Problems) -> None:
    """A recipe's or experiment's name becomes a file name, runs/<name>/, reports/<name>/ and MLflow's
    experiment: `..` would put a run folder or a published report outside them."""
    name = data.get("name")
    if name is not None and not (isinstance(name, str) and RECIPE_NAME.fullmatch(name)):
        problems.add(path, "name", f"{str(name)[:80]!r} is not a name ({RECIPE_NAME_RULE})")


def load_recipe_file(path: Path, kind: str, problems: Problems, resources: ResourceRules | None = None) -> dict | None:
    """Read and check one recipe on its own: types, unknown keys, labels, then its kind's rules
    (ratios, caps, divisibility, ...) on its values with the schema's defaults filled in, so a
    fault is named in the recipe file, `recipes/mixture/x.yaml: domains.web.max_repetition_ratio`."""
    data = _read_yaml(path, problems)
    if data is None:
        return None
    before = len(problems.lines)
    _check_keys(data, RECIPE_SCHEMAS[kind], "", path, problems, choices=True)
    for label in LABEL_KEYS:
        if label not in data:
            problems.add(path, label, "missing: every recipe has name, version and description")
    _check_name(data, path, problems)
    if "name" in data and data["name"] != path.stem:
        problems.add(path, "name", f"'{data['name']}' differs from the file name '{path.stem}'")
    v = data.get("version")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        problems.add(path, "version", f"must be an integer >= 1, got {shown(v)}")
    if len(problems.lines) == before:
        _check_recipe_values(data, kind, path, problems, resources)
    return data


#: the problems `_check_recipe_values` found, by everything they depend on: `runner validate` composes each
#: recipe into every experiment that names it (18 experiments: 134 checks of 26 recipe files; OmegaConf's
#: merges were about half the verb's time). Value: (resources, lines); bounded, cleared when full.
_RECIPE_CHECKS: dict[tuple, tuple[ResourceRules | None, tuple[str, ...]]] = {}
_RECIPE_CHECKS_MAX = 1024


def _check_recipe_values(
    data: dict, kind: str, path: Path, problems: Problems, resources: ResourceRules | None
) -> None:
    """`_check_values_of` once per recipe content: the check is a function of the values, the kind, the
    path (as written and as shown from the current folder) and the rules object, and reads nothing else
    (no file, no environment; the tokenizer's file is checked in `compose`). repr keeps 1, 1.0, True and
    '1' apart, keys' types included. The rules object is kept with the result and compared by identity."""
    key = (kind, str(path), display_path(path), id(resources), repr(data))
    hit = _RECIPE_CHECKS.get(key)
    if hit is not None and hit[0] is resources:
        lines = hit[1]
    else:
        found = Problems()
        _check_values_of(data, kind, path, found, resources)
        lines = tuple(found.lines)
        if len(_RECIPE_CHECKS) >= _RECIPE_CHECKS_MAX:
            _RECIPE_CHECKS.clear()
        _RECIPE_CHECKS[key] = (resources, lines)
    for line in lines:
        problems.add_line(line)


def _check_values_of(data: dict, kind: str, path: Path, problems: Problems, resources: ResourceRules | None) -> None:
    """A recipe's values on their own, the schema's defaults filled in: its kind's `validate`."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RECIPE_SCHEMAS[kind]), data)
    except OmegaConfBaseException as e:  # a value the schema refuses (a Literal choice)
        problems.add(path, getattr(e, "full_key", "") or "", str(e).splitlines()[0])
        return
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException:
        return  # an interpolation into another section: checked once the experiment composes it
    before = len(problems.lines)
    _check_missing(values, "", path, problems)
    if len(problems.lines) > before:
        return
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RECIPE_SCHEMAS[kind]), values))
    except OmegaConfBaseException as e:
        problems.add(path, getattr(e, "full_key", "") or "", str(e).splitlines()[0])
        return
    assert isinstance(typed, Recipe)
    check_recipe(typed, kind, path, problems, resources)


def recipe_path(root: Path, kind: str, name: str) -> Path:
    return root / "recipes" / kind / f"{name}.yaml"


def available_recipes(root: Path, kind: str) -> list[str]:
    return sorted(p.stem for p in (root / "recipes" / kind).glob("*.yaml"))


def is_resolved_copy(data: dict) -> bool:
    """A run's or a report's experiment.yaml: `recipes` and every recipe section written out at the top
    (an experiment file names its recipes and never holds a section of its own)."""
    return isinstance(data.get("recipes"), dict) and all(isinstance(data.get(k), dict) for k in KINDS)


def _source_hint(data: dict) -> str:
    name = data.get("name")
    return f" (experiments/{name}.yaml)" if isinstance(name, str) and _SAFE_NAME.fullmatch(name) else ""


def _run_copy_hint(folder: Path) -> str:
    copy = folder / "experiment.yaml"
    return f"; `runner show {display_path(folder)}` prints the resolved {display_path(copy)}" if copy.is_file() else ""


def load_experiment(
    path: str | Path, *, check_files: bool = True, resources: ResourceRules | None = None
) -> Experiment:
    """Resolve and validate `experiments/NAME.yaml`. Raises RunnerError listing every problem. The rules
    that need FLOPs or the peak table run only with `resources` (runner.planning.resources.load_experiment
    hands them in: what the CLI calls)."""
    path = Path(path)
    if path.is_dir():
        raise RunnerError(
            f"a folder: give an experiment file (experiments/NAME.yaml){_run_copy_hint(path)}", file=str(path)
        )
    if path.name != "experiment.yaml" and (path.parent / "run.json").is_file():
        folder = display_path(path.parent)
        raise RunnerError(
            f"a file of the run folder {folder}, not an experiment file: `runner launch {folder}` resumes the "
            f"run{_run_copy_hint(path.parent)}",
            file=str(path),
        )
    problems = Problems()
    data = _read_yaml(path, problems)
    problems.raise_if_any()
    assert data is not None
    if is_resolved_copy(data):
        raise RunnerError(
            "a run's resolved experiment (every recipe section written out), not an experiment file: give the "
            f"experiment it was resolved from{_source_hint(data)}; `runner show` prints this copy",
            file=str(path),
        )
    return load_experiment_data(
        data, path, find_project_root(path.parent), check_files=check_files, resources=resources
    )


def load_experiment_data(
    data: dict, path: Path, root: Path, *, check_files: bool = True, resources: ResourceRules | None = None
) -> Experiment:
    """An experiment file's content (not yet written to `path`, e.g. a pilot), resolved and validated
    exactly as `load_experiment` would resolve the file."""
    problems = Problems()
    _check_pure(data, "", path, problems)
    problems.raise_if_any()
    data = _apply_base(data, path, root, problems, seen=(path.resolve(),))
    problems.raise_if_any()
    return compose(data, path, root, problems, check_files=check_files, resources=resources)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _apply_base(data: dict, path: Path, root: Path, problems: Problems, seen: tuple) -> dict:
    """`base: other@N` starts from another experiment's file; this one's keys win."""
    if "base" not in data:
        return data
    try:
        name, version = parse_ref(data["base"], "experiments/")
    except ValueError as e:
        problems.add(path, "base", str(e))
        return data
    bpath = root / "experiments" / f"{name}.yaml"
    if not bpath.exists():
        names = sorted(p.stem for p in (root / "experiments").glob("*.yaml"))
        problems.add(path, "base", f"no experiment '{name}' in experiments/{did_you_mean(name, names)}")
        return data
    if bpath.resolve() in seen:
        problems.add(path, "base", f"cycle through {bpath.name}")
        return data
    bdata = _read_yaml(bpath, problems)
    if bdata is None:
        return data
    if bdata.get("version") != version:
        problems.add(
            path, "base", f"names {name}@{version} but {bpath.relative_to(root)} is version {bdata.get('version')}"
        )
    bdata = _apply_base(bdata, bpath, root, problems, seen + (bpath.resolve(),))
    own = {k: v for k, v in data.items() if k != "base"}
    merged = _deep_merge({k: v for k, v in bdata.items() if k not in LABEL_KEYS}, own)
    return merged


def _check_experiment_keys(data: dict, path: Path, problems: Problems) -> dict[str, Any]:
    """The experiment file's own top-level keys and labels; returns its recipe references."""
    for k in data:
        if k not in EXPERIMENT_KEYS:
            if k in KINDS:  # a section at the top: it belongs to a recipe or under overrides
                said = (
                    f"a recipe section, not an experiment key: name its recipe under 'recipes: {{{k}: ...}}', "
                    f"or put changes under 'overrides: {{{k}: ...}}'"
                )
            else:
                said = f"unknown key{did_you_mean(k, EXPERIMENT_KEYS + KINDS)}"
            problems.add(path, k, said)
    for label in LABEL_KEYS + ("seed",):
        if label not in data:
            problems.add(path, label, "missing")
    _check_name(data, path, problems)
    if "name" in data and path.suffix == ".yaml" and path.parent.name == "experiments" and data["name"] != path.stem:
        problems.add(path, "name", f"'{data['name']}' differs from the file name '{path.stem}'")
    refs = data.get("recipes") or {}
    if not isinstance(refs, dict):
        problems.add(path, "recipes", "must be a mapping of kind -> NAME@VERSION")
        return {}
    for k in refs:
        if k not in KINDS:
            problems.add(path, f"recipes.{k}", f"unknown recipe kind{did_you_mean(k, KINDS)}")
    return refs


def _load_recipes(
    refs: dict[str, Any], path: Path, root: Path, problems: Problems, resources: ResourceRules | None
) -> tuple[dict[str, dict], dict[str, Path]]:
    """Each kind's recipe file named by `refs`, checked against its schema and its version; and the
    files they were read from."""
    recipes: dict[str, dict] = {}
    files: dict[str, Path] = {}
    for kind in KINDS:
        if kind not in refs:
            problems.add(path, f"recipes.{kind}", "missing: every experiment names one recipe of each kind")
            continue
        try:
            name, version = parse_ref(refs[kind], f"recipes/{kind}/")
        except ValueError as e:
            problems.add(path, f"recipes.{kind}", str(e))
            continue
        rpath = recipe_path(root, kind, name)
        if not rpath.exists():
            problems.add(
                path,
                f"recipes.{kind}",
                f"no recipe '{name}' in recipes/{kind}/" + did_you_mean(name, available_recipes(root, kind)),
            )
            continue
        recipe = load_recipe_file(rpath, kind, problems, resources)
        if recipe is None:
            continue
        if recipe.get("version") != version:
            problems.add(
                path,
                f"recipes.{kind}",
                f"names {name}@{version} but {rpath.relative_to(root)} is version {recipe.get('version')}",
            )
        recipes[kind] = recipe
        files[kind] = rpath
    return recipes, files


#: the sections an experiment file writes itself (the others come from its recipes)
OWN_SECTIONS = ("train", "data", "plan", "export")


def _check_sections(data: dict, path: Path, problems: Problems) -> tuple[dict, dict[str, Any], dict[str, str]]:
    """The experiment's own train/data/plan sections and its overrides. Returns the data and the
    overrides without the nulls that drop a domain, and the domains dropped (see _take_dropped_domains)."""
    sections = _schema_fields(ExperimentSchema)
    overrides = data.get("overrides") or {}
    if not isinstance(overrides, dict):
        problems.add(path, "overrides", "must be a mapping of section -> keys")
        overrides = {}
    data, overrides, dropped = _take_dropped_domains(data, overrides)
    for section in OWN_SECTIONS:
        if section in data:
            _check_value(data[section], sections[section], section, path, problems)
    for section, body in overrides.items():
        if section not in KINDS + OWN_SECTIONS:
            problems.add(
                path,
                f"overrides.{section}",
                f"unknown section{did_you_mean(section, KINDS + OWN_SECTIONS)}",
            )
            continue
        if isinstance(body, dict) and any(k in body for k in LABEL_KEYS):
            problems.add(path, f"overrides.{section}", "may not change a recipe's name, version or description")
        _check_value(body, sections[section], f"overrides.{section}", path, problems)
    return data, overrides, dropped


def _typed(layers: list[dict], path: Path, problems: Problems) -> ExperimentSchema:
    """Schema defaults, then each layer, resolved into the schema's dataclasses. OmegaConf does the
    merge so that numbers take their field's type (an int under a float field becomes a float): the
    fingerprint hashes exactly these values."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ExperimentSchema), *layers)
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        _check_missing(resolved, "", path, problems)
        problems.raise_if_any()
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        msg = str(e).splitlines()[0]
        raise RunnerError(f"{display_path(path)}: {key}: {msg}") from None
    assert isinstance(typed, ExperimentSchema)
    return typed


def compose(
    data: dict,
    path: Path,
    root: Path,
    problems: Problems | None = None,
    *,
    check_files: bool = True,
    resources: ResourceRules | None = None,
) -> Experiment:
    """An experiment file's data (base applied) composed with its recipes, typed and validated."""
    problems = problems or Problems()
    refs = _check_experiment_keys(data, path, problems)
    recipes, files = _load_recipes(refs, path, root, problems, resources)
    data, overrides, dropped = _check_sections(data, path, problems)
    problems.raise_if_any()
    top = {k: data[k] for k in ("name", "version", "description", "seed", *OWN_SECTIONS) if k in data}
    top["recipes"] = dict(refs)
    _drop_domains(recipes, top, dropped, path, problems)
    problems.raise_if_any()
    # Choices are judged where a recipe's value and the experiment's overrides meet.
    composed = _deep_merge(_deep_merge(recipes, top), overrides)
    _check_keys(composed, ExperimentSchema, "", path, problems, choices=True)
    problems.raise_if_any()
    cfg = _typed([recipes, top, overrides], path, problems)
    notes = validate_experiment(cfg, path, root, problems, check_files=check_files, resources=resources)
    problems.raise_if_any()
    return Experiment(
        config=cfg, fingerprint=fingerprint(cfg), path=path, project_root=root, notes=notes, recipe_files=files
    )


def _take_dropped_domains(data: dict, overrides: dict) -> tuple[dict, dict, dict[str, str]]:
    """`overrides.mixture.domains.D: null` removes domain D (with its manifest pin) from what the
    recipes and a `base:` give; `data.manifests.D: null` removes only the pin. Returns the data and
    overrides without those nulls, and {domain: the key that dropped it}."""
    dropped: dict[str, str] = {}
    domains = (overrides.get("mixture") or {}).get("domains") if isinstance(overrides.get("mixture"), dict) else None
    if isinstance(domains, dict) and any(v is None for v in domains.values()):
        dropped.update({d: "overrides.mixture.domains" for d, v in domains.items() if v is None})
        mixture = {**overrides["mixture"], "domains": {d: v for d, v in domains.items() if v is not None}}
        overrides = {**overrides, "mixture": mixture}
    pins = (data.get("data") or {}).get("manifests") if isinstance(data.get("data"), dict) else None
    if isinstance(pins, dict) and any(v is None for v in pins.values()):
        for d, v in pins.items():
            if v is None:
                dropped.setdefault(d, "data.manifests")
        data = {**data, "data": {**data["data"], "manifests": {d: v for d, v in pins.items() if v is not None}}}
    return data, overrides, dropped


def _drop_domains(recipes: dict, top: dict, dropped: dict[str, str], path: Path, problems: Problems) -> None:
    """Remove each dropped domain from the mixture recipe (a drop by overrides.mixture.domains) and
    its pin from the experiment's data.manifests (both kinds of drop)."""
    if not dropped:
        return

    def mapping(v: Any) -> dict:
        return v if isinstance(v, dict) else {}

    domains = mapping(mapping(recipes.get("mixture")).get("domains"))
    pins = mapping(mapping(top.get("data")).get("manifests"))
    for d, where in dropped.items():
        if d not in domains and d not in pins:
            problems.add(path, f"{where}.{d}", f"null removes a domain, but there is no domain '{d}' to remove")
        pins.pop(d, None)
        if where == "overrides.mixture.domains":
            domains.pop(d, None)


def _check_missing(node: Any, key: str, path: Path, problems: Problems) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _check_missing(v, join_key(key, k), path, problems)
    elif node == "???":
        problems.add(path, key, "missing value")


#: saved configs this process has typed: repr of the saved mapping -> (typed config, fingerprint). A
#: run's readers (report, audit, export, the close of a launch) type the same experiment.yaml 5-30
#: times, ~40 ms each in OmegaConf; the key is the mapping's repr, taken only where every value is of
#: a plain type whose repr names it exactly (so 1, 1.0, True and "1" are four keys, and key order
#: counts), and each caller gets its own copy of the typed config.
_TYPED_SAVED: dict[str, tuple[ExperimentSchema, str]] = {}
_TYPED_SAVED_MAX = 32
_TYPED_SAVED_LOCK = threading.Lock()
_PLAIN = (str, int, float, bool, type(None))


def _saved_key(resolved: dict) -> str | None:
    """The memo key of a saved config, or None where a value's repr might not name it exactly."""

    def plain(v: Any) -> bool:
        if type(v) is dict:
            return all(type(k) in _PLAIN and plain(x) for k, x in v.items())
        if type(v) is list:
            return all(plain(x) for x in v)
        return type(v) in _PLAIN

    return repr(resolved) if plain(resolved) else None


def experiment_from_dict(resolved: dict, project_root: Path | None = None, path: Path | None = None) -> Experiment:
    """Rebuild an Experiment from a saved resolved config (run folders, report folders). Typed by
    the schema (keys a saved config lacks take its defaults); the value rules are not re-run, so a
    run saved under older rules still reads back. Typed once per process per saved mapping
    (`_TYPED_SAVED`); a config that does not fit is typed, and refused, every time."""
    key = _saved_key(resolved)
    with _TYPED_SAVED_LOCK:
        hit = _TYPED_SAVED.get(key) if key is not None else None
    if hit is None:
        typed, digest = _typed_saved(resolved, path)
        if key is not None:
            with _TYPED_SAVED_LOCK:
                if len(_TYPED_SAVED) >= _TYPED_SAVED_MAX:
                    _TYPED_SAVED.pop(next(iter(_TYPED_SAVED)))  # the oldest
                _TYPED_SAVED[key] = (copy.deepcopy(typed), digest)
    else:
        typed, digest = copy.deepcopy(hit[0]), hit[1]
    return Experiment(config=typed, fingerprint=digest, path=path, project_root=project_root or Path.cwd().resolve())


def _typed_saved(resolved: dict, path: Path | None) -> tuple[ExperimentSchema, str]:
    """A saved config typed by the schema and its fingerprint, or the one line that says why not."""
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ExperimentSchema), resolved))
    except (OmegaConfBaseException, TypeError) as e:  # TypeError: a mapping where a list is (betas: {a: 1})
        raise RunnerError(
            f"does not fit this runner's experiment schema: {str(e).splitlines()[0]}",
            file=str(path) if path else None,
            key=getattr(e, "full_key", None) or _misfit_key(resolved),
        ) from None
    assert isinstance(typed, ExperimentSchema)
    for name, spec in typed.eval.targets.items():  # what every reader of a target relies on, under any rules
        if not spec.downstream and len(spec.thresholds) != 1:
            raise RunnerError(
                "give exactly one of loss_nats or bpb (a validation target is one threshold)",
                file=str(path) if path else None,
                key=f"eval.targets.{name}",
            )
    try:
        digest = fingerprint(typed)
    except RunnerError as e:  # a NaN: name the file it came from
        raise RunnerError(e.detail, file=str(path) if path else None, key=e.key) from None
    return typed, digest


def _misfit_key(resolved: dict) -> str | None:
    """The first key of a saved config whose value cannot be merged into the schema, where OmegaConf's
    error names none (its TypeError for a mapping given where a list belongs)."""

    def fits(path: tuple, value: Any) -> bool:
        for key in reversed(path):
            value = {key: value}
        try:
            OmegaConf.merge(OmegaConf.structured(ExperimentSchema), value)
        except (OmegaConfBaseException, TypeError, ValueError):
            return False
        return True

    def walk(path: tuple, value: Any) -> str | None:
        if fits(path, value):
            return None
        if isinstance(value, dict) and fits(path, {}):  # a mapping belongs here: which of its keys misfits
            for key, child in value.items():
                if found := walk((*path, key), child):
                    return found
        return ".".join(map(str, path))

    for key, value in resolved.items():
        if found := walk((key,), value):
            return found
    return None


def to_yaml(cfg: ExperimentSchema | dict) -> str:
    """The resolved config as YAML in schema order (a run folder's experiment.yaml)."""
    data = dataclasses.asdict(cfg) if isinstance(cfg, ExperimentSchema) else cfg
    return yaml.safe_dump(data, sort_keys=False)


def load_saved_experiment(path: Path, project_root: Path | None = None) -> Experiment:
    """A saved resolved experiment.yaml (a run's or a report's copy), typed by the schema."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise RunnerError("expected a mapping (the resolved experiment config)", file=str(path))
    return experiment_from_dict(data, project_root=project_root, path=Path(path))
