"""The memory plan against what autograd really saves (issue 13.11), and the automatic micro batch.

The probe (runner.training.memprobe) sums the distinct storages that saved-tensor hooks see during
the trainer's own forward. The plan's `saved_activation_bytes` must be within PLAN_TOLERANCE of it
for two tiny Llama shapes, in fp32 (CPU runs) and under bf16 autocast (GPU runs, run here on the
CPU's autocast), plain and chunked loss, with and without activation checkpointing."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from trainfixtures import launch, make_project

from runner.config.schema import ExperimentSchema
from runner.config.section import from_plain
from runner.errors import RunnerError
from runner.planning.memory import GIB, choose_micro_batch, memory_per_device, saved_activation_bytes
from runner.training.memprobe import probe_training_forward
from runner.training.model import build_model

PLAN_TOLERANCE = 0.01  # measured: exact to the byte but for the 4-byte loss scalar (docs/BENCHMARKS.md)
SHAPES = {
    "gqa-tied": dict(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=176, tie_embeddings=True),
    "mha-untied": dict(
        hidden_size=96, n_layers=3, n_heads=6, n_kv_heads=6, intermediate_size=256, tie_embeddings=False
    ),
}


def _cfg(shape, *, vocab, seq_len, micro, bf16, **model) -> dict:
    """A resolved experiment as plain data (the planner takes it so, or typed), schema defaults under it."""
    return {
        "model": {**SHAPES[shape], **model},
        "tokenizer": {"vocab_size": vocab, "eos_id": 0},
        "train": {"seq_len": seq_len, "micro_batch_sequences": micro, "global_batch_sequences": micro},
        "hardware": {"accelerator": "cuda" if bf16 else "cpu", "precision": "bf16" if bf16 else "fp32"},
    }


@pytest.mark.parametrize(
    "shape,bf16,loss,checkpointing",
    list(itertools.product(SHAPES, [False, True], ["plain", "chunked"], [False, True])),
)
def test_plan_is_within_tolerance_of_the_saved_tensor_probe(shape, bf16, loss, checkpointing):
    vocab, seq_len, micro = 1000, 64, 3
    cfg = _cfg(
        shape,
        vocab=vocab,
        seq_len=seq_len,
        micro=micro,
        bf16=bf16,
        cross_entropy=loss,
        activation_checkpointing=checkpointing,
    )
    torch.manual_seed(0)
    model = build_model(from_plain(ExperimentSchema, {**cfg, "hardware": {"accelerator": "cpu"}}))  # on this CPU
    x, y = torch.randint(0, vocab, (micro, seq_len)), torch.randint(0, vocab, (micro, seq_len))
    probe = probe_training_forward(
        model, x, y, torch.ones(micro, seq_len, dtype=torch.bool), autocast_dtype=torch.bfloat16 if bf16 else None
    )
    planned = saved_activation_bytes(cfg)["total"]
    assert abs(planned / probe.activations - 1) <= PLAN_TOLERANCE, (planned, probe.activations)
    if bf16 and not checkpointing:  # autocast's weight copies: model state (2 B per parameter), not activations
        assert 0 < probe.weight_copies <= 2 * sum(p.numel() for p in model.parameters())


def test_the_plan_counts_the_fp32_residual_stream_the_old_formula_missed():
    cfg = _cfg("gqa-tied", vocab=1000, seq_len=64, micro=3, bf16=True)
    s, b, h, kv, f = 64, 3, 64, 32, 176
    old_layer = 2 * s * b * (6 * h + 2 * kv + 4 * f)  # everything in bf16, one norm input per block
    new_layer = saved_activation_bytes(cfg)["layers"] / 2
    assert new_layer > 1.5 * old_layer


def test_auto_micro_batch_is_the_largest_divisor_that_fits():
    cfg = _cfg("gqa-tied", vocab=1000, seq_len=64, micro=8, bf16=False)
    cfg["train"]["global_batch_sequences"] = 24  # per device 24: divisors <= 8 are 8, 6, 4, 3, 2, 1
    cfg["hardware"]["memory_gib"] = 141.0
    need = {m: memory_per_device(cfg, m)["total_bytes"] for m in (8, 6, 4)}
    cfg["hardware"]["memory_gib"] = (need[4] + need[6]) / 2 / 0.9 / GIB  # 6 does not fit, 4 does
    micro, why = choose_micro_batch(cfg, world=1)
    assert micro == 4 and "auto: micro batch 4 of <= 8" in why
    assert choose_micro_batch(cfg, world=1, device_bytes=10**15)[0] == 4  # the recipe's size is the ceiling
    cfg["hardware"]["memory_gib"] = 1000.0
    assert choose_micro_batch(cfg, world=1, device_bytes=int(need[6] / 0.9) + 1)[0] == 6  # a smaller real device
    assert choose_micro_batch(cfg, world=4)[0] == 6  # per device 6
    cfg["hardware"]["memory_gib"] = 1e-6
    with pytest.raises(RunnerError, match="even micro batch 1 plans") as err:
        choose_micro_batch(cfg, world=1)
    assert err.value.key == "train.micro_batch_sequences"


@pytest.mark.slow
def test_launch_with_auto_micro_batch_trains_what_the_fixed_choice_trains(tmp_path):
    probe = make_project(tmp_path / "probe", steps=4, global_batch=8, micro=4)
    from runner.config.load import load_experiment

    cfg = load_experiment(probe).to_container()
    need = {m: memory_per_device(cfg, m)["total_bytes"] for m in (4, 2)}
    memory_gib = (need[2] + need[4]) / 2 / 0.9 / GIB
    runs = {}
    for name, extra in (("auto", {"micro_batch_policy": "auto"}), ("fixed", {"micro_batch_sequences": 2})):
        exp = make_project(tmp_path / name, steps=4, global_batch=8, micro=4, train_extra=extra)
        hw = tmp_path / name / "recipes" / "hardware" / "cpu.yaml"
        hw.write_text(hw.read_text().replace("memory_gib: 4", f"memory_gib: {memory_gib}"))
        runs[name] = tmp_path / name / "runs" / "r"
        launch(tmp_path / name, exp, "--run-dir", runs[name], "--no-tracking")
    info = json.loads((runs["auto"] / "run.json").read_text())
    assert info["runtime"]["micro_batch_sequences"] == 2 and info["runtime"]["accumulation_steps"] == 4
    assert info["runtime"]["micro_batch_note"].startswith("auto: micro batch 2 of <= 4")
    assert info["conventions"]["micro_batch_sequences"] == 2
    weights = [(r / "checkpoints" / "step-0000004" / "model.safetensors").read_bytes() for r in runs.values()]
    assert weights[0] == weights[1]  # the same micro batches, so the same arithmetic
    ledger = json.loads((runs["auto"] / "ledger.json").read_text())["counters"]["total"]
    assert ledger["exposure"] == 4 * 8 * 16  # the global batch never changes
