"""Rules across keys, and the step arithmetic every stage derives from the config.

Owns: what a config must satisfy beyond types (ratios, caps, batch arithmetic, the tokenizer pin)
and the derived numbers (devices, gradient accumulation, steps, padded vocab). Each recipe kind has
its own check (`check_tokenizer`, `check_mixture`, ...: one section's values, read by attribute),
run on a recipe file alone (its own file and keys in the message) and on the resolved experiment;
`validate_rules` adds what spans sections. Checks that need files on disk are done here only for
the tokenizer pin, because its vocab decides the token dtype every later stage relies on.
"""

from __future__ import annotations

import re
from pathlib import Path

from runner.config.schema import CHOICES, KINDS, TOKEN_DTYPES
from runner.errors import Problems, RunnerError, did_you_mean, display_path
from runner.fsio import sha256_file

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
_GLOB = re.compile(r"[*?\[]")
#: target ratios must sum to 1 within this (they are written as decimals, so 0.1 + 0.2 is not 0.3)
RATIO_SUM_TOLERANCE = 1e-9


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
        raise RunnerError(
            f"global batch {batch} does not divide into micro batches of {micro} x {world} device(s)",
            key="train.micro_batch_sequences",
        )
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


def _choices(values, kind: str, file, problems: Problems, prefix: str) -> None:
    """The CHOICES of one section (`kind.a.*.b` patterns walk mappings; null sections are skipped)."""

    def walk(node, parts: list[str], key: str) -> None:
        if node is None:
            return
        if not parts:
            options = CHOICES[pattern]
            if node not in options:
                problems.add(file, key, f"'{node}' is not one of {', '.join(options)}{did_you_mean(node, options)}")
            return
        head, rest = parts[0], parts[1:]
        children = node.items() if head == "*" else [(head, getattr(node, head))]
        for name, child in children:
            walk(child, rest, f"{key}.{name}" if key else name)

    for pattern in CHOICES:
        section, *parts = pattern.split(".")
        if section == kind:
            walk(values, parts, prefix.rstrip("."))


def _positive(values, keys, file, problems: Problems, prefix: str) -> None:
    for k in keys:
        if getattr(values, k) < 1:
            problems.add(file, f"{prefix}{k}", f"must be >= 1, got {getattr(values, k)}")


def check_hub_files(hub, file, problems: Problems, key: str, *, one_file: bool = False) -> None:
    """A Hub asset: owner/name, a revision, files (exactly one plain path for a tokenizer)."""
    if hub.repo.count("/") != 1 or not all(hub.repo.split("/")):
        problems.add(file, f"{key}.repo", f"'{hub.repo}' must be a Hub repository id, owner/name")
    if not hub.revision:
        problems.add(file, f"{key}.revision", "must name a commit (40 hex) or a branch or tag to resolve")
    if not hub.files:
        problems.add(file, f"{key}.files", "must list at least one file or pattern")
    if one_file and (len(hub.files) != 1 or _GLOB.search(hub.files[0])):
        problems.add(file, f"{key}.files", f"a tokenizer is one file, not {list(hub.files)}")
    for i, f in enumerate(hub.files):
        if not f or f.startswith("/") or ".." in f.split("/"):
            problems.add(file, f"{key}.files[{i}]", f"'{f}' must be a path inside the repository")


