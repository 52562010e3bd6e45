"""The memory plan at a GPU bench row's configuration, and the plan held against what a device measured.

Owns: the config of one row of bench/gpu_bench.py (and of its mixture-of-experts rows, `--part moe`:
the experiment's model with the row's compile scope, checkpointing mode and micro batch) (its shape, compile scope, kernels, loss,
micro batch; one micro batch per step, so no gradient is alive at the backward's peak), which the
bench itself plans with, and the comparison of the plan with `max_memory_allocated` of the rows and of
bench/memory_probe.py's forward+backward rows (no optimizer state there).
Never: runs a model, or reads anything but the JSON it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from runner.config.schema import ExperimentSchema
from runner.planning.memory import GIB, memory_per_device


def bench_row_config(shape: Mapping[str, Any], row: Mapping[str, Any], gpu: bool = True) -> dict[str, Any]:
    """The plain experiment config of a bench row (`variant` fields as gpu_bench.Row records them)."""
    compile_scope = str(row.get("compile") or "none")
    return {
        "tokenizer": {"vocab_size": shape["vocab_size"]},
        "model": {
            "arch": "llama",
            **{k: shape[k] for k in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size")},
            "tie_embeddings": shape["tie_embeddings"],
            "attn_implementation": str(row["attn"]).split("/")[0],
            "kernels": row["kernels"],
            "cross_entropy": row["cross_entropy"],
            "activation_checkpointing": False,
            "compile": compile_scope != "none",
            "compile_scope": compile_scope if compile_scope != "none" else "model",
        },
        "train": {"seq_len": shape["seq_len"], "micro_batch_sequences": row["micro_batch"]},
        "hardware": {
            "accelerator": "cuda" if gpu else "cpu",
            "precision": "bf16" if row.get("autocast_bf16", True) and gpu else "fp32",
            "memory_gib": 0,
        },
    }


def planned_row_bytes(shape: Mapping[str, Any], row: Mapping[str, Any], gpu: bool = True) -> float:
    """The plan's peak for a bench row: one optimizer step per micro batch (the bench's train_step)."""
    return memory_per_device(bench_row_config(shape, row, gpu), grads_held=False)["total_bytes"]


def planned_probe_bytes(cfg: Mapping[str, Any], micro_batch: int) -> float:
    """The plan's forward+backward peak for bench/memory_probe.py's row: eager (the probe's saved-tensor
    hooks see no compiled graph), no gradient yet, no AdamW moments (no optimizer step is taken)."""
    plain = {**cfg, "model": {**cfg["model"], "compile": False, "compile_scope": "model"}}
    mem = memory_per_device(plain, micro_batch, grads_held=False)
    return mem["backward_peak_bytes"] - mem["model_state_bytes"]["adamw moments (2 x fp32)"]


def _measured_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows that ran and measured a peak."""
    return [r for r in rows if r.get("status") == "ok" and r.get("peak_memory_gib") is not None]


def _beside(row: Mapping[str, Any], planned_gib: float) -> dict[str, Any]:
    """One measured row beside its plan: the variant, both figures in GiB and the plan's relative error."""
    measured = float(row["peak_memory_gib"])
    return {
        "variant": row["variant"],
        "planned_gib": planned_gib,
        "measured_gib": measured,
        "error": planned_gib / measured - 1,
    }


def compare_bench(bench: Mapping[str, Any], extra_rows: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """Each measured row of a gpu_bench result (and rows run alone at its shapes) beside its plan."""
    shapes = {"main": bench["model_shape"], "smoke": bench.get("smoke_shape")}
    out = []
    for row in _measured_rows([*bench["rows"], *extra_rows]):
        planned = planned_row_bytes(shapes[row.get("shape", "main")], row) / GIB
        out.append(_beside(row, planned))
    return out


def moe_row_config(
    cfg: ExperimentSchema, micro_batch: int, compile_scope: str, checkpointing: str, gpu: bool = True
) -> ExperimentSchema:
    """The experiment as a `gpu_bench.py --part moe` row trains it (bench/moe_rows.py): its model with the
    row's compile scope ("none" or "regional"), checkpointing mode and micro batch, on the GPU or the CPU."""
    model = dataclasses.replace(
        cfg.model,
        activation_checkpointing=checkpointing,
        compile=compile_scope != "none",
        compile_scope="regional" if compile_scope == "regional" else "model",
    )
    hardware = dataclasses.replace(cfg.hardware, accelerator="cuda" if gpu else "cpu")
    train = dataclasses.replace(cfg.train, micro_batch_sequences=micro_batch)
    return dataclasses.replace(cfg, model=model, hardware=hardware, train=train)


def planned_moe_row_bytes(run_cfg: ExperimentSchema) -> float:
    """The plan's peak for a MoE bench row: one optimizer step per micro batch (moe_rows.train_step),
    so no gradient is alive at the backward's peak, whatever the recipe's global batch."""
    return memory_per_device(run_cfg, grads_held=False)["total_bytes"]


def compare_moe_bench(bench: Mapping[str, Any], cfg: ExperimentSchema) -> list[dict[str, Any]]:
    """Each measured row of a `gpu_bench.py --part moe` result beside its plan (`cfg`: the experiment
    the bench names in model_source, resolved)."""
    out = []
    for row in _measured_rows(bench["rows"]):
        mode = str(row.get("extra", {}).get("activation_checkpointing", "full"))
        run_cfg = moe_row_config(cfg, int(row["micro_batch"]), str(row.get("compile") or "none"), mode)
        planned = planned_moe_row_bytes(run_cfg) / GIB
        out.append(_beside(row, planned))
    return out
