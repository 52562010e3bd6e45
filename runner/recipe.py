"""Recipes and experiments: the one schema, composition, validation and the fingerprint.

Owns: reading `recipes/<kind>/<name>.yaml` and `experiments/<name>.yaml`, merging them in a fixed
order, refusing anything that is not pure, well-typed data with `file: dotted.key: message`, and
the experiment fingerprint. Never touches data, models or trackers: checks that need files on
disk (tokenizer hash, manifests) are done here only for the tokenizer pin, because its vocab
decides the token dtype every later stage relies on.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import RunnerError, display_path
from runner.fsio import canonical_json, sha256_file

KINDS = ("tokenizer", "mixture", "model", "optim", "hardware", "eval")
TOKEN_DTYPES = {"uint16": 65_536, "uint32": 4_294_967_296}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RESOLVER_CALL = re.compile(r"\$\{[^}]*:")  # ${name:...} runs code; ${a.b} is plain data


# ---------------------------------------------------------------- the schema, section by section
@dataclass
class TokenizerRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    path: str = "???"  #: tokenizer.json, relative to the project root or absolute
    sha256: Optional[str] = "???"  #: sha256 of that file; null = not pinned yet (launch refuses)
    vocab_size: int = "???"  # type: ignore[assignment]
    eos_id: int = "???"  # type: ignore[assignment]
    token_dtype: str = "???"  #: uint16 (vocab <= 65,536) or uint32


@dataclass
class DomainRecipe:
    target_ratio: float = "???"  # type: ignore[assignment]
    max_repetition_ratio: float = 1.0  #: max epochs over the domain's pool (>= 1.0)


@dataclass
class MixtureRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    domains: dict[str, DomainRecipe] = field(default_factory=dict)


@dataclass
class ModelRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    arch: str = "llama"
    hidden_size: int = "???"  # type: ignore[assignment]
    n_layers: int = "???"  # type: ignore[assignment]
    n_heads: int = "???"  # type: ignore[assignment]
    n_kv_heads: int = "???"  # type: ignore[assignment]
    intermediate_size: int = "???"  # type: ignore[assignment]
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02
    pad_vocab_multiple: int = 1  #: embedding rows = tokenizer vocab rounded up to this multiple
    attn_implementation: str = "sdpa"  #: sdpa | eager | flash_attention_2 | flash_attention_3
    sdpa_kernel: Optional[str] = None  #: sdpa only: pin flash | efficient | cudnn | math (null = torch picks)
    activation_checkpointing: bool = False
    compile: bool = False
    compile_mode: str = "default"  #: torch.compile mode: default | reduce-overhead | max-autotune


@dataclass
class OptimRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    lr: float = "???"  # type: ignore[assignment]
    min_lr_ratio: float = 0.1  #: final lr = lr * min_lr_ratio
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  #: max global grad norm; 0 disables clipping
    fused: bool = False
    schedule: str = "cosine"  #: cosine | wsd | constant, over train.max_duration_tokens
    warmup_tokens: int = 0
    decay_fraction: float = 0.2  #: wsd only: share of max_duration spent decaying


@dataclass
class HardwareRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    accelerator: str = "???"  #: cpu | cuda | rocm
    device_name: str = "???"  #: e.g. "H200 SXM", "MI300X"; must match the detected device
    peak_tflops: Optional[float] = None  #: dense peak for peak_dtype; null = from the peak table
    peak_dtype: str = "bf16"
    peak_source: Optional[str] = None
    memory_gib: float = "???"  # type: ignore[assignment]
    price_per_device_hour_usd: float = "???"  # type: ignore[assignment]
    devices_per_node: int = 1
    nodes: int = 1
    precision: str = "bf16"  #: bf16 (mixed, fp32 master weights) | fp32
    distributed: str = "none"  #: none | ddp | fsdp
    tf32: bool = True
    pin_memory: bool = True
    default_mfu: float = 0.4  #: what the planner assumes before a measurement exists
    cpu_peak: Optional[str] = None  #: CPU, when peak_tflops is null: theoretical (cores x clock x FLOP/cycle) | measured (best fp32 matmul burst)


@dataclass
class EvalRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    interval_steps: int = "???"  # type: ignore[assignment]
    samples_per_domain: int = "???"  # type: ignore[assignment]
    micro_batch_sequences: int = 8


@dataclass
class CheckpointSection:
    interval_steps: int = 1000
    interval_minutes: float = 60.0
    keep_last: int = 3


@dataclass
class TrainSection:
    seq_len: int = "???"  # type: ignore[assignment]
    global_batch_sequences: int = "???"  # type: ignore[assignment]
    micro_batch_sequences: int = "???"  # type: ignore[assignment]
    exposure_tokens: int = "???"  # type: ignore[assignment]
    max_duration_tokens: Optional[int] = None  #: lr-schedule length; null = exposure_tokens
    hard_stop_tokens: Optional[int] = None  #: stop early without changing the schedule
    log_interval_steps: int = 1
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)


@dataclass
class ManifestPin:
    path: str = "???"  #: manifest.json, relative to the project root or absolute
    sha256: Optional[str] = "???"  #: its manifest_sha256; null = not pinned yet (launch refuses)


@dataclass
class DataSection:
    manifests: dict[str, ManifestPin] = field(default_factory=dict)


@dataclass
class PlanSection:
    checkpoint_overhead_fraction: float = 0.02
    eval_overhead_fraction: float = 0.03
    recovery_overhead_fraction: float = 0.05
    raw_bytes_per_token: float = 4.2
    inference_tokens: float = 0.0


@dataclass
class ExperimentSchema:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    seed: int = "???"  # type: ignore[assignment]
    recipes: dict[str, str] = field(default_factory=dict)
    tokenizer: TokenizerRecipe = field(default_factory=TokenizerRecipe)
    mixture: MixtureRecipe = field(default_factory=MixtureRecipe)
    model: ModelRecipe = field(default_factory=ModelRecipe)
    optim: OptimRecipe = field(default_factory=OptimRecipe)
    hardware: HardwareRecipe = field(default_factory=HardwareRecipe)
    eval: EvalRecipe = field(default_factory=EvalRecipe)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    plan: PlanSection = field(default_factory=PlanSection)


RECIPE_SCHEMAS = {
    "tokenizer": TokenizerRecipe, "mixture": MixtureRecipe, "model": ModelRecipe,
    "optim": OptimRecipe, "hardware": HardwareRecipe, "eval": EvalRecipe,
}
#: keys an experiment file may hold at top level (the rest come from recipes)
EXPERIMENT_KEYS = ("name", "version", "description", "base", "seed", "recipes", "overrides", "train", "data", "plan")
CHOICES = {
    "model.arch": ("llama",),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2", "flash_attention_3"),
    "model.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "hardware.accelerator": ("cpu", "cuda", "rocm"),
    "hardware.precision": ("bf16", "fp32"),
    "hardware.distributed": ("none", "ddp", "fsdp"),
    "tokenizer.token_dtype": tuple(TOKEN_DTYPES),
}
#: keys that say how a run is operated, not what it trains: left out of the fingerprint, so
#: relocating data, stopping early or checkpointing more often never changes an experiment's identity.
OPERATIONAL_KEYS = (
    "recipes", "plan", "tokenizer.path", "data.manifests.*.path", "train.hard_stop_tokens",
    "train.checkpoint", "train.log_interval_steps", "eval.interval_steps",
)
LABEL_KEYS = ("name", "version", "description")


# ---------------------------------------------------------------- results
@dataclass
class Experiment:
    """A resolved, validated experiment."""

    config: DictConfig
    fingerprint: str
    path: Optional[Path]
    project_root: Path
    recipe_files: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  #: non-fatal findings (e.g. pins not verifiable here)

    def to_container(self) -> dict:
        return OmegaConf.to_container(self.config, resolve=True)  # type: ignore[return-value]

    def resolve_path(self, p: str) -> Path:
        q = Path(p)
        return q if q.is_absolute() else self.project_root / q


class Problems:
    """Collects every problem in a file so the user sees all of them at once."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, file: Any, key: str, message: str) -> None:
        file = display_path(file)
        line = f"{file}: {key}: {message}" if key else f"{file}: {message}"
        if line not in self.lines:
            self.lines.append(line)

    def raise_if_any(self) -> None:
        if self.lines:
            raise RunnerError("\n".join(self.lines))


