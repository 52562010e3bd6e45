"""The planner: what an experiment will cost before it runs, and after a calibration run.

Owns: compute (6N and PaLM's 6N+attn), tokens per parameter, training and wall-clock time at an
assumed or measured throughput, device-hours and cost, memory per device, storage, the
mixture's per-domain epochs with Muennighoff et al. (2023) effective data under repetition, and
the forecast to quality targets (tokens from a `runner fit` result, then days and dollars).
Never: trains, writes files, or changes a recipe; it reads manifests and run metrics only.

Time is `T / q` (tokens over tokens per second) times `1 + overhead fractions` (SPEC: wall clock
= T_useful/q + t_checkpoint + t_eval + t_recovery, the three t's stated as fractions of T/q).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runner.config.rules import devices, total_steps
from runner.config.schema import AC_MODES, ExperimentSchema, checkpointing_mode, from_plain
from runner.data.manifest import load_manifest, num_samples
from runner.data.mixture import plan_mixture
from runner.errors import MixtureInfeasible, RunnerError
from runner.planning import assumptions, hardware
from runner.planning.assumptions import AssumedMfu, assumed_mfu, carried_mfu
from runner.planning.downstream_cost import format_lines as format_downstream_lines
from runner.planning.flops import Convention, convention_for, flops_per_token, params_of_config
from runner.planning.resources import CHECKPOINT_BYTES_PER_PARAM

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
GIB = 2.0**30
CHINCHILLA_TOKENS_PER_PARAM = 20.0
# Muennighoff et al. 2023 ("Scaling Data-Constrained Language Models"), fitted decay constant of
# the value of repeated tokens: past ~4 epochs returns diminish quickly.
REPETITION_R_STAR = 15.4
REPETITION_WARN_EPOCHS = 4.0
TOKEN_DTYPE_BYTES = {"uint16": 2, "uint32": 4}
#: what memory_per_device counts, by hardware.precision
MEMORY_ASSUMPTIONS = {
    "bf16": "bf16 mixed: fp32 master weights + fp32 grads (at the backward's peak only when accumulating or "
    "DDP/FSDP) + 2 fp32 AdamW moments + bf16 copies of the matmul weights; activations as autograd saves "
    "them (calibrated: saved-tensor probe, exact on CPU) x compile's measured fraction + the loss's peak; "
    "within 5% of max_memory_allocated on an H200 (bench/measurements/h200-20261204); no CUDA context or "
    "allocator fragmentation",
    "fp32": "fp32: weights + grads (at the backward's peak only when accumulating or DDP/FSDP) + 2 AdamW "
    "moments at 4 B; activations as autograd saves them (calibrated: saved-tensor probe, exact on CPU) + "
    "the loss's peak; no framework overhead",
}


# ---------------------------------------------------------------- pure arithmetic
def training_flops(params: float, tokens: float) -> float:
    """Kaplan/Chinchilla training compute: 6 * N * D."""
    return 6.0 * params * tokens


def compute_seconds(total_flops: float, mfu: float, peak_tflops: float, devices: int = 1) -> float:
    """Seconds to spend `total_flops` at a fraction `mfu` of `devices` dense peaks."""
    if not 0 < mfu <= 1:
        raise RunnerError(f"MFU must be in (0, 1], got {mfu}", key="hardware.default_mfu")
    return total_flops / (mfu * peak_tflops * 1e12 * devices)


def pure_training_seconds(tokens: float, tokens_per_second: float) -> float:
    """T / q: seconds to get through `tokens` at a throughput (10e9 at 100K/s: 27.8 h)."""
    if tokens_per_second <= 0:
        raise RunnerError(f"throughput must be positive, got {tokens_per_second}")
    return tokens / tokens_per_second


def wall_clock_seconds(pure_seconds: float, overhead_fraction: float) -> float:
    """Pure time plus overheads stated as a fraction of it (27.8 h + 20% = 33.3 h)."""
    return pure_seconds * (1.0 + overhead_fraction)


def chinchilla_optimal_tokens(params: float) -> float:
    """Hoffmann et al. 2022 rule of thumb: about 20 training tokens per parameter."""
    return CHINCHILLA_TOKENS_PER_PARAM * params


def effective_tokens(unique_tokens: float, epochs: float, r_star: float = REPETITION_R_STAR) -> float:
    """Muennighoff et al. 2023 eq. 5: D' = U + U * R* * (1 - exp(-R / R*)), with U the unique
    tokens seen and R = epochs - 1 the repeats (epochs = tokens seen / U, so >= 1).

    The first pass is worth its tokens; repeats are worth less and less, saturating at U * (1 + R*)."""
    repeats = max(0.0, epochs - 1.0)
    return unique_tokens + unique_tokens * r_star * (1.0 - math.exp(-repeats / r_star))


# ---------------------------------------------------------------- memory
#: share of the device's memory the automatic micro batch may plan to fill: the rest is for what the
#: plan does not count (CUDA context, allocator fragmentation, communication buffers)
AUTO_MICRO_BATCH_MEMORY_FRACTION = 0.9
CHUNKED_LOSS_TOKENS = 1024  # runner.training.loss.CHUNK_TOKENS (planning never imports the trainer)


def as_schema(cfg: ExperimentSchema | Mapping[str, Any]) -> ExperimentSchema:
    """The typed config of a resolved experiment given as plain data (a saved experiment.yaml, a bench
    script's shape), the schema's defaults under it; a typed config as it is."""
    return cfg if isinstance(cfg, ExperimentSchema) else from_plain(ExperimentSchema, cfg)


def saved_activation_bytes(
    cfg: ExperimentSchema | Mapping[str, Any], micro_batch: int | None = None, checkpointing: bool | str | None = None
) -> dict[str, float]:
    """Bytes autograd saves for the backward during one training forward of a micro batch, by part.

    Counted tensor by tensor for transformers' Llama as the trainer runs it (calibrated against
    runner.training.memprobe, the saved-tensor probe: exact on CPU in fp32 and bf16 autocast, with
    sdpa and eager attention, plain and chunked loss, with and without checkpointing). Per token,
    with c the compute dtype's bytes (bf16 autocast 2, fp32 4); the residual stream and the RMSNorms
    stay fp32 under autocast (4 bytes):
      RMSNorm:   4h input + 4 rsqrt + 4h normalised product
      attention: norm + q,k,v inputs (3 casts of c*h under autocast, one fp32 tensor without)
                 + q c*h + k, v c*kv each + 4*heads logsumexp + c*h output (the o_proj input)
                 eager instead: k, v repeated to h each + softmax (4 + c under autocast, 4 without)
                 * heads * seq_len, no logsumexp
      mlp:       norm + gate, up inputs (2 casts under autocast) + gate, up, silu, product c*f each
      head:      norm + plain: lm_head input c*h, log-softmax 4*V, targets 8, mask 1;
                 chunked/liger: d/dhidden 4h (+ d/dW 4*V*h, once per micro batch)
      input ids 8; RoPE cos and sin, 2 * seq_len * head_dim * 4, once per micro batch.
    With activation checkpointing each layer keeps only its input (4h) and the layer being
    recomputed holds its own tensors again (`recompute_layer`); `selective` keeps the input and its
    matmul and attention outputs (`selective_layer_saved_bytes`). Liger's kernels (`model.kernels:
    liger`) save no normalised product and no silu output: estimated from Liger's source, to be
    measured on a GPU (bench/device_check.sh). Not counted: autocast's bf16 weight copies (model
    state), the parameters themselves."""
    cfg = as_schema(cfg)
    model, train, hw = cfg.model, cfg.train, cfg.hardware
    counts = params_of_config(cfg)
    s = train.seq_len
    b = micro_batch if micro_batch is not None else train.micro_batch_sequences
    h, heads = model.hidden_size, model.n_heads
    vocab = counts.embedding // h
    autocast = hw.precision == "bf16" and hw.accelerator != "cpu"
    c = 2 if autocast else 4
    norm, layer = _decoder_layer_saved_bytes(model, s, c, autocast)
    plain = model.cross_entropy == "plain"
    head_per_token = norm + (c * h + 4 * vocab + 9 if plain else 4 * h)
    head_fixed = 0 if plain else 4 * vocab * h
    tokens = s * b
    rope = 2 * s * (h // heads) * 4
    mode = checkpointing_mode(model.activation_checkpointing if checkpointing is None else checkpointing)
    checkpointing = mode != "none"
    kept = {"full": 4 * h, "selective": selective_layer_saved_bytes(model, s, c), "none": layer}[mode]
    layers = counts.n_layers * kept * tokens
    return {
        "layers": float(layers),
        "head": float(head_per_token * tokens + head_fixed),
        "input_ids": float(8 * tokens),
        "rope": float(0 if checkpointing else rope),
        "recompute_layer": float(layer * tokens + rope if checkpointing else 0),
        "total": float(layers + head_per_token * tokens + head_fixed + 8 * tokens + (0 if checkpointing else rope)),
    }


def selective_layer_saved_bytes(model, s: int, c: int) -> int:
    """Bytes per token one decoder layer keeps under `selective` checkpointing
    (runner.training.checkpointing): its input (4h, fp32) and the outputs of its matmuls and of
    attention, in the compute dtype (c bytes): q c*h, k and v c*kv each, attention output c*h and
    4*heads logsumexp (sdpa; eager: scores and probabilities c*heads*s each), o_proj c*h; dense MLP
    gate and up c*f each, down c*h; MoE router logits c*E, per routed copy gate+up 2*c*f_e and down c*h."""
    h, heads = model.hidden_size, model.n_heads
    kv = model.n_kv_heads * (h // heads)
    attention = c * h + 2 * c * kv + c * h + c * h
    attention += 2 * c * heads * s if model.attn_implementation == "eager" else 4 * heads
    if model.moe is not None:
        moe = model.moe
        mlp = c * moe.n_experts + moe.experts_per_token * (2 * c * moe.expert_intermediate_size + c * h)
    else:
        mlp = 2 * c * model.intermediate_size + c * h
    return 4 * h + attention + mlp


def _decoder_layer_saved_bytes(model, s: int, c: int, autocast: bool) -> tuple[int, int]:
    """(one RMSNorm's, one decoder layer's) saved bytes per token, by saved_activation_bytes' formula."""
    h, f, heads = model.hidden_size, model.intermediate_size, model.n_heads
    kv = model.n_kv_heads * (h // heads)
    liger = model.kernels == "liger"
    norm = 4 * h + 4 + (0 if liger else 4 * h)
    if model.attn_implementation == "eager":
        scores = (4 + (c if autocast else 0)) * heads * s
        attention = norm + (3 if autocast else 1) * c * h + c * h + 2 * c * h + scores + c * h
    else:
        attention = norm + (3 if autocast else 1) * c * h + c * h + 2 * c * kv + 4 * heads + c * h
    mlp = norm + (2 if autocast else 1) * c * h + (3 if liger else 4) * c * f
    if model.moe is not None:  # OLMoE with the runner's layer (runner.training.moe): q/k norms' inputs;
        # router input c*h, fp32 probabilities 4E, top-k ids, sort order, source rows (8 B each per
        # routed copy) and sorted weights (4); per routed copy the grouped matmul's input c*h, gate+up
        # 2*c*f_e, silu(gate) and product c*f_e each, down output c*h, weighted output 4h (the
        # residual's dtype). Within 0.1% of the saved-tensor probe on CPU, fp32 and bf16 autocast.
        k, f_e, n_experts = model.moe.experts_per_token, model.moe.expert_intermediate_size, model.moe.n_experts
        attention += c * h + c * kv + 4 * h + 4 * kv + 8  # q/k norms: inputs, fp32 products, rsqrt
        mlp = norm + c * h + 4 * n_experts + 28 * k + k * (2 * c * h + 4 * c * f_e + 4 * h)
    return norm, attention + mlp


def head_transient_bytes(cfg: ExperimentSchema | Mapping[str, Any], micro_batch: int | None = None) -> float:
    """Bytes alive at the loss's peak beyond what is saved: plain cross-entropy's backward holds the
    gradient of the log-softmax and of its input, fp32 [tokens, vocab] each, next to the saved
    log-softmax; the chunked and Liger losses hold one chunk's logits and gradient."""
    cfg = as_schema(cfg)
    vocab = params_of_config(cfg).embedding // cfg.model.hidden_size
    tokens = cfg.train.seq_len * (micro_batch if micro_batch is not None else cfg.train.micro_batch_sequences)
    if cfg.model.cross_entropy == "plain":
        return float(8 * vocab * tokens)
    return float(12 * vocab * min(tokens, CHUNKED_LOSS_TOKENS))


def autocast_weight_copy_params(cfg: ExperimentSchema | Mapping[str, Any]) -> int:
    """Parameters whose bf16 copy autocast makes and autograd keeps for the backward: a dense model's
    decoder-layer matmul weights, plus the LM head's under the plain loss (the chunked and Liger losses
    cast per chunk); norms and the embedding are never cast. Probed on the H200 at gpu-smoke's shape:
    2,428,502,016 bytes = 2 x the 24 layers' matmul weights exactly (bench/measurements/h200-20261204/
    probe.json). A mixture of experts counts every parameter (not yet probed)."""
    cfg = as_schema(cfg)
    counts = params_of_config(cfg)
    if counts.moe:
        return counts.all
    lay = counts.layer
    matmul = lay.attention + lay.mlp
    head = counts.embedding if cfg.model.cross_entropy == "plain" else 0  # lm_head: vocab x hidden
    return counts.n_layers * matmul + head


def grads_held_at_peak(cfg: ExperimentSchema, micro_batch: int) -> bool:
    """Whether the fp32 gradients are alive at the backward's peak: when a step accumulates several
    micro batches (the earlier micro batches' gradients wait for the optimizer step) or DDP/FSDP hold
    them in communication buckets; a single micro batch per step on one device frees them at
    `zero_grad(set_to_none=True)`, so its backward peak (the loss's) comes before any gradient exists."""
    if cfg.hardware.distributed != "none":
        return True
    return cfg.train.global_batch_sequences // max(1, devices(cfg)) > micro_batch


def memory_per_device(
    cfg: ExperimentSchema | Mapping[str, Any], micro_batch: int | None = None, *, grads_held: bool | None = None
) -> dict[str, Any]:
    """Bytes per device at the training step's peak, with the assumptions stated in the result.

    Model state (per parameter): bf16 mixed precision keeps fp32 master weights (4 B), fp32 grads
    (4 B), AdamW's two fp32 moments (8 B), plus the bf16 copies autocast makes of the matmul weights
    (`autocast_weight_copy_params`, 2 B each: saved for the backward, so alive through it); fp32 drops
    the copies. FSDP (full shard) divides model state by the devices; DDP and single device hold it all.

    The peak is the larger of two moments (SPEC "Memory plan"):
      backward: at the loss's backward, weights + moments + copies + activations, plus the gradients
        only when `grads_held_at_peak` (accumulation or DDP/FSDP; `grads_held` overrides);
      optimizer step: weights + gradients + moments (fused AdamW's per-tensor temporaries not counted).
    Activations: `saved_activation_bytes` (what eager autograd keeps, calibrated against the
    saved-tensor probe) plus `head_transient_bytes` (the loss's peak); with `model.compile` the decoder
    layers' part times the measured fraction torch.compile leaves (runner.planning.assumptions.
    COMPILE_SAVED_FRACTION, by scope and kernels: the H200 bench); with activation checkpointing, the
    layer inputs, one recomputed layer (eager count, an upper bound under compile) and the head.
    `micro_batch` overrides the recipe's (the automatic micro batch asks what each candidate needs).
    Not counted: CUDA context, allocator fragmentation, communication buffers
    (AUTO_MICRO_BATCH_MEMORY_FRACTION leaves room for them). Measured against max_memory_allocated of
    every H200 bench row: tests/planning/test_memory_measured.py. `model.activation_checkpointing`
    is none, full or selective (runner.training.checkpointing): each mode's activations are counted.
    A mixture of experts (OLMoE) counts every expert in model state (all of them live in memory
    whichever a token uses); its activations (the runner's MoE layer) are calibrated by the probe
    like the dense model's, in each checkpointing mode.
    """
    cfg = as_schema(cfg)
    train, hw = cfg.train, cfg.hardware
    counts = params_of_config(cfg)
    n_params = counts.all
    precision = hw.precision
    shard = devices(cfg) if hw.distributed == "fsdp" else 1
    state = {
        "weights (fp32 master)": 4 * n_params / shard,
        "grads (fp32)": 4 * n_params / shard,
        "adamw moments (2 x fp32)": 8 * n_params / shard,
    }
    if precision == "bf16":
        state["bf16 autocast weight copies"] = 2 * autocast_weight_copy_params(cfg) / shard

    b = micro_batch if micro_batch is not None else train.micro_batch_sequences
    mode = checkpointing_mode(cfg.model.activation_checkpointing)
    checkpointing = mode != "none"
    held = grads_held_at_peak(cfg, b) if grads_held is None else grads_held
    transient = head_transient_bytes(cfg, b)
    saved = {m: saved_activation_bytes(cfg, b, checkpointing=m) for m in AC_MODES}
    compiled = compile_saved_fraction(cfg)
    fraction = compiled["fraction"] if compiled else 1.0
    by_mode = {m: saved[m]["total"] + saved[m]["recompute_layer"] + transient for m in AC_MODES}
    # compile's measured saving applies to what eager autograd keeps of the decoder layers (no checkpointing)
    by_mode["none"] -= (1.0 - fraction) * saved["none"]["layers"]
    full, checkpointed = by_mode["none"], by_mode["full"]
    activations = by_mode[mode]
    state_total = sum(state.values())
    held_state = state_total - (0 if held else state["grads (fp32)"])
    backward = held_state + activations
    step = sum(state[k] for k in ("weights (fp32 master)", "grads (fp32)", "adamw moments (2 x fp32)"))
    total = max(backward, step)
    capacity = hw.memory_gib * GIB
    return {
        "precision": precision,
        "sharded_over_devices": shard,
        "params": n_params,
        "model_state_bytes": state,
        "model_state_total_bytes": state_total,
        "grads_held_at_peak": held,
        "backward_peak_bytes": backward,
        "optimizer_step_peak_bytes": step,
        "activation_bytes_saved": saved[mode]["total"],
        "head_transient_bytes": transient,
        "activation_bytes_full": full,
        "activation_bytes_checkpointed": checkpointed,
        "activation_bytes_selective": by_mode["selective"],
        "activation_checkpointing": checkpointing,
        "activation_checkpointing_mode": mode,
        "activation_bytes": activations,
        "compile_saved_fraction": compiled,
        "micro_batch_sequences": b,
        "seq_len": train.seq_len,
        "cross_entropy": cfg.model.cross_entropy,
        "total_bytes": total,
        "capacity_bytes": capacity,
        "fits": bool(capacity) and total <= capacity,
        "fits_with_checkpointing": bool(capacity) and max(held_state + checkpointed, step) <= capacity,
        "assumptions": MEMORY_ASSUMPTIONS[precision],
    }


def compile_saved_fraction(cfg: ExperimentSchema) -> dict[str, Any] | None:
    """The measured fraction of the eager decoder layers' saved bytes torch.compile leaves, with its
    source, for this model's compile scope and kernels (None: not compiled, or checkpointed)."""
    model = cfg.model
    if not model.compile or checkpointing_mode(model.activation_checkpointing) != "none":
        return None
    key = (str(model.compile_scope), "liger" if model.kernels == "liger" else "none")
    fraction, source = assumptions.COMPILE_SAVED_FRACTION.get(key, (1.0, "not measured: the eager count"))
    return {"scope": key[0], "kernels": key[1], "fraction": fraction, "source": source}


def choose_micro_batch(
    cfg: ExperimentSchema | Mapping[str, Any], world: int, device_bytes: int | None = None
) -> tuple[int, str]:
    """`train.micro_batch_policy: auto`: the largest micro batch <= train.micro_batch_sequences that
    divides the per-device batch and whose planned memory fits AUTO_MICRO_BATCH_MEMORY_FRACTION of the
    device (the hardware recipe's memory_gib, or what the device really holds when smaller).
    Returns it and one line saying why; none fitting is a RunnerError (the global batch never changes)."""
    cfg = as_schema(cfg)
    per_device = cfg.train.global_batch_sequences // world
    cap = cfg.train.micro_batch_sequences
    capacity = (cfg.hardware.memory_gib or 0) * GIB
    if device_bytes:
        capacity = min(capacity, float(device_bytes)) if capacity else float(device_bytes)
    budget = capacity * AUTO_MICRO_BATCH_MEMORY_FRACTION
    candidates = [m for m in range(min(cap, per_device), 0, -1) if per_device % m == 0]
    sharing = cfg.hardware.distributed != "none"
    for m in candidates:
        need = memory_per_device(cfg, m, grads_held=sharing or per_device > m)["total_bytes"]
        if need <= budget:
            return m, (
                f"auto: micro batch {m} of <= {cap} (per-device batch {per_device}): planned "
                f"{need / GIB:,.1f} GiB of {budget / GIB:,.1f} GiB ({AUTO_MICRO_BATCH_MEMORY_FRACTION:.0%} "
                f"of {capacity / GIB:,.1f} GiB)"
            )
    smallest = memory_per_device(cfg, 1, grads_held=sharing or per_device > 1)["total_bytes"]
    raise RunnerError(
        f"micro_batch_policy auto: even micro batch 1 plans {smallest / GIB:,.1f} GiB, over "
        f"{budget / GIB:,.1f} GiB ({AUTO_MICRO_BATCH_MEMORY_FRACTION:.0%} of {capacity / GIB:,.1f} GiB): turn on "
        "model.activation_checkpointing, shard with hardware.distributed: fsdp, or use a larger device",
        key="train.micro_batch_sequences",
    )


# ---------------------------------------------------------------- mixture
def mixture_plan(cfg: ExperimentSchema, root: Path) -> dict[str, Any]:
    """Per-domain exposure, epochs and effective tokens from the pinned manifests, or why not."""
    pins = cfg.data.manifests
    if not pins:
        return {"status": "absent", "line": "mixture: no data.manifests pinned; per-domain plan skipped"}
    paths = {d: (Path(p.path) if Path(p.path).is_absolute() else root / p.path) for d, p in pins.items()}
    missing = sorted(d for d, p in paths.items() if not p.exists())
    if missing:
        return {
            "status": "absent",
            "line": f"mixture: manifests not on disk for {', '.join(missing)}; per-domain plan skipped "
            "(run `runner data prepare` first)",
        }
    seq_len = cfg.train.seq_len
    manifests = {d: load_manifest(paths[d], verify="size") for d in sorted(paths)}
    # A stale pin does not change the arithmetic; it is reported, and launch refuses it.
    pin_warnings = [
        f"data.manifests.{d}.sha256: pinned {pins[d].sha256}, on disk {m.sha256} (launch will refuse until re-pinned)"
        for d, m in manifests.items()
        if pins[d].sha256 not in (None, m.sha256)
    ]
    domains = cfg.mixture.domains
    samples = {d: num_samples(m.pool_tokens, seq_len) for d, m in manifests.items()}
    ratios = {d: spec.target_ratio for d, spec in domains.items()}
    caps = {d: spec.max_repetition_ratio for d, spec in domains.items()}
    try:
        plan = plan_mixture(samples, ratios, caps, cfg.train.exposure_tokens, seq_len, cfg.train.global_batch_sequences)
    except MixtureInfeasible as e:
        return {
            "status": "infeasible",
            "line": f"mixture: INFEASIBLE: {e}",
            "warnings": pin_warnings,
            "pool_tokens": sum(n * seq_len for n in samples.values()),
        }
    rows, warnings = {}, list(pin_warnings)
    for d, entry in sorted(plan.domains.items()):
        exposure, pool, epochs = float(entry.exposure_tokens), float(entry.pool_tokens), float(entry.epochs)
        unique = min(exposure, pool)
        rows[d] = {
            "target_ratio": ratios.get(d),
            "pool_tokens": pool,
            "exposure_tokens": exposure,
            "epochs": epochs,
            "unique_tokens": unique,
            "effective_tokens": effective_tokens(unique, exposure / unique) if unique else 0.0,
            "max_repetition_ratio": caps.get(d),
        }
        if epochs > REPETITION_WARN_EPOCHS:
            warnings.append(
                f"{d}: {epochs:.1f} epochs (> {REPETITION_WARN_EPOCHS:g}): repeated tokens are "
                f"worth less; effective {rows[d]['effective_tokens']:.3g} of {exposure:.3g} exposed"
            )
    return {
        "status": "planned",
        "domains": rows,
        "warnings": warnings,
        "pool_tokens": sum(r["pool_tokens"] for r in rows.values()),
        "effective_tokens": sum(r["effective_tokens"] for r in rows.values()),
    }


# ---------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """Throughput and overheads measured by a run; `mfu` is with respect to the plan's convention."""

    run_dir: str
    steps: int
    processed_tokens_per_second: float
    useful_fraction: float
    overhead_fraction: float
    mfu: float | None
    same_experiment: bool
    note: str
    architecture: str = "dense"  #: the calibration run's ("moe" or "dense"), for carrying its MFU over


# ---------------------------------------------------------------- the plan
def _time_block(tokens: float, tps: float, overhead_fraction: float, devices: int, price: float) -> dict:
    pure = pure_training_seconds(tokens, tps)
    wall = wall_clock_seconds(pure, overhead_fraction)
    device_hours = devices * wall / SECONDS_PER_HOUR
    return {
        "tokens_per_second": tps,
        "overhead_fraction": overhead_fraction,
        "pure_hours": pure / SECONDS_PER_HOUR,
        "pure_days": pure / SECONDS_PER_DAY,
        "wall_hours": wall / SECONDS_PER_HOUR,
        "wall_days": wall / SECONDS_PER_DAY,
        "device_hours": device_hours,
        "cost_usd": device_hours * price,
    }


def architecture(cfg: ExperimentSchema) -> str:
    """ "moe" for a mixture of experts (model.moe set), else "dense": the assumed MFU depends on it."""
    return "moe" if cfg.model.moe is not None else "dense"


def _time_plans(
    cfg: ExperimentSchema,
    tokens: float,
    fpt: float,
    peak_tflops: float,
    assumption: AssumedMfu,
    calibration: Calibration | None,
) -> tuple[dict, dict | None]:
    """(assumed, measured) time and cost of the `tokens` budget: at the assumed MFU, and at the
    calibration run's throughput (its MFU carried over when it trained another model or hardware,
    scaled to this architecture: runner.planning.assumptions.carried_mfu)."""
    n_devices, price, plan = devices(cfg), cfg.hardware.price_per_device_hour_usd, cfg.plan
    overheads = plan.checkpoint_overhead_fraction + plan.eval_overhead_fraction + plan.recovery_overhead_fraction
    mfu = assumption.value
    assumed_tps = mfu * peak_tflops * 1e12 * n_devices / fpt
    assumed = _time_block(tokens, assumed_tps, overheads, n_devices, price)
    assumed["mfu"] = mfu
    assumed["mfu_rule"], assumed["mfu_source"] = assumption.rule, assumption.source
    assumed["mfu_basis"] = assumption.basis
    n_all = params_of_config(cfg).all
    assumed["pure_hours_6n_all"] = (
        compute_seconds(training_flops(n_all, tokens), mfu, peak_tflops, n_devices) / SECONDS_PER_HOUR
    )
    if calibration is None:
        return assumed, None
    carried_note = ""
    if calibration.same_experiment or calibration.mfu is None:
        tps = calibration.processed_tokens_per_second
    else:
        carried, carried_note = carried_mfu(calibration.mfu, calibration.architecture, architecture(cfg))
        tps = carried * peak_tflops * 1e12 * n_devices / fpt
    measured = _time_block(tokens, tps, calibration.overhead_fraction, n_devices, price)
    measured["mfu_carried_note"] = carried_note
    measured["mfu"] = hardware.mfu(fpt, tps, 1.0, peak_tflops, n_devices)
    measured["useful_fraction"] = calibration.useful_fraction
    return assumed, measured


def _storage(cfg: ExperimentSchema, tokens: float, all_params: int, pool_tokens: float | None) -> dict[str, Any]:
    """Bytes of raw text, token shards and checkpoints the experiment needs (`tokens`: the budget)."""
    raw_bpt = cfg.plan.raw_bytes_per_token
    dtype_bytes = TOKEN_DTYPE_BYTES[cfg.tokenizer.token_dtype]
    # Without manifests the unique tokens needed are at most the budget (no repetition).
    data_tokens = pool_tokens if pool_tokens is not None else tokens
    keep_last = cfg.train.checkpoint.keep_last
    checkpoint_bytes = float(CHECKPOINT_BYTES_PER_PARAM * all_params)  # fp32 weights + two fp32 AdamW moments
    return {
        "data_tokens": data_tokens,
        "data_tokens_basis": "pool tokens of the manifests"
        if pool_tokens is not None
        else "exposure budget (manifests absent; no repetition assumed)",
        "raw_text_bytes": data_tokens * raw_bpt,
        "raw_bytes_per_token": raw_bpt,
        "token_shard_bytes": data_tokens * dtype_bytes,
        "token_dtype_bytes": dtype_bytes,
        "checkpoint_bytes": checkpoint_bytes,
        "keep_last": keep_last,
        "checkpoints_bytes": checkpoint_bytes * keep_last,
        # rank 0 gathers the whole checkpoint in host memory to write it (validate refuses what cannot fit)
        "host_memory_bytes": None if cfg.hardware.host_memory_gib is None else cfg.hardware.host_memory_gib * 2**30,
        "host_gather_fits": None
        if cfg.hardware.host_memory_gib is None
        else checkpoint_bytes <= cfg.hardware.host_memory_gib * 2**30,
    }


def checkpoint_copy_rate(cfg: ExperimentSchema) -> float:
    """Bytes per second of the loop's checkpoint copy to host memory: a host memcpy on a CPU; FSDP's
    gather into pageable memory; else the side-stream copy into pinned buffers (the loop goes on; its
    next optimizer step waits for the copy on the device)."""
    if cfg.hardware.accelerator == "cpu":
        return assumptions.HOST_MEMCPY_BYTES_PER_S
    if cfg.hardware.distributed == "fsdp":
        return assumptions.PAGEABLE_COPY_BYTES_PER_S
    return assumptions.PINNED_COPY_BYTES_PER_S


def checkpoint_time(cfg: ExperimentSchema, checkpoint_bytes: float, pure_seconds: float) -> dict[str, Any]:
    """What the experiment's checkpoints cost (SPEC's t_checkpoint: the time the loop stands still for
    them), from their bytes and runner.planning.assumptions' copy, disk and hashing rates. Under
    `train.checkpoint.write: background` the loop waits for the copy to host memory only, and for the
    previous write when checkpoints come faster than one is written; under `foreground` for the write too."""
    ck = cfg.train.checkpoint
    steps = total_steps(cfg)
    by_steps = steps // ck.interval_steps if ck.interval_steps else 0
    by_clock = int(pure_seconds // (ck.interval_minutes * 60)) if ck.interval_minutes else 0
    count = max(by_steps, by_clock, 1)  # a run always ends on a checkpoint
    copy = checkpoint_bytes / checkpoint_copy_rate(cfg)
    # written and hashed in one pass (runner.training.staging): the slower of the disk and the hash
    write = checkpoint_bytes / min(assumptions.DISK_WRITE_BYTES_PER_S, assumptions.SHA256_BYTES_PER_S)
    between = pure_seconds / count
    if ck.write == "background":
        stop = copy + max(write - between, 0.0)
    else:
        stop = copy + write
    rate = checkpoint_copy_rate(cfg)
    return {
        "write": ck.write,
        "copy": "pinned" if rate == assumptions.PINNED_COPY_BYTES_PER_S else "host",
        "count": count,
        "seconds_between": between,
        "copy_seconds": copy,
        "write_seconds": write,
        "stop_seconds": stop,
        "t_checkpoint_hours": count * stop / SECONDS_PER_HOUR,
        "fraction_of_pure": count * stop / pure_seconds if pure_seconds else 0.0,
        "assumed_fraction": cfg.plan.checkpoint_overhead_fraction,
        "source": assumptions.CHECKPOINT_SOURCE,
    }


#: `runner export`'s safetensors shard size, transformers' "5GB" (10**9 bytes a GB), as
#: runner.export.DEFAULT_MAX_SHARD_SIZE says (the export layer sits above planning; a test keeps them equal)
EXPORT_SHARD_BYTES = 5 * 10**9
EXPORT_DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def export_estimate(cfg: ExperimentSchema, all_params: int) -> dict[str, Any]:
    """What `runner export` of the run's model will write and cost its host, in the recipe's
    `export.dtype`: the folder's weights (every parameter once, a tied head stored once) and shards,
    the host's peak memory and the time (runner.planning.assumptions' measured per-parameter figures)."""
    dtype = cfg.export.dtype
    weights = float(all_params * EXPORT_DTYPE_BYTES[dtype])
    host = assumptions.EXPORT_FIXED_HOST_BYTES + assumptions.EXPORT_HOST_BYTES_PER_PARAM[dtype] * all_params
    return {
        "dtype": dtype,
        "weights_bytes": weights,
        "shards": max(1, math.ceil(weights / EXPORT_SHARD_BYTES)),
        "host_peak_bytes": host,
        "seconds": assumptions.EXPORT_FIXED_SECONDS + assumptions.EXPORT_SECONDS_PER_PARAM * all_params,
        "host_memory_fits": None
        if cfg.hardware.host_memory_gib is None
        else host <= cfg.hardware.host_memory_gib * 2**30,
        "source": assumptions.EXPORT_SOURCE,
    }


def build_plan(
    cfg: ExperimentSchema | Mapping[str, Any],
    *,
    mfu: float | None = None,
    calibration: Calibration | None = None,
    root: str | Path = ".",
    convention: Convention | None = None,
) -> dict[str, Any]:
    """Everything `runner plan` prints, as one JSON-able dict. Compute (FLOPs, time, cost) is under
    `convention`, by default the one a run records (a mixture of experts: active parameters);
    memory and checkpoint sizes always count every parameter."""
    cfg = as_schema(cfg)
    convention = convention or convention_for(cfg)
    hw, plan = cfg.hardware, cfg.plan
    counts = params_of_config(cfg)
    tokens = float(cfg.train.exposure_tokens)  # the plan (and its JSON) counts in floats: 2.6e10, not 26000000000
    peak = hardware.resolve_peak(hw)
    fpt = flops_per_token(cfg, convention)
    assumption = assumed_mfu(architecture(cfg), hw.default_mfu, cfg.recipes.get("hardware", ""), mfu, cfg)
    assumed, measured = _time_plans(cfg, tokens, fpt, peak.peak_tflops, assumption, calibration)
    mix = mixture_plan(cfg, Path(root))
    return {
        "experiment": {"name": cfg.name, "version": cfg.version},
        "params": counts.to_dict(),
        "convention": convention.to_dict(),
        "compute": {
            "exposure_tokens": tokens,
            "flops_per_token": fpt,
            "flops_6n": flops_per_token(cfg, Convention("6N", convention.params_counted)) * tokens,
            "flops_6n_attn": flops_per_token(cfg, Convention("6N+attn", convention.params_counted)) * tokens,
            "tokens_per_param": tokens / counts.all,
            "tokens_per_active_param": tokens / counts.active,
            "chinchilla_optimal_tokens": chinchilla_optimal_tokens(counts.all),
        },
        "hardware": {
            "device_name": hw.device_name,
            "devices": devices(cfg),
            **peak.to_dict(),
            "price_per_device_hour_usd": hw.price_per_device_hour_usd,
        },
        "overheads_assumed": {
            "checkpoint_overhead_fraction": plan.checkpoint_overhead_fraction,
            "eval_overhead_fraction": plan.eval_overhead_fraction,
            "recovery_overhead_fraction": plan.recovery_overhead_fraction,
        },
        "time": {"assumed": assumed, "measured": measured},
        "assumptions": {"mfu": assumption.to_dict()},
        "calibration": asdict(calibration) if calibration else None,
        "memory": memory_per_device(cfg),
        "storage": _storage(cfg, tokens, counts.all, mix.get("pool_tokens")),
        "checkpoint_time": checkpoint_time(
            cfg, CHECKPOINT_BYTES_PER_PARAM * counts.all, assumed["pure_hours"] * SECONDS_PER_HOUR
        ),
        "export": export_estimate(cfg, counts.all),
        "mixture": mix,
        "warnings": list(mix.get("warnings", [])),
    }


# ---------------------------------------------------------------- forecast to quality targets
def forecast_targets(plan: Mapping[str, Any], fit_result: Mapping[str, Any], targets: list) -> list[dict]:
    """For each target (name, domain, metric, threshold): the exposure tokens this experiment's model
    needs to reach it (runner.planning.scaling.forecast_target over the fit's runs), and the FLOPs,
    days, device-hours and dollars of that many tokens at the plan's assumed and measured throughput;
    or why it cannot be reached, and whether the answer is beyond the fit's trusted range."""
    from runner.planning.scaling import Point, forecast_target  # noqa: PLC0415  (scipy: a forecast's, not the trainer's)

    try:
        points = [Point(**p) for p in fit_result["points"]]
    except (KeyError, TypeError) as err:
        raise RunnerError(
            f"not a `runner fit` result (scaling_fit.json): {type(err).__name__}: {err}", file=plan.get("fit_file")
        ) from None
    params = float(plan["params"]["non_embedding"])
    hw = plan["hardware"]
    out = []
    fits: dict[tuple[str, str], Any] = {}  # targets judging the same quantity share its fit
    for t in targets:
        result = forecast_target(points, t.domain, t.metric, t.threshold, params, fits)
        result.update(target=t.name, definition=t.describe())
        if result["status"] == "reachable":
            result["time"] = {
                name: _time_block(
                    result["tokens"],
                    block["tokens_per_second"],
                    block["overhead_fraction"],
                    hw["devices"],
                    hw["price_per_device_hour_usd"],
                )
                for name, block in plan["time"].items()
                if block
            }
        out.append(result)
    return out


def format_forecast(forecast: list[dict], fit_file: str) -> list[str]:
    out = [f"forecast to quality targets (L(N, D) fitted to each target's quantity over the runs of {fit_file})"]
    if not forecast:
        return out + ["  no targets declared (eval recipe `targets:`)"]
    for f in forecast:
        head = f"  {f['target']} ({f['definition']}): "
        if f["status"] != "reachable":
            out.append(head + f"{f['status'].upper()}: {f['detail']}")
            continue
        times = "; ".join(
            f"{name} {_duration(b['wall_hours'])}, {b['device_hours']:,.1f} device-h, ${b['cost_usd']:,.2f}"
            for name, b in f["time"].items()
        )
        out.append(head + f"{_si(f['tokens'])} tokens, {f['flops']:.3e} FLOPs; {times}")
        out += [f"    flag: {flag}" for flag in f["flags"]]
    return out


def _si(x: float, unit: str = "") -> str:
    for factor, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {suffix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _duration(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:,.1f} min"
    return f"{hours:,.1f} h ({hours / 24:,.1f} d)"


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB"


def _row(out: list[str], label: str, *values: str, note: str = "") -> None:
    out.append((f"  {label:<34}" + "".join(f"{v:>22}" for v in values) + (f"   {note}" if note else "")).rstrip())


def _format_model_and_compute(plan: Mapping[str, Any], out: list[str]) -> None:
    p, c, hw, conv = plan["params"], plan["compute"], plan["hardware"], plan["convention"]
    out.append("model")
    _row(out, "params (all)", f"{p['all']:,}", note="memory and checkpoints" if p.get("moe") else "")
    _row(out, "params (non-embedding)", f"{p['non_embedding']:,}")
    layer = p["per_layer"]
    if p.get("moe"):
        _row(out, "params (active per token)", f"{p['active']:,}", note="compute: FLOPs and MFU")
        _row(
            out,
            "per layer (attn / router / norms)",
            f"{layer['attention']:,} / {layer['router']:,} / {layer['norms']:,}",
        )
        _row(
            out,
            "per layer experts: all (k active)",
            f"{layer['mlp']:,} ({layer['mlp_active']:,})",
            note=f"{layer['n_experts']} experts x {layer['expert']:,}, k = {layer['experts_per_token']}",
        )
    else:
        _row(out, "per layer (attn / mlp / norms)", f"{layer['attention']:,} / {layer['mlp']:,} / {layer['norms']:,}")
    out.append("compute")
    _row(out, "exposure tokens", _si(c["exposure_tokens"]))
    # Pilots and smoke runs sit far below one token per parameter: keep 3 significant digits.
    tpp = c["tokens_per_param"]
    _row(out, "tokens per parameter", f"{tpp:.1f}" if tpp >= 1 else f"{tpp:.3g}")
    if p.get("moe"):
        tpa = c["tokens_per_active_param"]
        _row(out, "tokens per active parameter", f"{tpa:.1f}" if tpa >= 1 else f"{tpa:.3g}")
    _row(out, "Chinchilla-optimal tokens (20 N)", _si(c["chinchilla_optimal_tokens"]))
    _row(out, "FLOPs 6N", f"{c['flops_6n']:.3e}")
    _row(out, "FLOPs 6N+attn", f"{c['flops_6n_attn']:.3e}")
    note = f"convention {conv['flops_formula']}, params {conv['params_counted']}"
    _row(out, "FLOPs per token", f"{c['flops_per_token']:.4g}", note=note)
    out.append("hardware")
    _row(out, "device x count", f"{hw['device_name']} x {hw['devices']}")
    _row(out, "peak (dense)", f"{hw['peak_tflops']:g} TFLOP/s {hw['peak_dtype']}")
    out.append(f"  peak source: {hw['peak_source']}")


def _format_time(plan: Mapping[str, Any], out: list[str]) -> None:
    t = plan["time"]
    first = {"measured": "device-measured MFU", "--mfu": "--mfu"}.get(t["assumed"].get("mfu_basis", ""), "assumed")
    cols = [(first, t["assumed"])] + (
        [("calibration run" if first != "assumed" else "measured", t["measured"])] if t["measured"] else []
    )
    out.append(f"{'time and cost':<36}" + "".join(f"{name:>22}" for name, _ in cols))
    _row(out, "MFU", *(f"{b['mfu']:.1%}" for _, b in cols))
    _row(out, "tokens/s (processed)", *(_si(b["tokens_per_second"]) for _, b in cols))
    _row(out, "pure training", *(_duration(b["pure_hours"]) for _, b in cols))
    seed_convention = _duration(t["assumed"]["pure_hours_6n_all"])
    _row(out, "  same at 6N, N = all params", seed_convention, note="(the seed-table convention)")
    _row(out, "overheads (fraction of pure)", *(f"{b['overhead_fraction']:.1%}" for _, b in cols))
    _row(out, "wall clock", *(_duration(b["wall_hours"]) for _, b in cols))
    _row(out, "device-hours", *(f"{b['device_hours']:,.1f}" for _, b in cols))
    costs = (f"{b['cost_usd']:,.0f}" if b["cost_usd"] >= 100 else f"{b['cost_usd']:.2f}" for _, b in cols)
    _row(out, "cost (USD)", *costs)
    basis = t["assumed"].get("mfu_basis", "assumed")
    out.append(f"  MFU {basis}: {t['assumed']['mfu_rule']} ({t['assumed']['mfu_source']})")
    if t["measured"] and plan.get("calibration"):
        cal = plan["calibration"]
        out.append(
            f"  measured MFU: the median step's tokens/s of {cal['run_dir']} ({cal['steps']} steps, the first left out "
            "as warm-up); its overheads: the run's wall clock over its summed step time"
        )
    if plan.get("calibration") and plan["calibration"].get("note"):
        out.append(f"  calibration: {plan['calibration']['note']}")
    if t["measured"] and t["measured"].get("mfu_carried_note"):
        out.append(f"  calibration: {t['measured']['mfu_carried_note']}")


def _format_memory_and_storage(plan: Mapping[str, Any], out: list[str]) -> None:
    mem, st = plan["memory"], plan["storage"]
    out.append(f"memory per device (micro batch {mem['micro_batch_sequences']} x {mem['seq_len']})")
    for k, v in mem["model_state_bytes"].items():
        _row(out, k, _gib(v))
    _row(out, "activations (no checkpointing)", _gib(mem["activation_bytes_full"]))
    _row(out, f"  of which the loss's peak ({mem['cross_entropy']})", _gib(mem["head_transient_bytes"]))
    _row(out, "activations (checkpointing)", _gib(mem["activation_bytes_checkpointed"]))
    if "activation_bytes_selective" in mem:
        _row(out, "activations (selective ckpt)", _gib(mem["activation_bytes_selective"]))
    _row(out, "total (as configured)", _gib(mem["total_bytes"]), note=f"of {_gib(mem['capacity_bytes'])}")
    verdict = "fits"
    if not mem["fits"]:
        verdict = "does NOT fit"
        if mem["fits_with_checkpointing"] and not mem["activation_checkpointing"]:
            verdict += "; fits with activation checkpointing"
    _row(out, "verdict", verdict)
    out.append(f"  assumes: {mem['assumptions']}")
    out.append("storage")
    _row(out, "data tokens", _si(st["data_tokens"]), note=st["data_tokens_basis"])
    _row(out, "raw text", _gib(st["raw_text_bytes"]), note=f"{st['raw_bytes_per_token']:g} B/token")
    _row(out, "token shards", _gib(st["token_shard_bytes"]), note=f"{st['token_dtype_bytes']} B/token")
    each = f"{_gib(st['checkpoint_bytes'])} each (fp32 weights + AdamW moments)"
    _row(out, f"checkpoints (keep_last {st['keep_last']})", _gib(st["checkpoints_bytes"]), note=each)
    host = st.get("host_memory_bytes")
    if host is None:
        gather = "host memory unknown (hardware.host_memory_gib)"
    elif st["host_gather_fits"]:
        gather = f"fits in {_gib(host)} of host memory"
    else:
        gather = f"does NOT fit in {_gib(host)} of host memory: nodes with more (no sharded checkpoint format yet)"
    _row(out, "rank 0 gathers a checkpoint", _gib(st["checkpoint_bytes"]), note=gather)
    if "checkpoint_time" in plan:
        _format_checkpoint_time(plan["checkpoint_time"], out)
    if "export" in plan:
        _format_export(plan["export"], out)


def _format_checkpoint_time(ck: Mapping[str, Any], out: list[str]) -> None:
    behind = "behind the loop" if ck["write"] == "background" else "in the loop (train.checkpoint.write: foreground)"
    _row(out, "checkpoint write + sha256", f"{ck['write_seconds']:,.3g} s", note=f"each, one pass, {behind}")
    pinned = ck.get("copy") == "pinned"
    waits = (
        "the copy to pinned host memory (an upper bound: enqueued, the next optimizer step waits for it)"
        if pinned
        else "the copy to host memory"
    ) + (
        ", and the previous write (checkpoints come faster than one is written)"
        if ck["write"] == "background" and ck["write_seconds"] > ck["seconds_between"]
        else ""
        if ck["write"] == "background"
        else " and the write"
    )
    _row(out, "the loop stops per checkpoint", f"{ck['stop_seconds']:,.3g} s", note=f"for {waits}")
    _row(
        out,
        f"t_checkpoint (about {ck['count']:,} checkpoints)",
        _duration(ck["t_checkpoint_hours"]),
        note=f"{ck['fraction_of_pure']:.2%} of pure training; the overheads assume "
        f"{ck['assumed_fraction']:.1%} (plan.checkpoint_overhead_fraction)",
    )
    out.append(f"  checkpoint rates: {ck['source']}")


def _format_export(ex: Mapping[str, Any], out: list[str]) -> None:
    out.append(f"export (runner export, {ex['dtype']}; estimated from exports measured on a 2-core host)")
    shards = f"{ex['shards']} safetensors shard{'s' if ex['shards'] > 1 else ''} of at most 5 GB"
    _row(out, "folder weights", _gib(ex["weights_bytes"]), note=shards)
    fits = {None: "host memory unknown (hardware.host_memory_gib)", True: "fits in host memory"}
    fit = fits.get(ex["host_memory_fits"], "does NOT fit in host memory")
    _row(out, "host peak memory", _gib(ex["host_peak_bytes"]), note=fit)
    _row(out, "time on a 2-core host", _duration(ex["seconds"] / 3600.0), note="one CPU process, verification included")


def _format_mixture(mix: Mapping[str, Any], out: list[str]) -> None:
    if mix["status"] != "planned":
        out.append(mix["line"])
        return
    out.append("mixture" + " " * 28 + "".join(f"{h:>14}" for h in ("ratio", "pool", "exposure", "epochs", "effective")))
    for d, r in mix["domains"].items():
        cells = (
            f"{r['target_ratio']:.3f}",
            _si(r["pool_tokens"]),
            _si(r["exposure_tokens"]),
            f"{r['epochs']:.2f}",
            _si(r["effective_tokens"]),
        )
        out.append(f"  {d:<33}" + "".join(f"{v:>14}" for v in cells))


def format_plan(plan: Mapping[str, Any]) -> str:
    """The human table of a plan."""
    out = [f"plan: {plan['experiment']['name']}@{plan['experiment']['version']}", ""]
    _format_model_and_compute(plan, out)
    _format_time(plan, out)
    _format_memory_and_storage(plan, out)
    _format_mixture(plan["mixture"], out)
    if "downstream" in plan:
        out += format_downstream_lines(plan["downstream"], plan.get("downstream_not_planned"))
    if "forecast" in plan:
        out += format_forecast(plan["forecast"], plan.get("fit_file", "the fit"))
    out += [f"warning: {w}" for w in plan["warnings"]]
    return "\n".join(out)
