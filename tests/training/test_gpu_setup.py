"""The GPU tests' setup, run on the CPU: every config, batch, model and test body of
tests/training/test_gpu.py (and the pinned checkpoint test) comes from tests/gpufixtures.py, and this
file runs that code here, so a setup error is caught in CI (the H200's first `pytest -m gpu` failed two
tests in their setup: a config without `name` the planner could not read)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from gpufixtures import (
    batch,
    checkpoint_copy_scenario,
    loss_grads,
    plan_and_probe,
    regional_model,
    tiny_cfg,
    tiny_model,
)

from runner.planning.memory import memory_per_device, saved_activation_bytes

CPU = torch.device("cpu")
GPU_TESTS = Path(__file__).parent / "test_gpu.py"


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"cross_entropy": "chunked"},
        {"cross_entropy": "plain"},
        {"kernels": "liger", "cross_entropy": "liger"},
        {"compile": True, "compile_scope": "regional"},
    ],
)
def test_every_gpu_test_config_is_read_by_the_planner(model):
    cfg = tiny_cfg("cuda", **model)
    assert cfg.name and cfg.hardware.precision == "bf16"
    assert saved_activation_bytes(cfg)["total"] > 0 and memory_per_device(cfg)["total_bytes"] > 0


def test_the_gpu_tests_model_batch_and_step_run_on_the_cpu_under_bf16_autocast():
    small = batch(CPU, b=1, s=64)  # the GPU tests' code at a CPU's size
    loss, grads = loss_grads(tiny_model(CPU, "cuda"), small, torch.bfloat16)
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads.values())
    chunked = loss_grads(tiny_model(CPU, "cuda", cross_entropy="chunked"), small, torch.bfloat16)
    torch.testing.assert_close(chunked[0], loss, rtol=2e-2, atol=0)


def test_the_regional_compile_setup_compiles_each_layer():
    calls = []

    def backend(gm, inputs):
        calls.append(gm)
        return gm.forward

    model = regional_model(CPU, "cuda", backend=backend)
    loss, _ = loss_grads(model, batch(CPU, b=1, s=64), None)
    assert torch.isfinite(loss) and calls  # the layers went through the compiler
    torch._dynamo.reset()


def test_the_memory_plan_test_body_runs_and_is_exact_on_the_cpu():
    # the GPU test's body for its chunked case (its plain case differs by the loss's name only)
    planned, probe = plan_and_probe(CPU, "chunked", "cpu", None)
    # fp32 on a CPU: exact but for a scalar or two (the GPU test allows 5% under autocast)
    assert abs(planned - probe.activations) <= 16, (planned, probe.activations)


def test_the_pinned_buffers_choice_runs_on_the_cpu_for_a_gpu_device():
    # the GPU test's body where no device is touched: a GPU whose host cannot spare the buffers
    out = checkpoint_copy_scenario(CPU, torch.device("cuda"), available_bytes=1000)
    assert out["need"] > 0 and out["staging"] is None and out["copy"].refused
    assert out["copy"].note.startswith("pageable: pinned buffers for")


def test_the_gpu_tests_build_nothing_themselves():
    """test_gpu.py takes its configs and models from gpufixtures only (what this file runs)."""
    tree = ast.parse(GPU_TESTS.read_text())
    names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"ExperimentSchema", "OmegaConf", "build_model", "maybe_compile", "from_plain"}, names
    assert "gpufixtures" in {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