# ---------------------------------------------------------------- helpers
def find_project_root(start: Path) -> Path:
    """The nearest folder at or above `start` that holds `recipes/`; else the current folder."""
    start = start.resolve()
    for d in [start, *start.parents]:
        if (d / "recipes").is_dir():
            return d
    return Path.cwd().resolve()


def _did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _read_yaml(path: Path, problems: Problems) -> Optional[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        problems.add(path, "", "file not found")
        return None
    except OSError as e:
        problems.add(path, "", f"cannot read: {e.strerror}")
        return None
    try:
        data = yaml.safe_load(text)
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
                problems.add(path, _join(key, k), "object paths are not allowed: recipes are pure data")
            _check_pure(v, _join(key, k), path, problems)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_pure(v, f"{key}[{i}]", path, problems)
    elif isinstance(node, str) and _RESOLVER_CALL.search(node):
        problems.add(path, key, f"'{node}' calls a resolver: recipes are pure data, only ${{other.key}} interpolation is allowed")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _schema_fields(schema) -> dict[str, Any]:
    """Field name -> resolved type (the module uses postponed annotations, so resolve them)."""
    return typing.get_type_hints(schema)


def _check_keys(node: Any, schema, prefix: str, file: Path, problems: Problems) -> None:
    """Unknown keys and wrong types, with the dotted key and a 'did you mean'."""
    if not isinstance(node, dict):
        problems.add(file, prefix, f"must be a mapping, got {type(node).__name__}")
        return
    fields = _schema_fields(schema)
    for k, v in node.items():
        key = _join(prefix, k)
        if k not in fields:
            problems.add(file, key, f"unknown key{_did_you_mean(k, fields)}")
            continue
        _check_value(v, fields[k], key, file, problems)


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _scalar_ok(v: Any, typ: type) -> bool:
    if typ is bool:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    return isinstance(v, (int, float)) if typ is float else isinstance(v, typ)


def _check_value(v: Any, typ: Any, key: str, file: Path, problems: Problems) -> None:
    args = typing.get_args(typ)
    optional = typing.get_origin(typ) is typing.Union and type(None) in args
    if optional:
        typ = next(a for a in args if a is not type(None))
    if v is None:
        if not optional:
            problems.add(file, key, "must not be null")
        return
    if isinstance(v, str) and (v.startswith("${") or v == "???"):
        return  # interpolation (checked after resolution) or missing (reported later)
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        _check_keys(v, typ, key, file, problems)
    elif origin is dict:
        if not isinstance(v, dict):
            problems.add(file, key, f"must be a mapping, got {type(v).__name__}")
            return
        item_type = typing.get_args(typ)[1]
        for name, item in v.items():
            _check_value(item, item_type, _join(key, name), file, problems)
    elif origin is list:
        item_type = typing.get_args(typ)[0]
        if not isinstance(v, list) or not all(_scalar_ok(x, item_type) for x in v):
            problems.add(file, key, f"must be a list of {_SCALARS[item_type].split(' ', 1)[1]}s, got {v!r}")
    elif typ in _SCALARS and not _scalar_ok(v, typ):
        hint = " (quote it: YAML read it as a number)" if typ is str and isinstance(v, (int, float)) else ""
        problems.add(file, key, f"must be {_SCALARS[typ]}, got {v!r}{hint}")


def parse_ref(ref: Any) -> tuple[str, int]:
    """`llama-1p3b@2` -> ('llama-1p3b', 2)."""
    if not isinstance(ref, str) or ref.count("@") != 1:
        raise ValueError(f"'{ref}' must be NAME@VERSION, e.g. llama-tiny@1")
    name, ver = ref.split("@")
    if not name or not ver.isdigit():
        raise ValueError(f"'{ref}' must be NAME@VERSION with an integer version")
    return name, int(ver)


# ---------------------------------------------------------------- loading one recipe file
def load_recipe_file(path: Path, kind: str, problems: Problems) -> Optional[dict]:
    """Read and check one recipe against its kind's schema (types, unknown keys, labels)."""
    data = _read_yaml(path, problems)
    if data is None:
        return None
    _check_keys(data, RECIPE_SCHEMAS[kind], "", path, problems)
    for label in LABEL_KEYS:
        if label not in data:
            problems.add(path, label, "missing: every recipe has name, version and description")
    if "name" in data and data["name"] != path.stem:
        problems.add(path, "name", f"'{data['name']}' differs from the file name '{path.stem}'")
    v = data.get("version")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        problems.add(path, "version", f"must be an integer >= 1, got {v!r}")
    return data


def recipe_path(root: Path, kind: str, name: str) -> Path:
    return root / "recipes" / kind / f"{name}.yaml"


def available_recipes(root: Path, kind: str) -> list[str]:
    return sorted(p.stem for p in (root / "recipes" / kind).glob("*.yaml"))


# ---------------------------------------------------------------- composing an experiment
def load_experiment(path: str | Path, *, check_files: bool = True) -> Experiment:
    """Resolve and validate `experiments/NAME.yaml`. Raises RunnerError listing every problem."""
    path = Path(path)
    root = find_project_root(path.parent)
    problems = Problems()
    data = _read_yaml(path, problems)
    problems.raise_if_any()
    assert data is not None
    data = _apply_base(data, path, root, problems, seen=(path.resolve(),))
    problems.raise_if_any()
    return compose(data, path, root, problems, check_files=check_files)


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
        name, version = parse_ref(data["base"])
    except ValueError as e:
        problems.add(path, "base", str(e))
        return data
    bpath = root / "experiments" / f"{name}.yaml"
    if not bpath.exists():
        names = sorted(p.stem for p in (root / "experiments").glob("*.yaml"))
        problems.add(path, "base", f"no experiment '{name}' in experiments/{_did_you_mean(name, names)}")
        return data
    if bpath.resolve() in seen:
        problems.add(path, "base", f"cycle through {bpath.name}")
        return data
    bdata = _read_yaml(bpath, problems)
    if bdata is None:
        return data
    if bdata.get("version") != version:
        problems.add(path, "base", f"names {name}@{version} but {bpath.relative_to(root)} is version {bdata.get('version')}")
    bdata = _apply_base(bdata, bpath, root, problems, seen + (bpath.resolve(),))
    own = {k: v for k, v in data.items() if k != "base"}
    merged = _deep_merge({k: v for k, v in bdata.items() if k not in LABEL_KEYS}, own)
    return merged


def compose(data: dict, path: Path, root: Path, problems: Optional[Problems] = None, *,
            check_files: bool = True) -> Experiment:
    problems = problems or Problems()
    for k in data:
        if k not in EXPERIMENT_KEYS:
            problems.add(path, k, f"unknown key{_did_you_mean(k, EXPERIMENT_KEYS + KINDS)}"
                         + (" (recipes are named under 'recipes:', changes go under 'overrides:')" if k in KINDS else ""))
    for label in LABEL_KEYS + ("seed",):
        if label not in data:
            problems.add(path, label, "missing")
    if "name" in data and path.suffix == ".yaml" and path.parent.name == "experiments" and data["name"] != path.stem:
        problems.add(path, "name", f"'{data['name']}' differs from the file name '{path.stem}'")
    refs = data.get("recipes") or {}
    if not isinstance(refs, dict):
        problems.add(path, "recipes", "must be a mapping of kind -> NAME@VERSION")
        refs = {}
    for k in refs:
        if k not in KINDS:
            problems.add(path, f"recipes.{k}", f"unknown recipe kind{_did_you_mean(k, KINDS)}")

    merged: dict[str, Any] = {}
    files: dict[str, Path] = {}
    for kind in KINDS:
        if kind not in refs:
            problems.add(path, f"recipes.{kind}", "missing: every experiment names one recipe of each kind")
            continue
        try:
            name, version = parse_ref(refs[kind])
        except ValueError as e:
            problems.add(path, f"recipes.{kind}", str(e))
            continue
        rpath = recipe_path(root, kind, name)
        if not rpath.exists():
            problems.add(path, f"recipes.{kind}", f"no recipe '{name}' in recipes/{kind}/"
                         + _did_you_mean(name, available_recipes(root, kind)))
            continue
        recipe = load_recipe_file(rpath, kind, problems)
        if recipe is None:
            continue
        if recipe.get("version") != version:
            problems.add(path, f"recipes.{kind}", f"names {name}@{version} but {rpath.relative_to(root)} is version {recipe.get('version')}")
        merged[kind] = recipe
        files[kind] = rpath

    for section in ("train", "data", "plan"):
        if section in data:
            _check_value(data[section], _schema_fields(ExperimentSchema)[section], section, path, problems)
    overrides = data.get("overrides") or {}
    if not isinstance(overrides, dict):
        problems.add(path, "overrides", "must be a mapping of section -> keys")
        overrides = {}
    for section, body in overrides.items():
        if section not in KINDS + ("train", "data", "plan"):
            problems.add(path, f"overrides.{section}", f"unknown section{_did_you_mean(section, KINDS + ('train', 'data', 'plan'))}")
            continue
        if isinstance(body, dict) and any(k in body for k in LABEL_KEYS):
            problems.add(path, f"overrides.{section}", "may not change a recipe's name, version or description")
        _check_value(body, _schema_fields(ExperimentSchema)[section], f"overrides.{section}", path, problems)
    problems.raise_if_any()

    top = {k: data[k] for k in ("name", "version", "description", "seed", "train", "data", "plan") if k in data}
    top["recipes"] = dict(refs)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ExperimentSchema), merged, top, overrides)
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or ""
        msg = str(e).splitlines()[0]
        raise RunnerError(f"{display_path(path)}: {key}: {msg}") from None
    cfg = OmegaConf.create(resolved)
    _check_missing(resolved, "", path, problems)
    problems.raise_if_any()
    notes = validate_rules(cfg, path, root, problems, check_files=check_files)
    problems.raise_if_any()
    OmegaConf.set_readonly(cfg, True)
    return Experiment(config=cfg, fingerprint=fingerprint(cfg), path=path, project_root=root,
                      recipe_files=files, notes=notes)