def check_tokenizer(tok, file, problems: Problems, prefix: str = "") -> None:
    """A tokenizer recipe on its own: dtype wide enough, EOS inside the vocabulary, pins well-formed."""
    _choices(tok, "tokenizer", file, problems, prefix)
    if tok.token_dtype in TOKEN_DTYPES and tok.vocab_size > TOKEN_DTYPES[tok.token_dtype]:
        problems.add(
            file,
            f"{prefix}token_dtype",
            f"{tok.token_dtype} holds ids below {TOKEN_DTYPES[tok.token_dtype]:,} but vocab_size is {tok.vocab_size:,}: use uint32",
        )
    if tok.vocab_size < 1:
        problems.add(file, f"{prefix}vocab_size", f"must be >= 1, got {tok.vocab_size}")
    elif not 0 <= tok.eos_id < tok.vocab_size:
        problems.add(file, f"{prefix}eos_id", f"{tok.eos_id} is outside the vocabulary (size {tok.vocab_size})")
    if tok.sha256 is not None and not _SHA256.match(str(tok.sha256)):
        problems.add(file, f"{prefix}sha256", "must be 64 lowercase hex characters")
    if tok.hub is not None:
        check_hub_files(tok.hub, file, problems, f"{prefix}hub", one_file=True)


def check_mixture(mix, file, problems: Problems, prefix: str = "") -> None:
    """A mixture recipe on its own: ratios in (0, 1] summing to 1, caps >= 1 epoch, sources well-formed."""
    _choices(mix, "mixture", file, problems, prefix)
    domains = mix.domains
    if not domains:
        problems.add(file, f"{prefix}domains", "at least one domain is required")
    total = 0.0
    for d, spec in domains.items():
        key = f"{prefix}domains.{d}"
        if not 0.0 < spec.target_ratio <= 1.0:
            problems.add(file, f"{key}.target_ratio", f"must be in (0, 1], got {spec.target_ratio}")
        if spec.max_repetition_ratio < 1.0:
            problems.add(
                file, f"{key}.max_repetition_ratio", f"must be >= 1.0 (epochs), got {spec.max_repetition_ratio}"
            )
        if spec.source is not None:
            check_hub_files(spec.source, file, problems, f"{key}.source")
            if not spec.source.local_dir:
                problems.add(file, f"{key}.source.local_dir", "must name the folder the files land in")
        total += spec.target_ratio
    if domains and abs(total - 1.0) > RATIO_SUM_TOLERANCE:
        problems.add(file, f"{prefix}domains", f"target ratios sum to {total:.6g}, not 1")


