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
from runner.config.schema import ExperimentSchema
from runner.data.manifest import load_manifest, num_samples
from runner.data.mixture import plan_mixture
from runner.errors import MixtureInfeasible, RunnerError
from runner.planning import assumptions, hardware
from runner.planning.assumptions import AssumedMfu, assumed_mfu, carried_mfu
from runner.planning.flops import (
    Convention,
    convention_for,
    flops_per_token,
    forward_flops_per_token,
    params_of_config,
)
from runner.planning.memory import as_schema, memory_per_device
from runner.planning.resources import CHECKPOINT_BYTES_PER_PARAM, PINNED_HOST_FRACTION, host_gather_bytes, pinned_fit

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
CHINCHILLA_TOKENS_PER_PARAM = 20.0
# Muennighoff et al. 2023 ("Scaling Data-Constrained Language Models"), fitted decay constant of
# the value of repeated tokens: past ~4 epochs returns diminish quickly.
REPETITION_R_STAR = 15.4
REPETITION_WARN_EPOCHS = 4.0
TOKEN_DTYPE_BYTES = {"uint16": 2, "uint32": 4}


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
    #: one attempt's start-up (run.json t_startup / attempts): a fixed cost, added once, never a fraction
    startup_seconds: float = 0.0


# ---------------------------------------------------------------- the plan
def _time_block(
    tokens: float, tps: float, overhead_fraction: float, devices: int, price: float, startup_seconds: float = 0.0
) -> dict:
    pure = pure_training_seconds(tokens, tps)
    wall = wall_clock_seconds(pure, overhead_fraction) + startup_seconds
    device_hours = devices * wall / SECONDS_PER_HOUR
    return {
        "tokens_per_second": tps,
        "overhead_fraction": overhead_fraction,
        "pure_hours": pure / SECONDS_PER_HOUR,
        "pure_days": pure / SECONDS_PER_DAY,
        "wall_hours": wall / SECONDS_PER_HOUR,
        "wall_days": wall / SECONDS_PER_DAY,
        "startup_seconds": startup_seconds,
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
    measured = _time_block(tokens, tps, calibration.overhead_fraction, n_devices, price, calibration.startup_seconds)
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


def pinned_host(cfg: ExperimentSchema) -> dict[str, Any] | None:
    """Rank 0's pinned checkpoint buffers (runner.training.staging.PinnedStaging): their bytes (the
    checkpoint's, held for the whole run) and, where `hardware.host_memory_gib` states the host,
    whether the trainer's guard (runner.planning.resources.pinned_fit) would pin them there, the stated
    memory taken for the available one (an upper bound: the trainer reads MemAvailable at the start).
    None where no pinned copy is made: a CPU run, FSDP (its gather copies to pageable memory)."""
    if cfg.hardware.accelerator == "cpu" or cfg.hardware.distributed == "fsdp":
        return None
    need = host_gather_bytes(cfg)
    host = cfg.hardware.host_memory_gib * 2**30 if cfg.hardware.host_memory_gib else None
    return {
        "bytes": need,
        "host_memory_bytes": host,
        "pinned": None if host is None else pinned_fit(need, host).pinned,
        "fraction": PINNED_HOST_FRACTION,
    }


def checkpoint_copy_rate(cfg: ExperimentSchema) -> float:
    """Bytes per second of the loop's checkpoint copy to host memory: a host memcpy on a CPU; FSDP's
    gather into pageable memory, and the pageable copy where the stated host cannot spare the pinned
    buffers; else the side-stream copy into pinned buffers (the loop goes on; its next optimizer step
    waits for the copy on the device)."""
    if cfg.hardware.accelerator == "cpu":
        return assumptions.HOST_MEMCPY_BYTES_PER_S
    pinned = pinned_host(cfg)
    if pinned is None or pinned["pinned"] is False:
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
        "pinned_host": pinned_host(cfg),
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
            # what the model will serve (plan.inference_tokens): forward only, as a downstream scoring counts
            # it, at the training's context length
            "inference_tokens": float(plan.inference_tokens),
            "inference_flops": forward_flops_per_token(fpt) * float(plan.inference_tokens),
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
    from runner.planning.scaling import Point, check_point, forecast_target  # noqa: PLC0415  (scipy: a forecast's, not the trainer's)

    try:
        points = [Point(**p) for p in fit_result["points"]]
    except (KeyError, TypeError) as err:
        raise RunnerError(
            f"not a `runner fit` result (scaling_fit.json): {type(err).__name__}: {err}", file=plan.get("fit_file")
        ) from None
    for i, point in enumerate(points):
        check_point(point, plan.get("fit_file"), f"points[{i}].", "not a `runner fit` result: ")
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
                    block.get("startup_seconds", 0.0),
                )
                for name, block in plan["time"].items()
                if block
            }
        out.append(result)
    return out