def _check_missing(node: Any, key: str, path: Path, problems: Problems) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _check_missing(v, _join(key, k), path, problems)
    elif node == "???":
        problems.add(path, key, "missing value")


# ---------------------------------------------------------------- rules across keys
def devices(cfg) -> int:
    """Devices the hardware recipe asks for. Also reads plain dicts (saved run configs, the
    planner's), where a key absent from an older config means 1."""
    hw = cfg.get("hardware") or {}
    return int(hw.get("devices_per_node", 1)) * int(hw.get("nodes", 1))


def global_batch_tokens(cfg) -> int:
    return int(cfg.train.global_batch_sequences) * int(cfg.train.seq_len)


def grad_accum(cfg, world: int | None = None) -> int:
    """Micro steps per optimizer step over `world` processes (default: the recipe's devices). A global
    batch that does not split is a RunnerError on train.micro_batch_sequences, never a rounding."""
    world = devices(cfg) if world is None else int(world)
    batch, micro = int(cfg.train.global_batch_sequences), int(cfg.train.micro_batch_sequences)
    if batch % (micro * world):
        raise RunnerError(f"global batch {batch} does not divide into micro batches of {micro} x {world} "
                          "device(s)", key="train.micro_batch_sequences")
    return batch // (micro * world)


def total_steps(cfg) -> int:
    return int(cfg.train.exposure_tokens) // global_batch_tokens(cfg)


