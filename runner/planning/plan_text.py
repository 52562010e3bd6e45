"""`runner plan`'s human table: the plan dict (runner.planning.plan.build_plan) as aligned text.

Owns: the model, compute, time, memory, storage, checkpoint, export and mixture sections, and the
forecast's lines. Never: computes a figure; every number printed is in the dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner.planning.downstream_cost import format_lines as format_downstream_lines
from runner.planning.memory import GIB


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
            f"{name} {_duration(b['wall_hours'])}, {_amount(b['device_hours'])} device-h, ${_amount(b['cost_usd'], 2)}"
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


def _amount(x: float, decimals: int = 1) -> str:
    """Thousands-separated, or 3 significant digits past a trillion: --mfu 1e-300 printed 300-digit hours."""
    return f"{x:,.{decimals}f}" if abs(x) < 1e12 else f"{x:.3g}"


def _percent(x: float) -> str:
    """One decimal, or 3 significant digits under 0.1% (--mfu 1e-5 is not "0.0%")."""
    return f"{x:.1%}" if x == 0 or abs(x) >= 1e-3 else f"{x * 100:.3g}%"


def _duration(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:,.1f} min"
    return f"{_amount(hours)} h ({_amount(hours / 24)} d)"


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
            note=f"{layer['n_experts']} experts x {layer['expert']:,}, k = {layer['experts_per_token']}"
            + (f", shared {layer['shared']:,}" if layer.get("shared") else ""),
        )
        if p.get("dense_layer"):
            dense = p["dense_layer"]
            _row(out, "dense first layers (each)", f"{dense['total']:,}", note=f"{p['n_dense_layers']} x, all active")
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
    if c.get("inference_tokens"):
        _row(out, "tokens to serve", _si(c["inference_tokens"]), note="plan.inference_tokens")
        ratio = c["inference_flops"] / (c["flops_per_token"] * c["exposure_tokens"])
        _row(
            out,
            "FLOPs serving them",
            f"{c['inference_flops']:.3e}",
            note=f"{ratio:.3g} x training's; forward only: FLOPs per token / 3",
        )
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
    _row(out, "MFU", *(_percent(b["mfu"]) for _, b in cols))
    _row(out, "tokens/s (processed)", *(_si(b["tokens_per_second"]) for _, b in cols))
    _row(out, "pure training", *(_duration(b["pure_hours"]) for _, b in cols))
    seed_convention = _duration(t["assumed"]["pure_hours_6n_all"])
    _row(out, "  same at 6N, N = all params", seed_convention, note="(the seed-table convention)")
    _row(out, "overheads (fraction of pure)", *(f"{b['overhead_fraction']:.1%}" for _, b in cols))
    _row(out, "wall clock", *(_duration(b["wall_hours"]) for _, b in cols))
    _row(out, "device-hours", *(_amount(b["device_hours"]) for _, b in cols))
    costs = (_amount(b["cost_usd"], 0) if b["cost_usd"] >= 100 else f"{b['cost_usd']:.2f}" for _, b in cols)
    _row(out, "cost (USD)", *costs)
    basis = t["assumed"].get("mfu_basis", "assumed")
    out.append(f"  MFU {basis}: {t['assumed']['mfu_rule']} ({t['assumed']['mfu_source']})")
    if t["measured"] and plan.get("calibration"):
        cal = plan["calibration"]
        out.append(
            f"  measured MFU: the median step's tokens/s of {cal['run_dir']} ({cal['steps']} steps, the first left out "
            "as warm-up); its overheads: the run's wall clock, start-up left out, over its summed step time; "
            + (
                f"its start-up ({t['measured']['startup_seconds']:.1f} s, one attempt's) added once"
                if t["measured"].get("startup_seconds")
                else "no start-up recorded (a run before run.json's t_startup: its wall clock began at its first step)"
            )
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
    # compile's saving is measured for the configured mode only: the other modes' rows are eager counts,
    # said so (1p3b, compiled: selective 31.35 GiB beside none's compiled 29.14 read as selective costing more)
    compiled = mem.get("compile_saved_fraction")
    configured = mem.get("activation_checkpointing_mode")

    def scope(mode: str) -> str:
        if not compiled or compiled.get("fraction", 1.0) >= 1.0:
            return ""
        return "compiled (as configured)" if mode == configured else "eager count: compile not counted"

    _row(out, "activations (no checkpointing)", _gib(mem["activation_bytes_full"]), note=scope("none"))
    _row(out, f"  of which the loss's peak ({mem['cross_entropy']})", _gib(mem["head_transient_bytes"]))
    _row(out, "activations (checkpointing)", _gib(mem["activation_bytes_checkpointed"]), note=scope("full"))
    if "activation_bytes_selective" in mem:
        _row(out, "activations (selective ckpt)", _gib(mem["activation_bytes_selective"]), note=scope("selective"))
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
    if ck.get("pinned_host") is not None:
        _format_pinned_host(ck["pinned_host"], out)
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
        f"t_checkpoint (about {_amount(ck['count'], 0)} checkpoints)",
        _duration(ck["t_checkpoint_hours"]),
        note=f"{ck['fraction_of_pure']:.2%} of pure training; the overheads assume "
        f"{ck['assumed_fraction']:.1%} (plan.checkpoint_overhead_fraction)",
    )
    out.append(f"  checkpoint rates: {ck['source']}")


def _format_pinned_host(pin: Mapping[str, Any], out: list[str]) -> None:
    """Rank 0's pinned checkpoint buffers, held all run, and whether the stated host would pin them."""
    at_most = f"held all run; pinned when at most {pin['fraction']:.0%} of the host's available memory at the start"
    if pin["host_memory_bytes"] is None:
        note = f"{at_most}; host memory unknown (hardware.host_memory_gib)"
    elif pin["pinned"]:
        note = f"{at_most}: pinned on {_gib(pin['host_memory_bytes'])} (hardware.host_memory_gib)"
    else:
        note = f"{at_most}: NOT on {_gib(pin['host_memory_bytes'])} (hardware.host_memory_gib): pageable copies"
    _row(out, "pinned host buffers (rank 0)", _gib(pin["bytes"]), note=note)


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