def check_model(m, file, problems: Problems, prefix: str = "") -> None:
    """A model recipe on its own: positive sizes, heads dividing the width (even head dim for RoPE)."""
    _choices(m, "model", file, problems, prefix)
    _positive(
        m,
        ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "pad_vocab_multiple"),
        file,
        problems,
        prefix,
    )
    if m.n_heads >= 1 and m.hidden_size % m.n_heads:
        problems.add(file, f"{prefix}n_heads", f"hidden_size {m.hidden_size} is not divisible by n_heads {m.n_heads}")
    elif m.n_heads >= 1 and (m.hidden_size // m.n_heads) % 2:
        problems.add(file, f"{prefix}n_heads", f"head dim {m.hidden_size // m.n_heads} must be even for RoPE")
    if m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads:
        problems.add(file, f"{prefix}n_kv_heads", f"n_heads {m.n_heads} is not divisible by n_kv_heads {m.n_kv_heads}")
    if m.sdpa_kernel is not None and m.sdpa_kernel not in ("flash", "efficient", "cudnn", "math"):
        problems.add(file, f"{prefix}sdpa_kernel", f"'{m.sdpa_kernel}' is not one of flash, efficient, cudnn, math")
    if m.sdpa_kernel is not None and m.attn_implementation != "sdpa":
        problems.add(
            file, f"{prefix}sdpa_kernel", f"only applies to attn_implementation sdpa, not {m.attn_implementation}"
        )


def check_optim(o, file, problems: Problems, prefix: str = "") -> None:
    """An optimizer recipe on its own: lr > 0, betas in [0, 1), ratios in range."""
    _choices(o, "optim", file, problems, prefix)
    if o.lr <= 0:
        problems.add(file, f"{prefix}lr", f"must be > 0, got {o.lr}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.add(file, f"{prefix}betas", f"must be two numbers in [0, 1), got {list(o.betas)}")
    if not 0 <= o.min_lr_ratio <= 1:
        problems.add(file, f"{prefix}min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    if not 0 < o.decay_fraction <= 1:
        problems.add(file, f"{prefix}decay_fraction", f"must be in (0, 1], got {o.decay_fraction}")
    if o.warmup_tokens < 0:
        problems.add(file, f"{prefix}warmup_tokens", f"must be >= 0, got {o.warmup_tokens}")


def check_hardware(hw, file, problems: Problems, prefix: str = "") -> None:
    """A hardware recipe on its own: device counts, a peak with its source (never another device's)."""
    _choices(hw, "hardware", file, problems, prefix)
    _positive(hw, ("devices_per_node", "nodes"), file, problems, prefix)
    if hw.peak_tflops is not None and hw.peak_tflops <= 0:
        problems.add(file, f"{prefix}peak_tflops", f"must be > 0, got {hw.peak_tflops}")
    if hw.peak_tflops is not None and not hw.peak_source:
        problems.add(file, f"{prefix}peak_source", "a stated peak_tflops needs its source (datasheet, measurement)")
    if hw.accelerator == "cpu":
        if hw.peak_tflops is None and hw.cpu_peak not in ("theoretical", "measured"):
            problems.add(
                file,
                f"{prefix}cpu_peak",
                "a CPU has no datasheet peak: state peak_tflops, or set cpu_peak: theoretical | measured",
            )
        if hw.precision != "fp32":
            problems.add(file, f"{prefix}precision", "CPU training runs in fp32")
    elif hw.peak_tflops is None and hw.accelerator in CHOICES["hardware.accelerator"]:
        from runner.planning.hardware import canonical_device

        if canonical_device(hw.device_name) is None or hw.peak_dtype != "bf16":
            problems.add(
                file,
                f"{prefix}device_name",
                f"'{hw.device_name}' has no {hw.peak_dtype} peak in the table: state peak_tflops and peak_source (never another device's number)",
            )


def check_eval(ev, file, problems: Problems, prefix: str = "") -> None:
    """An eval recipe on its own: a positive interval and sample count."""
    _choices(ev, "eval", file, problems, prefix)
    _positive(ev, ("interval_steps", "samples_per_domain", "micro_batch_sequences"), file, problems, prefix)


#: one check per recipe kind, each taking that section's values (recipe file alone, or resolved)
RECIPE_CHECKS = {
    "tokenizer": check_tokenizer,
    "mixture": check_mixture,
    "model": check_model,
    "optim": check_optim,
    "hardware": check_hardware,
    "eval": check_eval,
}


def validate_rules(cfg, path: Path, root: Path, problems: Problems, *, check_files: bool = True) -> list[str]:
    """Each recipe kind's check on the resolved sections (overrides may break them), then the rules
    that span sections. Returns notes for pins that cannot be verified on this machine."""
    for kind in KINDS:
        v = getattr(cfg, kind).version
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.add(path, f"{kind}.version", f"must be an integer >= 1, got {v!r}")
        RECIPE_CHECKS[kind](getattr(cfg, kind), path, problems, f"{kind}.")
    notes = _check_pins(cfg, path, root, problems, check_files=check_files)
    _check_train(cfg, path, problems)
    return notes


def _check_pins(cfg, path: Path, root: Path, problems: Problems, *, check_files: bool) -> list[str]:
    """The tokenizer pin against its file, Hub revisions not yet commits, manifest pins vs mixture."""
    notes: list[str] = []
    tok = cfg.tokenizer
    if tok.sha256 is None:
        notes.append(f"{display_path(path)}: tokenizer.sha256: not pinned yet: `runner launch` refuses until it is")
    elif _SHA256.match(str(tok.sha256)) and check_files:
        tpath = Path(tok.path) if Path(tok.path).is_absolute() else root / tok.path
        if not tpath.exists():
            notes.append(
                f"{display_path(path)}: tokenizer.path: {tok.path} is not on this machine: its sha256 pin is checked at launch"
            )
        else:
            actual = sha256_file(tpath)
            if actual != tok.sha256:
                problems.add(path, "tokenizer.sha256", f"{tok.path} has sha256 {actual}, the recipe pins {tok.sha256}")
    for key, hub in unresolved_revisions(cfg):
        notes.append(
            f"{display_path(path)}: {key}: '{hub.revision}' is not a commit yet: `runner fetch` resolves it, "
            "`runner pin` writes it (`runner launch` refuses until then)"
        )
    mix = cfg.mixture.domains
    pins = cfg.data.manifests
    for d in mix:
        if d not in pins:
            problems.add(path, f"data.manifests.{d}", f"missing: domain '{d}' of the mixture has no pinned manifest")
    for d, pin in pins.items():
        if d not in mix:
            problems.add(path, f"data.manifests.{d}", f"not a domain of the mixture{did_you_mean(d, list(mix))}")
        if pin.sha256 is not None and not _SHA256.match(str(pin.sha256)):
            problems.add(path, f"data.manifests.{d}.sha256", "must be 64 lowercase hex characters")
        for k in ("pool_tokens", "validation_tokens"):
            if getattr(pin, k) is not None and getattr(pin, k) < 0:
                problems.add(path, f"data.manifests.{d}.{k}", f"must be >= 0, got {getattr(pin, k)}")
    return notes


def unresolved_revisions(cfg) -> list[tuple[str, object]]:
    """(dotted key, Hub asset) for every Hub revision that is not yet a 40-hex commit."""
    assets = [("tokenizer.hub.revision", cfg.tokenizer.hub)]
    assets += [(f"mixture.domains.{d}.source.revision", s.source) for d, s in cfg.mixture.domains.items()]
    return [(key, hub) for key, hub in assets if hub is not None and not COMMIT.match(str(hub.revision))]


def _check_train(cfg, path: Path, problems: Problems) -> None:
    """Batch arithmetic: budgets in whole global batches, a schedule no shorter than the budget."""
    t = cfg.train
    for k in ("seq_len", "global_batch_sequences", "micro_batch_sequences", "exposure_tokens", "log_interval_steps"):
        if getattr(t, k) < 1:
            problems.add(path, f"train.{k}", f"must be >= 1, got {getattr(t, k)}")
    if problems.lines:
        return
    try:
        grad_accum(cfg)
    except RunnerError as e:
        problems.add(path, e.key, e.detail)
    batch_tokens = global_batch_tokens(cfg)
    for key in ("exposure_tokens", "max_duration_tokens", "hard_stop_tokens"):
        val = getattr(t, key)
        if val is not None and val % batch_tokens:
            lo = val // batch_tokens * batch_tokens
            problems.add(
                path,
                f"train.{key}",
                f"{val:,} is not a whole number of global batches of {batch_tokens:,} tokens "
                f"({t.global_batch_sequences} x {t.seq_len}): use {lo:,} or {lo + batch_tokens:,}",
            )
    if t.max_duration_tokens is not None and t.max_duration_tokens < t.exposure_tokens:
        problems.add(
            path,
            "train.max_duration_tokens",
            f"{t.max_duration_tokens:,} is below exposure_tokens {t.exposure_tokens:,}: use hard_stop_tokens to stop early",
        )
    if t.hard_stop_tokens is not None and not 0 < t.hard_stop_tokens <= t.exposure_tokens:
        problems.add(path, "train.hard_stop_tokens", f"must be in (0, exposure_tokens], got {t.hard_stop_tokens:,}")
    if cfg.optim.warmup_tokens > max_duration_tokens(cfg):
        problems.add(
            path,
            "optim.warmup_tokens",
            f"{cfg.optim.warmup_tokens:,} exceeds the schedule length {max_duration_tokens(cfg):,}",
        )
