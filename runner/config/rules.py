"""Rules across sections, and the step arithmetic every stage derives from the config.

Owns: what a resolved config must satisfy beyond each section's own rules (the schema's
`validate`): the batch split over the hardware's devices, warm-up against the schedule length,
manifests against the mixture's domains, and the tokenizer pin on disk; plus the derived numbers
(devices, gradient accumulation, steps, padded vocab). The rules that need FLOPs or the peak table
(the device has a peak, the model fits, a checkpoint gather fits the host) are
runner.planning.resources', handed in as `ResourceRules` where these are checked: config imports
nothing above it.
Checks that need files on disk are done here only for the tokenizer pin, because its vocab
decides the token dtype every later stage relies on.
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from runner.config.data_recipes import COMMIT_HEX, HubFiles, TokenizerRecipe
from runner.config.eval_recipe import MEAN_DOMAIN
from runner.config.schema import ExperimentSchema, HardwareRecipe
from runner.config.section import SHA256_HEX, Recipe
from runner.errors import Problems, RunnerError, did_you_mean, display_path
from runner.fsio import sha256_file


def devices(cfg: ExperimentSchema) -> int:
    """Devices the hardware recipe plans: devices_per_node x nodes."""
    return cfg.hardware.devices_per_node * cfg.hardware.nodes


def global_batch_tokens(cfg: ExperimentSchema) -> int:
    return cfg.train.global_batch_sequences * cfg.train.seq_len


def grad_accum(cfg: ExperimentSchema, world: int | None = None) -> int:
    """Micro steps per optimizer step over `world` processes (default: the recipe's devices). A global
    batch that does not split is a RunnerError on train.micro_batch_sequences, never a rounding."""
    world = devices(cfg) if world is None else world
    batch, micro = cfg.train.global_batch_sequences, cfg.train.micro_batch_sequences
    if batch % (micro * world):
        raise RunnerError(
            f"global batch {batch} does not divide into micro batches of {micro} x {world} device(s)",
            key="train.micro_batch_sequences",
        )
    return batch // (micro * world)


def total_steps(cfg: ExperimentSchema) -> int:
    return cfg.train.exposure_tokens // global_batch_tokens(cfg)


def max_duration_tokens(cfg: ExperimentSchema) -> int:
    """The lr schedule's length in tokens: train.max_duration_tokens, or the exposure budget."""
    m = cfg.train.max_duration_tokens
    return cfg.train.exposure_tokens if m is None else m


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Embedding rows: the tokenizer's `vocab_size` rounded up to `multiple` (model.pad_vocab_multiple)."""
    for value, key in ((vocab_size, "tokenizer.vocab_size"), (multiple, "model.pad_vocab_multiple")):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise RunnerError(f"must be a positive integer, got {value!r}", key=key)
    return -(-vocab_size // multiple) * multiple


def model_vocab_size(cfg: ExperimentSchema) -> int:
    """Embedding rows: the tokenizer's vocab rounded up to model.pad_vocab_multiple."""
    return padded_vocab_size(cfg.tokenizer.vocab_size, cfg.model.pad_vocab_multiple)


class ResourceRules(Protocol):
    """The rules that need FLOPs or the hardware peak table (runner.planning.resources implements them):
    handed to the loader by the layers above planning, called where the config's own rules are."""

    def check_hardware(self, hw: HardwareRecipe, path: Path, problems: Problems, prefix: str) -> None: ...

    def check_experiment(self, cfg: ExperimentSchema, path: Path, problems: Problems) -> list[str]: ...


def validate_experiment(
    cfg: ExperimentSchema,
    path: Path,
    root: Path,
    problems: Problems,
    *,
    check_files: bool = True,
    resources: ResourceRules | None = None,
) -> list[str]:
    """Each section's rules, then the rules across sections (with `resources`, those that need FLOPs or
    the peak table too). Returns notes for pins that cannot be verified on this machine."""
    check_numbers(cfg, "", path, problems)
    check_text(cfg, "", path, problems)
    if problems.lines:
        return []  # the rules below compare numbers: NaN and 10**30 would only confuse them
    cfg.validate(problems, path)
    if resources is not None:
        resources.check_hardware(cfg.hardware, path, problems, "hardware")
    check_speed_options(cfg, path, problems)
    check_manifests_match_mixture(cfg, path, problems)
    check_task_names(cfg, path, problems)
    check_targets(cfg, path, problems)
    notes = check_tokenizer_pin(cfg.tokenizer, path, root, problems, check_files=check_files)
    notes += [
        f"{display_path(path)}: {key}: '{hub.revision}' is not a commit yet: `runner fetch` resolves it, "
        "`runner pin` writes it (`runner launch` refuses until then)"
        for key, hub in unresolved_revisions(cfg)
    ]
    if problems.lines:
        return notes  # the arithmetic below divides by values already found wrong
    check_batch_split(cfg, path, problems)
    check_warmup(cfg, path, problems)
    check_samples(cfg, path, problems)
    if resources is not None:
        notes += resources.check_experiment(cfg, path, problems)
    return notes


def unresolved_revisions(cfg: ExperimentSchema) -> list[tuple[str, HubFiles]]:
    """(dotted key, Hub asset) for every Hub revision that is not yet a 40-hex commit."""
    assets: list[tuple[str, HubFiles | None]] = [("tokenizer.hub.revision", cfg.tokenizer.hub)]
    assets += [(f"mixture.domains.{d}.source.revision", s.source) for d, s in cfg.mixture.domains.items()]
    return [(key, hub) for key, hub in assets if hub is not None and not COMMIT_HEX.match(str(hub.revision))]


#: Why `kernels: liger` under whole-model compile is refused (bench/measurements/h200-20261204/README.md).
LIGER_WHOLE_MODEL_COMPILE = (
    "Liger's kernels fail under whole-model compile (measured on an H200, torch 2.11, triton 3.6, liger-kernel "
    "0.8.5, 2026-12-04: TorchRuntimeError making a fake tensor call, a TypeError in liger's SwiGLU _should_tile); "
    "use kernels: none (the 1p3b recipe, 56.8% MFU) or compile_scope: regional (it runs, but slower: 47.6%, "
    "inductor falls back on liger's RMSNorm kernel)"
)


def check_speed_options(cfg: ExperimentSchema, path: Path, problems: Problems) -> None:
    """Liger's Triton kernels need a GPU: refused for a CPU hardware recipe; on a GPU they are refused
    under whole-model compile, which a device measured to fail (LIGER_WHOLE_MODEL_COMPILE)."""
    if cfg.hardware.accelerator != "cpu":
        m = cfg.model
        if m.kernels == "liger" and m.compile and m.compile_scope == "model":
            problems.add(path, "model.kernels", LIGER_WHOLE_MODEL_COMPILE)
        return
    for key in ("kernels", "cross_entropy"):
        if getattr(cfg.model, key) == "liger":
            problems.add(
                path,
                f"model.{key}",
                "liger's Triton kernels need a CUDA or ROCm GPU and this recipe runs on cpu"
                + ("; cross_entropy: chunked is the runner's own fused loss" if key == "cross_entropy" else ""),
            )


#: int64: what torch, numpy and safetensors hold; a larger integer overflows them.
INT_MAX = 2**63 - 1


def _entries(node) -> list[tuple[str, object]] | None:
    """(key, value) of a mapping, list or dataclass section; None for a scalar."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    if isinstance(node, Mapping):
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        return [(f"[{i}]", v) for i, v in enumerate(node)]
    return None


def check_text(node, key: str, path: Path, problems: Problems) -> None:
    """No control character in any string or mapping key (names, descriptions, device names, paths,
    sources): each can reach a generated file (a Slurm script's comment, a SkyPilot task, a model card),
    where a line break starts a line of its own. A description may hold line breaks and tabs, nothing else."""
    entries = _entries(node)
    if entries is not None:
        for k, v in entries:
            sub = k if not key else f"{key}{k}" if k.startswith("[") else f"{key}.{k}"
            if _control(k, allowed=""):
                problems.add(path, sub, f"the key {k[:60]!r} holds a control character ({_control(k, '')})")
            check_text(v, sub, path, problems)
    elif isinstance(node, str):
        found = _control(node, allowed="\n\t" if key.rsplit(".", 1)[-1] == "description" else "")
        if found:
            problems.add(
                path, key, f"{node[:60]!r} holds a control character ({found}): names and values are one line of text"
            )


def _control(text: str, allowed: str) -> str:
    """The first control character of `text` outside `allowed`, as U+XXXX, or ''."""
    for c in text:
        if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") and c not in allowed:
            return f"U+{ord(c):04X}"
    return ""


def check_numbers(node, key: str, path: Path, problems: Problems) -> None:
    """Every number finite (NaN and infinity reach no sane setting, and break the fingerprint's JSON)
    and every integer within int64."""
    entries = _entries(node)
    if entries is not None:
        for k, v in entries:
            check_numbers(v, k if not key else f"{key}{k}" if k.startswith("[") else f"{key}.{k}", path, problems)
    elif isinstance(node, float) and not math.isfinite(node):
        problems.add(path, key, f"must be a finite number, got {node}")
    elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > INT_MAX:
        problems.add(path, key, f"{node:.3e} is out of range (at most 2**63 - 1, what torch and numpy hold)")


def check_recipe(
    recipe: Recipe, kind: str, path: Path, problems: Problems, resources: ResourceRules | None = None
) -> None:
    """A recipe file on its own: its section's rules, and with `resources` for hardware the device against
    the peak table (a fault is named in the recipe file: `recipes/hardware/x.yaml: device_name: ...`)."""
    check_text(recipe, "", path, problems)
    recipe.validate(problems, path, "")
    if resources is not None and isinstance(recipe, HardwareRecipe):
        resources.check_hardware(recipe, path, problems, "")


def check_manifests_match_mixture(cfg: ExperimentSchema, path: Path, problems: Problems) -> None:
    """Every domain of the mixture has a pinned manifest, and every pin is a domain of the mixture."""
    mix, pins = cfg.mixture.domains, cfg.data.manifests
    for d in mix:
        if d not in pins:
            problems.add(path, f"data.manifests.{d}", f"missing: domain '{d}' of the mixture has no pinned manifest")
    for d in pins:
        if d not in mix:
            problems.add(path, f"data.manifests.{d}", f"not a domain of the mixture{did_you_mean(d, list(mix))}")


def check_tokenizer_pin(
    tok: TokenizerRecipe, path: Path, root: Path, problems: Problems, *, check_files: bool = True
) -> list[str]:
    """The tokenizer file on this machine must hash to the pin; notes for a pin missing or not checkable."""
    if tok.sha256 is None:
        return [f"{display_path(path)}: tokenizer.sha256: not pinned yet: `runner launch` refuses until it is"]
    if not check_files or not SHA256_HEX.match(tok.sha256):
        return []  # a malformed pin is the schema's problem to report
    tpath = Path(tok.path) if Path(tok.path).is_absolute() else root / tok.path
    if tpath.is_dir():
        problems.add(path, "tokenizer.path", f"{tok.path} is a folder: name the tokenizer.json file in it")
        return []
    if not tpath.exists():
        return [
            f"{display_path(path)}: tokenizer.path: {tok.path} is not on this machine: its sha256 pin is checked at launch"
        ]
    actual = sha256_file(tpath)
    if actual != tok.sha256:
        problems.add(path, "tokenizer.sha256", f"{tok.path} has sha256 {actual}, the recipe pins {tok.sha256}")
    return []


def check_batch_split(cfg: ExperimentSchema, path: Path, problems: Problems) -> None:
    """The global batch splits into whole micro batches over the recipe's devices."""
    try:
        grad_accum(cfg)
    except RunnerError as e:
        problems.add(path, e.key or "", e.detail)


def check_warmup(cfg: ExperimentSchema, path: Path, problems: Problems) -> None:
    """Warm-up fits inside the schedule it warms."""
    length = max_duration_tokens(cfg)
    if cfg.optim.warmup_tokens > length:
        problems.add(path, "optim.warmup_tokens", f"{cfg.optim.warmup_tokens:,} exceeds the schedule length {length:,}")


def check_samples(cfg: ExperimentSchema, path: Path, problems: Problems) -> None:
    """The loop's samples fit the model's context (greedy, every rank, one forward per new token over
    the whole sequence: 10**8 tokens would never end the evaluation)."""
    samples = cfg.export.samples
    if samples.prompts and samples.max_new_tokens >= cfg.train.seq_len:
        problems.add(
            path,
            "export.samples.max_new_tokens",
            f"{samples.max_new_tokens:,} leaves no room for a prompt in the model's context of train.seq_len "
            f"{cfg.train.seq_len:,} positions: at most {cfg.train.seq_len - 1:,}",
        )


def check_targets(cfg: ExperimentSchema, path: Path, problems: Problems) -> None:
    """Quality targets (SPEC "Quality targets") name a domain of the mixture, or `mean` when no
    domain has that name (each target's own threshold is the schema's to check)."""
    domains = list(cfg.mixture.domains)
    for name, target in cfg.eval.targets.items():
        if target.task is not None:
            _check_task_target(cfg, f"eval.targets.{name}", target, path, problems)
            continue
        if target.domain is None:
            continue  # the schema names what is missing
        key = f"eval.targets.{name}.domain"
        if target.domain == MEAN_DOMAIN and MEAN_DOMAIN in domains:
            problems.add(path, key, f"'{MEAN_DOMAIN}' is ambiguous: the mixture has a domain of that name; rename it")
        elif target.domain != MEAN_DOMAIN and target.domain not in domains:
            problems.add(
                path,
                key,
                f"'{target.domain}' is not a domain of the mixture ({', '.join(domains)}) nor '{MEAN_DOMAIN}'"
                + did_you_mean(target.domain, domains + [MEAN_DOMAIN]),
            )


AGGREGATE_TASK = "aggregate"  #: a downstream target's `task` for the figure over tasks (eval.aggregate)


def check_task_names(cfg: ExperimentSchema, path: Path, problems: Problems) -> None:
    """No task of eval.tasks is named `aggregate`: that is the name of the figure over the tasks (its
    rows, MLflow metrics and downstream targets would be the task's too)."""
    if AGGREGATE_TASK in cfg.eval.tasks:
        problems.add(
            path,
            f"eval.tasks.{AGGREGATE_TASK}",
            f"'{AGGREGATE_TASK}' names the figure over the tasks (eval.aggregate): give the task another name",
        )


def _check_task_target(cfg: ExperimentSchema, prefix: str, target, path: Path, problems: Problems) -> None:
    """A downstream target names a task of eval.tasks (or `aggregate`) and a metric that task records."""
    tasks = cfg.eval.tasks
    if target.task == AGGREGATE_TASK:
        if cfg.eval.aggregate == "none" or not tasks:
            problems.add(path, f"{prefix}.task", "'aggregate' needs eval.tasks and an eval.aggregate other than none")
        elif target.metric is not None and target.metric != cfg.eval.aggregate:
            problems.add(
                path,
                f"{prefix}.metric",
                f"the aggregate's metric is eval.aggregate ('{cfg.eval.aggregate}'), not '{target.metric}'",
            )
        return
    if target.task not in tasks:
        known = sorted(tasks) + ([AGGREGATE_TASK] if tasks and cfg.eval.aggregate != "none" else [])
        problems.add(
            path,
            f"{prefix}.task",
            f"'{target.task}' is not a task of eval.tasks ({', '.join(known) or 'none declared'})"
            + did_you_mean(str(target.task), known),
        )
        return
    recorded = list(tasks[target.task].metrics)
    if target.metric is not None and target.metric not in recorded:
        problems.add(
            path,
            f"{prefix}.metric",
            f"'{target.metric}' is not a metric task '{target.task}' records ({', '.join(recorded)})"
            + did_you_mean(str(target.metric), recorded),
        )
