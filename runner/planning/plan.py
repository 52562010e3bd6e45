"""The planner: what an experiment will cost before it runs, and after a calibration run.

Owns: compute (6N and PaLM's 6N+attn), tokens per parameter, training and wall-clock time at an
assumed or measured throughput, device-hours and cost, memory per device, storage, and the
mixture's per-domain epochs with Muennighoff et al. (2023) effective data under repetition.
Never: trains, writes files, or changes a recipe; it reads manifests and run metrics only.

Time is `T / q` (tokens over tokens per second) times `1 + overhead fractions` (SPEC: wall clock
= T_useful/q + t_checkpoint + t_eval + t_recovery, the three t's stated as fractions of T/q).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runner.config.rules import devices
from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl, read_yaml
from runner.planning.flops import Convention, as_plain, convention_for, flops_per_token, params_of_config
from runner.planning.hardware import resolve_peak

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
GIB = 2.0**30
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


def training_days_6n(params: float, tokens: float, mfu: float, peak_tflops: float, devices: int = 1) -> float:
    """Days of pure training for 6ND at `mfu` (e.g. 0.76e9 params, 25e9 tokens, 40% of one H200: 3.3)."""
    return compute_seconds(training_flops(params, tokens), mfu, peak_tflops, devices) / SECONDS_PER_DAY


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
def memory_per_device(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Bytes per device of model state and activations, with the assumptions stated in the result.

    Model state (per parameter): bf16 mixed precision keeps fp32 master weights (4 B), fp32
    grads (4 B), AdamW's two fp32 moments (8 B), plus bf16 copies of the weights that autocast
    makes for the matmuls (2 B, an upper bound: they are transient); fp32 drops the copies.
    FSDP (full shard) divides model state by the devices; DDP and single device hold it all.

    Activations per layer: the method of Korthikanti et al. 2022 (sec. 4.1: count every tensor
    autograd saves) applied to this Llama block, with a fused attention kernel (sdpa/flash: no
    s^2 score matrix is stored) and no dropout, in elements of the compute dtype:
      attention: s*b*(4h + 2*kv)   (norm input, qkv input, q, k, v, attention output)
      mlp:       s*b*(2h + 4f)     (norm input, gate/up input, gate, silu(gate), up, product)
    eager attention adds the softmax output a*s^2*b. With activation checkpointing each layer keeps
    only its input (s*b*h) and one layer's activations are live during its recompute.
    An OLMoE block (mixture of experts, expert size f_e, k experts per position, E experts) saves
      attention: s*b*(5h + 3*kv)    (as Llama's, plus the q and k norms' inputs)
      experts:   s*b*(2h + k*(2h + 4*f_e))  (norm and router inputs; per routed copy its gathered
                 input, gate, silu(gate), up, product and weighted output)
    plus the router's fp32 logits and probabilities, s*b*2E*4 bytes. Model state counts every
    expert (total parameters, SPEC): all of them live in memory whichever a token uses.
    The head adds s*b*V for logits plus two fp32 s*b*V tensors (upcast, log-softmax) for the loss.
    Not counted: CUDA context, allocator fragmentation, communication buffers.
    """
    cfg = as_plain(cfg)
    model, train, hw = cfg["model"], cfg["train"], cfg["hardware"]
    counts = params_of_config(cfg)
    n_params = counts.all
    precision = hw.get("precision", "bf16")
    act_bytes = 2 if precision == "bf16" else 4
    state_bytes_per_param = {"weights (fp32 master)": 4, "grads (fp32)": 4, "adamw moments (2 x fp32)": 8}
    if precision == "bf16":
        state_bytes_per_param["bf16 autocast weight copies"] = 2
    shard = devices(cfg) if hw.get("distributed") == "fsdp" else 1
    state = {k: v * n_params / shard for k, v in state_bytes_per_param.items()}

    s, b = int(train["seq_len"]), int(train["micro_batch_sequences"])
    h, f, a = int(model["hidden_size"]), int(model["intermediate_size"]), int(model["n_heads"])
    kv = int(model.get("n_kv_heads") or a) * (h // a)
    vocab_rows = counts.embedding // h
    layer_elems, router_bytes = s * b * (6 * h + 2 * kv + 4 * f), 0
    if counts.moe:
        moe = model["moe"]
        k, f_e = int(moe["experts_per_token"]), int(moe["expert_intermediate_size"])
        layer_elems = s * b * (5 * h + 3 * kv + 2 * h + k * (2 * h + 4 * f_e))
        router_bytes = s * b * 2 * int(moe["n_experts"]) * 4
    if model.get("attn_implementation") == "eager":
        layer_elems += a * s * s * b
    head_bytes = s * b * vocab_rows * (act_bytes + 4 + 4)
    layers = counts.n_layers
    full = layers * (layer_elems * act_bytes + router_bytes) + head_bytes
    checkpointed = (layers * s * b * h + layer_elems) * act_bytes + router_bytes + head_bytes
    checkpointing = bool(model.get("activation_checkpointing"))
    activations = checkpointed if checkpointing else full
    state_total = sum(state.values())
    total = state_total + activations
    capacity = float(hw.get("memory_gib") or 0) * GIB
    return {
        "precision": precision,
        "sharded_over_devices": shard,
        "params": n_params,
        "model_state_bytes": state,
        "model_state_total_bytes": state_total,
        "activation_bytes_full": full,
        "activation_bytes_checkpointed": checkpointed,
        "activation_checkpointing": checkpointing,
        "activation_bytes": activations,
        "micro_batch_sequences": b,
        "seq_len": s,
        "total_bytes": total,
        "capacity_bytes": capacity,
        "fits": bool(capacity) and total <= capacity,
        "fits_with_checkpointing": bool(capacity) and state_total + checkpointed <= capacity,
        "assumptions": (
            "bf16 mixed: fp32 master weights + fp32 grads + 2 fp32 AdamW moments "
            "+ transient bf16 weight copies; activations per Korthikanti et al. 2022 "
            "method for a Llama block with fused attention; no framework overhead"
        )
        if precision == "bf16"
        else (
            "fp32: weights + grads + 2 AdamW moments at 4 B; activations per Korthikanti "
            "et al. 2022 method at 4 B; no framework overhead"
        ),
    }


# ---------------------------------------------------------------- mixture
def mixture_plan(cfg: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """Per-domain exposure, epochs and effective tokens from the pinned manifests, or why not."""
    cfg = as_plain(cfg)
    pins = (cfg.get("data") or {}).get("manifests") or {}
    if not pins:
        return {"status": "absent", "line": "mixture: no data.manifests pinned; per-domain plan skipped"}
    paths = {d: (Path(p["path"]) if Path(p["path"]).is_absolute() else root / p["path"]) for d, p in pins.items()}
    missing = sorted(d for d, p in paths.items() if not p.exists())
    if missing:
        return {
            "status": "absent",
            "line": f"mixture: manifests not on disk for {', '.join(missing)}; per-domain plan skipped "
            "(run `runner data prepare` first)",
        }
    from runner.data.manifest import load_manifest, num_samples
    from runner.data.mixture import plan_mixture
    from runner.errors import MixtureInfeasible

    seq_len = int(cfg["train"]["seq_len"])
    manifests = {d: load_manifest(paths[d], verify="size") for d in sorted(paths)}
    # A stale pin does not change the arithmetic; it is reported, and launch refuses it.
    pin_warnings = [
        f"data.manifests.{d}.sha256: pinned {pins[d].get('sha256')}, on disk {m.sha256} "
        "(launch will refuse until re-pinned)"
        for d, m in manifests.items()
        if pins[d].get("sha256") not in (None, m.sha256)
    ]
    domains = cfg["mixture"]["domains"]
    samples = {d: num_samples(m.pool_tokens, seq_len) for d, m in manifests.items()}
    ratios = {d: float(domains[d]["target_ratio"]) for d in domains}
    caps = {d: float(domains[d].get("max_repetition_ratio", 1.0)) for d in domains}
    try:
        plan = plan_mixture(
            samples,
            ratios,
            caps,
            int(cfg["train"]["exposure_tokens"]),
            seq_len,
            int(cfg["train"]["global_batch_sequences"]),
        )
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


def read_calibration(run_dir: str | Path, cfg: Mapping[str, Any], convention: Convention | None = None) -> Calibration:
    """Measured throughput (median tokens_per_second after the first step), overheads
    (wall / sum of step time - 1) and useful fraction of a run folder. The MFU is under
    `convention`, by default the one a run of `cfg` records (flops.convention_for)."""
    run_dir = Path(run_dir)
    convention = convention or convention_for(cfg)
    metrics = run_dir / "metrics" / "train.jsonl"
    if not metrics.exists():
        raise RunnerError("no metrics/train.jsonl: not a run folder, or it has not logged a step", file=str(run_dir))
    rows = [r for r in read_jsonl(metrics) if r.get("tokens_per_second")]
    if not rows:
        raise RunnerError("no step with tokens_per_second", file=str(metrics))
    # The first step pays for compilation and warm-up; it counts as overhead, not throughput.
    steady = rows[1:] or rows
    tps = statistics.median(float(r["tokens_per_second"]) for r in steady)
    step_total = sum(float(r.get("step_seconds") or 0) for r in rows)
    walls = [float(r["wall_seconds"]) for r in rows if r.get("wall_seconds") is not None]
    # wall_seconds is elapsed since the run started (non-decreasing); per-step values are summed.
    wall = (walls[-1] if all(b >= a for a, b in zip(walls, walls[1:])) else sum(walls)) if walls else step_total
    overhead = max(0.0, wall / step_total - 1.0) if step_total > 0 else 0.0
    last = rows[-1]
    useful_fraction = 1.0
    if last.get("tokens_useful") and last.get("tokens_processed"):
        useful_fraction = float(last["tokens_useful"]) / float(last["tokens_processed"])

    target = as_plain(cfg)
    run_cfg, note = None, ""
    exp_file = run_dir / "experiment.yaml"
    if exp_file.exists():
        run_cfg = read_yaml(exp_file)
    same = run_cfg is None or (
        run_cfg.get("model") == target.get("model")
        and run_cfg.get("hardware") == target.get("hardware")
        and run_cfg.get("train", {}).get("seq_len") == target["train"]["seq_len"]
    )
    if run_cfg is None:
        note = "run folder has no experiment.yaml: assumed to be this experiment"
        run_cfg = target
    elif not same:
        note = "calibration run differs in model/hardware/seq_len: its MFU is carried over, not its tokens/s"
    mfu_value = None
    run_info = read_json(run_dir / "run.json") if (run_dir / "run.json").exists() else {}
    conventions = run_info.get("conventions") or {}
    # The devices that ran the measured steps (rows record them; a launcher may differ from the recipe).
    held = [int(r["devices"]) for r in steady if r.get("devices")]
    n_devices = int(statistics.median_low(held)) if held else int(run_info.get("devices") or devices(run_cfg))
    try:
        peak = float(conventions.get("peak_tflops") or resolve_peak(run_cfg["hardware"]).peak_tflops)
        mfu_value = tps * flops_per_token(run_cfg, convention) / (peak * 1e12 * n_devices)
    except RunnerError as e:
        note = (note + "; " if note else "") + f"MFU not derivable: {e}"
    return Calibration(str(run_dir), len(rows), tps, useful_fraction, overhead, mfu_value, same, note)


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


def build_plan(
    cfg: Mapping[str, Any],
    *,
    mfu: float | None = None,
    calibration: Calibration | None = None,
    root: str | Path = ".",
    convention: Convention | None = None,
) -> dict[str, Any]:
    """Everything `runner plan` prints, as one JSON-able dict. Compute (FLOPs, time, cost) is under
    `convention`, by default the one a run records (a mixture of experts: active parameters);
    memory and checkpoint sizes always count every parameter."""
    cfg = as_plain(cfg)
    convention = convention or convention_for(cfg)
    train, hw, plan_cfg = cfg["train"], cfg["hardware"], cfg.get("plan") or {}
    counts = params_of_config(cfg)
    tokens = float(train["exposure_tokens"])
    n_devices = devices(cfg)
    peak = resolve_peak(hw)
    mfu = float(mfu if mfu is not None else hw.get("default_mfu", 0.4))
    fpt = flops_per_token(cfg, convention)
    fpt_6n = flops_per_token(cfg, Convention("6N", convention.params_counted))
    fpt_attn = flops_per_token(cfg, Convention("6N+attn", convention.params_counted))
    price = float(hw.get("price_per_device_hour_usd") or 0.0)
    fractions = {
        k: float(plan_cfg.get(k, 0.0))
        for k in ("checkpoint_overhead_fraction", "eval_overhead_fraction", "recovery_overhead_fraction")
    }
    assumed_tps = mfu * peak.peak_tflops * 1e12 * n_devices / fpt
    time_assumed = _time_block(tokens, assumed_tps, sum(fractions.values()), n_devices, price)
    time_assumed["mfu"] = mfu
    time_assumed["pure_hours_6n_all"] = (
        compute_seconds(training_flops(counts.all, tokens), mfu, peak.peak_tflops, n_devices) / SECONDS_PER_HOUR
    )
    time_measured = None
    if calibration is not None:
        if calibration.same_experiment or calibration.mfu is None:
            tps = calibration.processed_tokens_per_second
        else:
            tps = calibration.mfu * peak.peak_tflops * 1e12 * n_devices / fpt
        time_measured = _time_block(tokens, tps, calibration.overhead_fraction, n_devices, price)
        time_measured["mfu"] = tps * fpt / (peak.peak_tflops * 1e12 * n_devices)
        time_measured["useful_fraction"] = calibration.useful_fraction
    mix = mixture_plan(cfg, Path(root))
    pool_tokens = mix.get("pool_tokens")
    raw_bpt = float(plan_cfg.get("raw_bytes_per_token", 4.2))
    dtype_bytes = TOKEN_DTYPE_BYTES.get(cfg.get("tokenizer", {}).get("token_dtype"), 4)
    # Without manifests the unique tokens needed are at most the budget (no repetition).
    data_tokens = pool_tokens if pool_tokens is not None else tokens
    keep_last = int((train.get("checkpoint") or {}).get("keep_last", 1))
    checkpoint_bytes = 12.0 * counts.all  # fp32 weights + two fp32 AdamW moments
    warnings = list(mix.get("warnings", []))
    return {
        "experiment": {"name": cfg.get("name"), "version": cfg.get("version")},
        "params": counts.to_dict(),
        "convention": convention.to_dict(),
        "compute": {
            "exposure_tokens": tokens,
            "flops_per_token": fpt,
            "flops_6n": fpt_6n * tokens,
            "flops_6n_attn": fpt_attn * tokens,
            "tokens_per_param": tokens / counts.all,
            "tokens_per_active_param": tokens / counts.active,
            "chinchilla_optimal_tokens": chinchilla_optimal_tokens(counts.all),
        },
        "hardware": {
            "device_name": hw.get("device_name"),
            "devices": n_devices,
            **peak.to_dict(),
            "price_per_device_hour_usd": price,
        },
        "overheads_assumed": fractions,
        "time": {"assumed": time_assumed, "measured": time_measured},
        "calibration": asdict(calibration) if calibration else None,
        "memory": memory_per_device(cfg),
        "storage": {
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
        },
        "mixture": mix,
        "warnings": warnings,
    }


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


def format_plan(plan: Mapping[str, Any]) -> str:
    """The human table of a plan."""
    p, c, hw, mem, st = plan["params"], plan["compute"], plan["hardware"], plan["memory"], plan["storage"]
    conv = plan["convention"]
    out = [f"plan: {plan['experiment']['name']}@{plan['experiment']['version']}", ""]

    def row(label: str, *values: str, note: str = "") -> None:
        out.append((f"  {label:<34}" + "".join(f"{v:>22}" for v in values) + (f"   {note}" if note else "")).rstrip())

    out.append("model")
    row("params (all)", f"{p['all']:,}", note="memory and checkpoints" if p.get("moe") else "")
    row("params (non-embedding)", f"{p['non_embedding']:,}")
    if p.get("moe"):
        layer = p["per_layer"]
        row("params (active per token)", f"{p['active']:,}", note="compute: FLOPs and MFU")
        row("per layer (attn / router / norms)", f"{layer['attention']:,} / {layer['router']:,} / {layer['norms']:,}")
        row(
            "per layer experts: all (k active)",
            f"{layer['mlp']:,} ({layer['mlp_active']:,})",
            note=f"{layer['n_experts']} experts x {layer['expert']:,}, k = {layer['experts_per_token']}",
        )
    else:
        row(
            "per layer (attn / mlp / norms)",
            f"{p['per_layer']['attention']:,} / {p['per_layer']['mlp']:,} / {p['per_layer']['norms']:,}",
        )
    out.append("compute")
    row("exposure tokens", _si(c["exposure_tokens"]))
    # Pilots and smoke runs sit far below one token per parameter: keep 3 significant digits.
    tpp = c["tokens_per_param"]
    row("tokens per parameter", f"{tpp:.1f}" if tpp >= 1 else f"{tpp:.3g}")
    if p.get("moe"):
        tpa = c["tokens_per_active_param"]
        row("tokens per active parameter", f"{tpa:.1f}" if tpa >= 1 else f"{tpa:.3g}")
    row("Chinchilla-optimal tokens (20 N)", _si(c["chinchilla_optimal_tokens"]))
    row("FLOPs 6N", f"{c['flops_6n']:.3e}")
    row("FLOPs 6N+attn", f"{c['flops_6n_attn']:.3e}")
    row(
        "FLOPs per token",
        f"{c['flops_per_token']:.4g}",
        note=f"convention {conv['flops_formula']}, params {conv['params_counted']}",
    )
    out.append("hardware")
    row("device x count", f"{hw['device_name']} x {hw['devices']}")
    row("peak (dense)", f"{hw['peak_tflops']:g} TFLOP/s {hw['peak_dtype']}")
    out.append(f"  peak source: {hw['peak_source']}")
    t = plan["time"]
    cols = [("assumed", t["assumed"])] + ([("measured", t["measured"])] if t["measured"] else [])
    out.append(f"{'time and cost':<36}" + "".join(f"{name:>22}" for name, _ in cols))
    row("MFU", *(f"{b['mfu']:.1%}" for _, b in cols))
    row("tokens/s (processed)", *(_si(b["tokens_per_second"]) for _, b in cols))
    row("pure training", *(_duration(b["pure_hours"]) for _, b in cols))
    row(
        "  same at 6N, N = all params", _duration(t["assumed"]["pure_hours_6n_all"]), note="(the seed-table convention)"
    )
    row("overheads (fraction of pure)", *(f"{b['overhead_fraction']:.1%}" for _, b in cols))
    row("wall clock", *(_duration(b["wall_hours"]) for _, b in cols))
    row("device-hours", *(f"{b['device_hours']:,.1f}" for _, b in cols))
    row("cost (USD)", *(f"{b['cost_usd']:,.0f}" if b["cost_usd"] >= 100 else f"{b['cost_usd']:.2f}" for _, b in cols))
    if plan.get("calibration") and plan["calibration"].get("note"):
        out.append(f"  calibration: {plan['calibration']['note']}")
    out.append(f"memory per device (micro batch {mem['micro_batch_sequences']} x {mem['seq_len']})")
    for k, v in mem["model_state_bytes"].items():
        row(k, _gib(v))
    row("activations (no checkpointing)", _gib(mem["activation_bytes_full"]))
    row("activations (checkpointing)", _gib(mem["activation_bytes_checkpointed"]))
    row("total (as configured)", _gib(mem["total_bytes"]), note=f"of {_gib(mem['capacity_bytes'])}")
    verdict = (
        "fits"
        if mem["fits"]
        else (
            "does NOT fit"
            + (
                "; fits with activation checkpointing"
                if mem["fits_with_checkpointing"] and not mem["activation_checkpointing"]
                else ""
            )
        )
    )
    row("verdict", verdict)
    out.append(f"  assumes: {mem['assumptions']}")
    out.append("storage")
    row("data tokens", _si(st["data_tokens"]), note=st["data_tokens_basis"])
    row("raw text", _gib(st["raw_text_bytes"]), note=f"{st['raw_bytes_per_token']:g} B/token")
    row("token shards", _gib(st["token_shard_bytes"]), note=f"{st['token_dtype_bytes']} B/token")
    row(
        f"checkpoints (keep_last {st['keep_last']})",
        _gib(st["checkpoints_bytes"]),
        note=f"{_gib(st['checkpoint_bytes'])} each (fp32 weights + AdamW moments)",
    )
    mix = plan["mixture"]
    if mix["status"] != "planned":
        out.append(mix["line"])
    else:
        out.append(
            "mixture" + " " * 28 + "".join(f"{h:>14}" for h in ("ratio", "pool", "exposure", "epochs", "effective"))
        )
        for d, r in mix["domains"].items():
            out.append(
                f"  {d:<33}"
                + "".join(
                    f"{v:>14}"
                    for v in (
                        f"{r['target_ratio']:.3f}",
                        _si(r["pool_tokens"]),
                        _si(r["exposure_tokens"]),
                        f"{r['epochs']:.2f}",
                        _si(r["effective_tokens"]),
                    )
                )
            )
    for w in plan["warnings"]:
        out.append(f"warning: {w}")
    return "\n".join(out)
