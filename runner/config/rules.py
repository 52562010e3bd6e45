"""Rules across keys, and the step arithmetic every stage derives from the config.

Owns: what a resolved config must satisfy beyond types (ratios, caps, batch arithmetic, the
tokenizer pin) and the derived numbers (devices, gradient accumulation, steps, padded vocab).
Checks that need files on disk are done here only for the tokenizer pin, because its vocab
decides the token dtype every later stage relies on.
"""

from __future__ import annotations

import re
from pathlib import Path

from runner.config.schema import CHOICES, KINDS, TOKEN_DTYPES
from runner.errors import Problems, RunnerError, did_you_mean, display_path
from runner.fsio import sha256_file

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


def moe_rules(m, path: Path, problems: Problems) -> None:
    """A mixture-of-experts model (arch olmoe) has a `moe` section that makes sense; a dense one has none."""
    if m.arch != "olmoe":
        if m.moe is not None:
            problems.add(path, "model.moe", f"only a mixture-of-experts arch (olmoe) has experts, not {m.arch}")
        return
    moe = m.moe
    if moe is None:
        problems.add(
            path, "model.moe", "arch olmoe needs a moe section (n_experts, experts_per_token, expert_intermediate_size)"
        )
        return
    for k in ("n_experts", "experts_per_token", "expert_intermediate_size"):
        if moe[k] < 1:
            problems.add(path, f"model.moe.{k}", f"must be >= 1, got {moe[k]}")
    if moe.experts_per_token > moe.n_experts:
        problems.add(
            path,
            "model.moe.experts_per_token",
            f"{moe.experts_per_token} experts per token but only {moe.n_experts} experts",
        )
    for k in ("router_aux_loss_coef", "router_z_loss_coef"):
        if not (moe[k] >= 0 and moe[k] != float("inf")):
            problems.add(path, f"model.moe.{k}", f"must be a finite number >= 0, got {moe[k]}")
    if m.intermediate_size != moe.expert_intermediate_size:
        problems.add(
            path,
            "model.intermediate_size",
            f"olmoe has no dense MLP: its MLPs are the experts, so intermediate_size ({m.intermediate_size}) "
            f"must equal moe.expert_intermediate_size ({moe.expert_intermediate_size}); "
            "write intermediate_size: ${model.moe.expert_intermediate_size}",
        )


def validate_rules(cfg, path: Path, root: Path, problems: Problems, *, check_files: bool = True) -> list[str]:
    """Rules that span keys. Returns notes for pins that cannot be verified on this machine."""
    notes: list[str] = []
    for key, options in CHOICES.items():
        section, name = key.split(".")
        val = cfg[section][name]
        if val not in options:
            problems.add(path, key, f"'{val}' is not one of {', '.join(options)}{did_you_mean(val, options)}")
    for kind in KINDS:
        v = cfg[kind].version
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.add(path, f"{kind}.version", f"must be an integer >= 1, got {v!r}")

    if cfg.model.sdpa_kernel is not None and cfg.model.sdpa_kernel not in ("flash", "efficient", "cudnn", "math"):
        problems.add(
            path, "model.sdpa_kernel", f"'{cfg.model.sdpa_kernel}' is not one of flash, efficient, cudnn, math"
        )
    if cfg.model.sdpa_kernel is not None and cfg.model.attn_implementation != "sdpa":
        problems.add(
            path, "model.sdpa_kernel", f"only applies to attn_implementation sdpa, not {cfg.model.attn_implementation}"
        )
    tok = cfg.tokenizer
    if tok.token_dtype in TOKEN_DTYPES and tok.vocab_size > TOKEN_DTYPES[tok.token_dtype]:
        problems.add(
            path,
            "tokenizer.token_dtype",
            f"{tok.token_dtype} holds ids below {TOKEN_DTYPES[tok.token_dtype]:,} but vocab_size is {tok.vocab_size:,}: use uint32",
        )
    if not 0 <= tok.eos_id < tok.vocab_size:
        problems.add(path, "tokenizer.eos_id", f"{tok.eos_id} is outside the vocabulary (size {tok.vocab_size})")
    if tok.sha256 is None:
        notes.append(f"{display_path(path)}: tokenizer.sha256: not pinned yet: `runner launch` refuses until it is")
    elif not _SHA256.match(str(tok.sha256)):
        problems.add(path, "tokenizer.sha256", "must be 64 lowercase hex characters")
    elif check_files:
        tpath = Path(tok.path) if Path(tok.path).is_absolute() else root / tok.path
        if not tpath.exists():
            notes.append(
                f"{display_path(path)}: tokenizer.path: {tok.path} is not on this machine: its sha256 pin is checked at launch"
            )
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
            problems.add(
                path,
                f"mixture.domains.{d}.max_repetition_ratio",
                f"must be >= 1.0 (epochs), got {spec.max_repetition_ratio}",
            )
        total += float(spec.target_ratio)
    if mix and abs(total - 1.0) > 1e-9:
        problems.add(path, "mixture.domains", f"target ratios sum to {total:.6g}, not 1")
    pins = cfg.data.manifests
    for d in mix:
        if d not in pins:
            problems.add(path, f"data.manifests.{d}", f"missing: domain '{d}' of the mixture has no pinned manifest")
    for d, pin in pins.items():
        if d not in mix:
            problems.add(path, f"data.manifests.{d}", f"not a domain of the mixture{did_you_mean(d, list(mix))}")
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
    moe_rules(m, path, problems)

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
            problems.add(
                path,
                "hardware.cpu_peak",
                "a CPU has no datasheet peak: state peak_tflops, or set cpu_peak: theoretical | measured",
            )
        if hw.precision != "fp32":
            problems.add(path, "hardware.precision", "CPU training runs in fp32")
    elif hw.peak_tflops is None:
        from runner.planning.hardware import canonical_device

        if canonical_device(hw.device_name) is None or hw.peak_dtype != "bf16":
            problems.add(
                path,
                "hardware.device_name",
                f"'{hw.device_name}' has no {hw.peak_dtype} peak in the table: state peak_tflops and peak_source (never another device's number)",
            )

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
    if o.warmup_tokens > max_duration_tokens(cfg):
        problems.add(
            path, "optim.warmup_tokens", f"{o.warmup_tokens:,} exceeds the schedule length {max_duration_tokens(cfg):,}"
        )
    if cfg.eval.interval_steps < 1 or cfg.eval.samples_per_domain < 1:
        problems.add(path, "eval", "interval_steps and samples_per_domain must be >= 1")
    return notes
