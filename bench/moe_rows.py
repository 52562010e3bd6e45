"""gpu_bench.py's mixture-of-experts rows (`--part moe`): OLMoE training throughput per MoE path.

Owns the MoE variants, measured on the `--experiment`'s model (experiments/olmoe-1b-7b.yaml on a
GPU; `--cpu-tiny`: experiments/cpu-tiny-moe.yaml's model on the CPU) with the trainer's own parts:
runner.training.model's builder (the runner's MoE layer, or transformers' experts for the
reference row), the router probe with its losses (armed every micro step, committed every step,
as `runner launch` does), the plain fp32 loss sum, fused AdamW, bf16 autocast on a GPU. Rows, in
the order measured (the budget cuts from the end):
  1. the runner's layer, regional compile, selective checkpointing, micro batch 4 (the expected best)
  2. transformers' experts (grouped_mm + autocast_experts), eager, full checkpointing, mb 4: the
     path measured at 13.0% active MFU before (bench/measurements/h200-20261204/olmoe.json)
  3. the runner's layer, eager, full checkpointing, mb 4
  4. the runner's layer, regional compile, full checkpointing, mb 4
  5. the runner's layer, regional compile, no checkpointing, the largest micro batch that fits:
     twice what the memory plan fits on this device (at most 8), halved on an out-of-memory
  6. the runner's layer, regional compile, selective checkpointing, mb 8
  7. the runner's layer, regional compile, full checkpointing, mb 8
MFU counts active parameters (runner.planning.flops.convention_for: 6N_active + attention).
Every row is time-boxed (compilation included) by gpu_bench.time_box; a failure is a row. On a CPU
(`--cpu-tiny`) the compiled rows use the aot_eager backend (no C++ toolchain needed): the same
fullgraph trace, no inductor kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ONE_PROCESS = type("Acc", (), {"num_processes": 1})()


@dataclass
class MoeVariant:
    name: str
    micro_batch: int  # 0: the largest that fits (row 5: from twice the plan's, halved on OOM)
    layer: str = "runner"  # runner | transformers (the experts path)
    compile: str = "none"  # none | regional
    checkpointing: str = "full"  # none | full | selective
    budget_factor: float = 1.0


def moe_variants() -> list[MoeVariant]:
    regional = 3.0  # compile's time box: one decoder layer's forward and backward graphs
    return [
        MoeVariant(
            "moe runner regional selective mb4",
            4,
            compile="regional",
            checkpointing="selective",
            budget_factor=regional,
        ),
        MoeVariant("moe transformers experts eager full mb4", 4, layer="transformers"),
        MoeVariant("moe runner eager full mb4", 4),
        MoeVariant("moe runner regional full mb4", 4, compile="regional", budget_factor=regional),
        MoeVariant(
            "moe runner regional none mb(plan)", 0, compile="regional", checkpointing="none", budget_factor=regional
        ),
        MoeVariant(
            "moe runner regional selective mb8",
            8,
            compile="regional",
            checkpointing="selective",
            budget_factor=regional,
        ),
        MoeVariant("moe runner regional full mb8", 8, compile="regional", budget_factor=regional),
    ]


def moe_config(experiment: Path, tiny: bool):
    """The resolved experiment whose model the rows train (cpu-tiny-moe's with --cpu-tiny)."""
    from runner.config.load import load_experiment

    root = Path(__file__).resolve().parents[1]
    path = root / "experiments" / "cpu-tiny-moe.yaml" if tiny else experiment
    return load_experiment(path, check_files=False).config


def _with(cfg, v: MoeVariant, micro_batch: int, device: torch.device):
    from runner.planning.measured_memory import moe_row_config

    return moe_row_config(cfg, micro_batch, v.compile, v.checkpointing, gpu=device.type == "cuda")


def planned_micro_batch(cfg, device: torch.device) -> int:
    """The largest micro batch the memory plan fits on this device without checkpointing (auto policy)."""
    from runner.planning.memory import choose_micro_batch

    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    none = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, activation_checkpointing="none"))
    try:
        return choose_micro_batch(none, 1, memory)[0]
    except Exception:  # nothing fits in the plan: try one sequence
        return 1


def build(cfg, v: MoeVariant, device: torch.device, tiny: bool):
    """The model as the trainer builds it for these settings, its probe, on `device`."""
    from runner.training import experts
    from runner.training.model import _build_olmoe, build_model, enable_activation_checkpointing, maybe_compile

    with device:
        if v.layer == "transformers":
            model = _build_olmoe(cfg, cfg.model.attn_implementation, "eager" if device.type == "cpu" else "grouped_mm")
            if v.checkpointing != "none":
                enable_activation_checkpointing(model, v.checkpointing)
        else:
            model = build_model(cfg)
    probe = experts.attach(model, cfg, ["web"])
    maybe_compile(model, cfg, backend="aot_eager" if tiny else "inductor")
    return model.train(), probe