def max_duration_tokens(cfg) -> int:
    m = cfg.train.max_duration_tokens
    return int(cfg.train.exposure_tokens if m is None else m)


def model_vocab_size(cfg) -> int:
    """Embedding rows: the tokenizer's vocab rounded up to model.pad_vocab_multiple."""
    m = int(cfg.model.pad_vocab_multiple)
    return -(-int(cfg.tokenizer.vocab_size) // m) * m


def validate_rules(cfg, path: Path, root: Path, problems: Problems, *, check_files: bool = True) -> list[str]:
    """Rules that span keys. Returns notes for pins that cannot be verified on this machine."""
    notes: list[str] = []
    for key, options in CHOICES.items():
        section, name = key.split(".")
        val = cfg[section][name]
        if val not in options:
            problems.add(path, key, f"'{val}' is not one of {', '.join(options)}{_did_you_mean(val, options)}")
    for kind in KINDS:
        v = cfg[kind].version
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.add(path, f"{kind}.version", f"must be an integer >= 1, got {v!r}")

    if cfg.model.sdpa_kernel is not None and cfg.model.sdpa_kernel not in ("flash", "efficient", "cudnn", "math"):
        problems.add(path, "model.sdpa_kernel", f"'{cfg.model.sdpa_kernel}' is not one of flash, efficient, cudnn, math")
    if cfg.model.sdpa_kernel is not None and cfg.model.attn_implementation != "sdpa":
        problems.add(path, "model.sdpa_kernel", f"only applies to attn_implementation sdpa, not {cfg.model.attn_implementation}")
    tok = cfg.tokenizer
    if tok.token_dtype in TOKEN_DTYPES and tok.vocab_size > TOKEN_DTYPES[tok.token_dtype]:
        problems.add(path, "tokenizer.token_dtype", f"{tok.token_dtype} holds ids below {TOKEN_DTYPES[tok.token_dtype]:,} but vocab_size is {tok.vocab_size:,}: use uint32")
    if not 0 <= tok.eos_id < tok.vocab_size:
        problems.add(path, "tokenizer.eos_id", f"{tok.eos_id} is outside the vocabulary (size {tok.vocab_size})")
    if tok.sha256 is None:
        notes.append(f"{display_path(path)}: tokenizer.sha256: not pinned yet: `runner launch` refuses until it is")
    elif not _SHA256.match(str(tok.sha256)):
        problems.add(path, "tokenizer.sha256", "must be 64 lowercase hex characters")
    elif check_files:
        tpath = Path(tok.path) if Path(tok.path).is_absolute() else root / tok.path
        if not tpath.exists():
            notes.append(f"{display_path(path)}: tokenizer.path: {tok.path} is not on this machine: its sha256 pin is checked at launch")
        else:
            actual = sha256_file(tpath)
            if actual != tok.sha256:
                problems.add(path, "tokenizer.sha256", f"{tok.path} has sha256 {actual}, the recipe pins {tok.sha256}")

    mix = cfg.mixture.domains
    if not mix:
        problems.add(path, "mixture.domains", "at least one domain is required")
    total = 0.0
    for d, spec in mix.items():
        if not 0.0 < spec.target_ratio <= 1.0:
            problems.add(path, f"mixture.domains.{d}.target_ratio", f"must be in (0, 1], got {spec.target_ratio}")
        if spec.max_repetition_ratio < 1.0:
            problems.add(path, f"mixture.domains.{d}.max_repetition_ratio", f"must be >= 1.0 (epochs), got {spec.max_repetition_ratio}")
        total += float(spec.target_ratio)
    if mix and abs(total - 1.0) > 1e-9:
        problems.add(path, "mixture.domains", f"target ratios sum to {total:.6g}, not 1")
    pins = cfg.data.manifests
    for d in mix:
        if d not in pins:
            problems.add(path, f"data.manifests.{d}", f"missing: domain '{d}' of the mixture has no pinned manifest")
    for d, pin in pins.items():
        if d not in mix:
            problems.add(path, f"data.manifests.{d}", f"not a domain of the mixture{_did_you_mean(d, list(mix))}")
        if pin.sha256 is not None and not _SHA256.match(str(pin.sha256)):
            problems.add(path, f"data.manifests.{d}.sha256", "must be 64 lowercase hex characters")

    m = cfg.model
    for k in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "pad_vocab_multiple"):
        if m[k] < 1:
            problems.add(path, f"model.{k}", f"must be >= 1, got {m[k]}")
    if m.n_heads >= 1 and m.hidden_size % m.n_heads:
        problems.add(path, "model.n_heads", f"hidden_size {m.hidden_size} is not divisible by n_heads {m.n_heads}")
    elif m.n_heads >= 1 and (m.hidden_size // m.n_heads) % 2:
        problems.add(path, "model.n_heads", f"head dim {m.hidden_size // m.n_heads} must be even for RoPE")
    if m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads:
        problems.add(path, "model.n_kv_heads", f"n_heads {m.n_heads} is not divisible by n_kv_heads {m.n_kv_heads}")

    o = cfg.optim
    if o.lr <= 0:
        problems.add(path, "optim.lr", f"must be > 0, got {o.lr}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.add(path, "optim.betas", f"must be two numbers in [0, 1), got {list(o.betas)}")
    if not 0 <= o.min_lr_ratio <= 1:
        problems.add(path, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    if not 0 < o.decay_fraction <= 1:
        problems.add(path, "optim.decay_fraction", f"must be in (0, 1], got {o.decay_fraction}")

    hw = cfg.hardware
    for k in ("devices_per_node", "nodes"):
        if hw[k] < 1:
            problems.add(path, f"hardware.{k}", f"must be >= 1, got {hw[k]}")
    if hw.peak_tflops is not None and hw.peak_tflops <= 0:
        problems.add(path, "hardware.peak_tflops", f"must be > 0, got {hw.peak_tflops}")
    if hw.peak_tflops is not None and not hw.peak_source:
        problems.add(path, "hardware.peak_source", "a stated peak_tflops needs its source (datasheet, measurement)")
    if hw.accelerator == "cpu":
        if hw.peak_tflops is None and hw.cpu_peak not in ("theoretical", "measured"):
            problems.add(path, "hardware.cpu_peak", "a CPU has no datasheet peak: state peak_tflops, or set cpu_peak: theoretical | measured")
        if hw.precision != "fp32":
            problems.add(path, "hardware.precision", "CPU training runs in fp32")
    elif hw.peak_tflops is None:
        from runner.hardware import canonical_device  # the peak table lives with the MFU code

        if canonical_device(hw.device_name) is None or hw.peak_dtype != "bf16":
            problems.add(path, "hardware.device_name", f"'{hw.device_name}' has no {hw.peak_dtype} peak in the table: state peak_tflops and peak_source (never another device's number)")

    t = cfg.train
    for k in ("seq_len", "global_batch_sequences", "micro_batch_sequences", "exposure_tokens", "log_interval_steps"):
        if t[k] < 1:
            problems.add(path, f"train.{k}", f"must be >= 1, got {t[k]}")
    if problems.lines:
        return notes
    try:
        grad_accum(cfg)
    except RunnerError as e:
        problems.add(path, e.key, e.detail)
    batch_tokens = global_batch_tokens(cfg)
    for key in ("exposure_tokens", "max_duration_tokens", "hard_stop_tokens"):
        val = t[key]
        if val is not None and val % batch_tokens:
            lo = val // batch_tokens * batch_tokens
            problems.add(path, f"train.{key}",
                         f"{val:,} is not a whole number of global batches of {batch_tokens:,} tokens "
                         f"({t.global_batch_sequences} x {t.seq_len}): use {lo:,} or {lo + batch_tokens:,}")
    if t.max_duration_tokens is not None and t.max_duration_tokens < t.exposure_tokens:
        problems.add(path, "train.max_duration_tokens", f"{t.max_duration_tokens:,} is below exposure_tokens {t.exposure_tokens:,}: use hard_stop_tokens to stop early")
    if t.hard_stop_tokens is not None and not 0 < t.hard_stop_tokens <= t.exposure_tokens:
        problems.add(path, "train.hard_stop_tokens", f"must be in (0, exposure_tokens], got {t.hard_stop_tokens:,}")
    if o.warmup_tokens > max_duration_tokens(cfg):
        problems.add(path, "optim.warmup_tokens", f"{o.warmup_tokens:,} exceeds the schedule length {max_duration_tokens(cfg):,}")
    if cfg.eval.interval_steps < 1 or cfg.eval.samples_per_domain < 1:
        problems.add(path, "eval", "interval_steps and samples_per_domain must be >= 1")
    return notes


# ---------------------------------------------------------------- fingerprint
def _drop(node: Any, pattern: list[str]) -> None:
    if not isinstance(node, dict) or not pattern:
        return
    head, rest = pattern[0], pattern[1:]
    keys = list(node) if head == "*" else [head]
    for k in keys:
        if k not in node:
            continue
        if rest:
            _drop(node[k], rest)
        else:
            del node[k]


def _strip_labels(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_labels(v) for k, v in node.items() if k not in LABEL_KEYS}
    if isinstance(node, list):
        return [_strip_labels(v) for v in node]
    return node


def canonical_meaning(cfg) -> dict:
    """What the experiment trains: the resolved config less labels and operational keys."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, (DictConfig, ListConfig)) else json.loads(json.dumps(cfg))
    data = _strip_labels(data)
    for key in OPERATIONAL_KEYS:
        _drop(data, key.split("."))
    return data


def fingerprint(cfg) -> str:
    """sha256 of the canonical resolved form (sorted keys, resolved interpolations, numbers as
    JSON). Labels (name, version, description), recipe references and operational keys
    (OPERATIONAL_KEYS) are left out: two files that resolve to the same training share it."""
    return hashlib.sha256(canonical_json(canonical_meaning(cfg)).encode()).hexdigest()


def diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain configs."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            out += diff_keys(a.get(k), b.get(k), _join(prefix, k))
        return out
    return [] if a == b else [prefix or "<root>"]


def experiment_from_dict(resolved: dict, project_root: Path | None = None, path: Path | None = None) -> Experiment:
    """Rebuild an Experiment from a saved resolved config (run folders, report folders)."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ExperimentSchema), resolved)
        cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as e:
        raise RunnerError(f"does not fit this runner's experiment schema: {str(e).splitlines()[0]}",
                          file=str(path) if path else None, key=getattr(e, "full_key", None) or None) from None
    OmegaConf.set_readonly(cfg, True)
    return Experiment(config=cfg, fingerprint=fingerprint(cfg), path=path,
                      project_root=project_root or Path.cwd().resolve())


def to_yaml(cfg) -> str:
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, (DictConfig, ListConfig)) else cfg
    return yaml.safe_dump(data, sort_keys=False)