def train_step(model, probe, optimizer, batch, device: torch.device, autocast: bool) -> None:
    """One optimizer step of one micro batch, as the trainer takes it: the loss sum over the
    targets / their count plus the probe's router losses, backward, AdamW, the probe's commit."""
    from runner.training.loss import plain_loss_sum

    input_ids, targets, mask = batch
    probe.arm(np.zeros(input_ids.shape[0], dtype=np.int64), device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = plain_loss_sum(model(input_ids=input_ids).logits, targets, mask) / mask.numel()
    (loss + probe.disarm()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    probe.commit(ONE_PROCESS)


def run_moe_variant(
    v: MoeVariant,
    cfg,
    device: torch.device,
    *,
    deadline: float,
    warmup: int,
    steps: int,
    peak_tflops: float | None,
    ceiling_tflops: float | None,
    tiny: bool,
    bench: Any,
) -> Any:
    """One row (gpu_bench.Row) inside [now, deadline]; every failure is a row, never an exception."""
    from runner.planning.flops import convention_for, flops_per_token
    from runner.planning.measured_memory import planned_moe_row_bytes

    # Row 5: the plan is conservative on a GPU (it counts autocast's weight copies as kept), so it
    # starts at twice the plan's micro batch and halves on an out-of-memory, within the row's box.
    micro = v.micro_batch or min(8, 2 * planned_micro_batch(cfg, device))
    gpu = device.type == "cuda"
    row = bench.Row(
        v.name.replace("mb(plan)", f"mb{micro}"),
        micro,
        cfg.model.attn_implementation,
        v.compile,
        gpu,
        gpu,
        shape="main",
    )
    row.extra = {"moe_layer": v.layer, "activation_checkpointing": v.checkpointing}
    model = probe = optimizer = batch = None
    stage = ["build"]
    for attempt in range(4):  # row 5: halve the micro batch on an out-of-memory, three times at most
        run_cfg = _with(cfg, v, micro, device)
        fpt = flops_per_token(run_cfg, convention_for(run_cfg))
        row.extra["flops_per_token"] = fpt
        with contextlib.suppress(Exception):  # one micro batch per step: no gradient held at the backward
            row.planned_memory_gib = planned_moe_row_bytes(run_cfg) / 2**30
        try:
            with bench.time_box(deadline + max(1.0, 0.1 * (deadline - time.perf_counter()))):
                if gpu:
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                stage[0] = "build"
                model, probe = build(run_cfg, v, device, tiny)
                optimizer = torch.optim.AdamW(
                    model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=gpu
                )
                gen = torch.Generator(device="cpu").manual_seed(0)
                size, vocab = (micro, run_cfg.train.seq_len), model.config.vocab_size
                batch = (
                    torch.randint(0, vocab, size, generator=gen).to(device),
                    torch.randint(0, vocab, size, generator=gen).to(device),
                    torch.ones(size, dtype=torch.bool, device=device),
                )
                stage[0] = "warm-up (compile)"
                for _ in range(warmup):
                    train_step(model, probe, optimizer, batch, device, gpu)
                bench._sync(device)
                row.build_seconds = time.perf_counter() - t0
                stage[0] = "timed steps"
                t_start, done = time.perf_counter(), 0
                while done < steps and (done == 0 or time.perf_counter() < deadline):
                    train_step(model, probe, optimizer, batch, device, gpu)
                    done += 1
                bench._sync(device)
                elapsed = time.perf_counter() - t_start
                row.steps_timed, row.step_seconds = done, elapsed / done
                row.tokens_per_second = done * micro * run_cfg.train.seq_len / elapsed
            row.status, row.detail = "ok", ""
            row.model_tflops = fpt * row.tokens_per_second / 1e12
            row.mfu = row.model_tflops / peak_tflops if peak_tflops else None
            row.fraction_of_matmul = row.model_tflops / ceiling_tflops if ceiling_tflops else None
            if gpu:
                row.peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2**30
            break
        except bench.VariantTimeout as exc:
            row.status, row.detail = "timeout", f"{stage[0]} passed the variant's time box ({exc})"
            break
        except torch.OutOfMemoryError as exc:
            row.status, row.detail = "oom", str(exc).strip().splitlines()[0][:200]
            if v.micro_batch or micro == 1 or attempt == 3:
                break
            micro //= 2  # row 5 only: the plan's micro batch did not fit; try half
            row.variant, row.micro_batch = v.name.replace("mb(plan)", f"mb{micro}"), micro
        except Exception as exc:  # a kernel or compile failure is a finding about this variant
            text = str(exc).strip()
            row.status, row.detail = "error", f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
            break
        finally:
            model = probe = optimizer = batch = None
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
            if v.compile != "none":
                with contextlib.suppress(Exception):
                    torch._dynamo.reset()
    return row


def run_moe(args, bench: Any) -> dict[str, Any]:
    """`gpu_bench.py --part moe`: a short matmul ceiling, then the MoE rows within --budget-s."""
    from dataclasses import asdict

    t_begin = time.perf_counter()
    deadline_all = t_begin + args.budget_s
    out = Path(args.out)
    tiny = args.cpu_tiny or not torch.cuda.is_available()
    device = torch.device("cpu" if tiny else "cuda")
    facts = bench.device_facts() if device.type == "cuda" else {**bench.device_facts(), "accelerator": "cpu"}
    if device.type == "cuda":
        peak, peak_source = bench.datasheet_peak(facts["device_name"], facts.get("arch"))
    else:
        peak, peak_source = None, "a CPU has no datasheet peak: MFU not computed, see fraction_of_matmul"
    mm = bench.matmul_ceiling(device, 256 if tiny else args.matmul_size, min(args.matmul_s, 3.0))
    mm["fraction_of_peak"] = mm["best_tflops"] / peak if peak else None
    cfg = moe_config(Path(args.experiment), tiny)
    from runner.planning.flops import convention_for, flops_per_token, params_of_config

    counts = params_of_config(cfg)
    result = {
        "format": "runner-gpu-bench/3",
        "date": bench.dt.datetime.now(bench.dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "cpu-tiny" if tiny else "gpu",
        "part": "moe",
        "complete": False,
        "device": facts,
        "peak_tflops": peak,
        "peak_dtype": "bf16",
        "peak_source": peak_source,
        "matmul": mm,
        "model_source": f"{'experiments/cpu-tiny-moe.yaml' if tiny else args.experiment} (runner.config)",
        "model_shape": {
            "n_layers": cfg.model.n_layers,
            "hidden_size": cfg.model.hidden_size,
            "n_experts": cfg.model.moe.n_experts,
            "experts_per_token": cfg.model.moe.experts_per_token,
            "seq_len": cfg.train.seq_len,
        },
        "params_active": counts.get("active"),
        "flops_per_token": flops_per_token(cfg, convention_for(cfg)),
        "flops_formula": "6N+attn over active parameters (runner.planning.flops.MOE_CONVENTION), "
        "attention_causal_half=false, recompute_counted=false",
        "smoke_source": "-",
        "smoke_micro_batch": None,
        "best_main_variant": None,
        "warmup_steps": 1 if tiny else args.warmup_steps,
        "timed_steps": args.steps if args.steps is not None else (2 if tiny else 5),
        "budget_seconds": args.budget_s,
        "elapsed_seconds": 0.0,
        "rows": [],
    }
    bench.write_result(out, result)
    for v in moe_variants():
        remaining = deadline_all - time.perf_counter()
        box = args.variant_s * v.budget_factor
        if remaining < min(box, 20.0) * 0.5:
            row = bench.Row(
                v.name,
                v.micro_batch,
                cfg.model.attn_implementation,
                v.compile,
                not tiny,
                not tiny,
                status="skipped",
                detail=f"global budget: {max(remaining, 0):.0f} s left",
            )
        else:
            row = run_moe_variant(
                v,
                cfg,
                device,
                deadline=time.perf_counter() + min(box, remaining),
                warmup=result["warmup_steps"],
                steps=result["timed_steps"],
                peak_tflops=peak,
                ceiling_tflops=mm["best_tflops"],
                tiny=tiny,
                bench=bench,
            )
            print(
                f"  {row.variant}: {row.status} {bench._fmt(row.tokens_per_second, ',.0f')} tok/s "
                f"{bench._fmt(row.mfu, '.1%')} {row.detail[:100]}",
                flush=True,
            )
        result["rows"].append(asdict(row))
        result["elapsed_seconds"] = time.perf_counter() - t_begin
        bench.write_result(out, result)
    ok = [r for r in result["rows"] if r["status"] == "ok" and r["tokens_per_second"]]
    best = max(ok, key=lambda r: r["tokens_per_second"], default=None)
    result.update(best_main_variant=best["variant"] if best else None, complete=True)
    result["elapsed_seconds"] = time.perf_counter() - t_begin
    bench.write_result(out, result)
    return result
