"""`runner smoke`'s kill+resume identity: bit-identical on a CPU, within the stated tolerance on a GPU
(the device type injected: the rule is chosen by the accelerator the runs trained on)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runner.runs.resume_identity import GPU_RELATIVE_TOLERANCE, compare_weights


@pytest.fixture()
def weights(tmp_path: Path):
    gen = torch.Generator().manual_seed(0)
    base = {"embed.weight": 0.02 * torch.randn(64, 16, generator=gen), "norm.weight": torch.ones(16)}

    def write(name: str, edit=None) -> Path:
        tensors = {k: v.clone() for k, v in base.items()}
        if edit is not None:
            edit(tensors)
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        return path

    return write


def _noise(scale: float):
    def edit(t):  # last-bit drift of a nondeterministic reduction, carried a few steps
        t["embed.weight"] += scale * torch.randn(t["embed.weight"].shape, generator=torch.Generator().manual_seed(1))

    return edit


def _missed_adamw_step(t):  # every weight moved by the learning rate: a step lost or taken twice
    t["embed.weight"] -= 3e-4 * torch.sign(t["embed.weight"])


@pytest.mark.parametrize("device", ["cpu", "cuda", "rocm"])
def test_the_same_weights_are_bit_identical_on_every_device(weights, device):
    same = compare_weights(weights("a"), weights("b"), device)
    assert same.ok and same.bit_identical and same.max_relative_difference == 0.0
    assert same.describe().startswith("bit-identical")


def test_gpu_noise_passes_on_a_gpu_and_fails_on_a_cpu(weights):
    a, b = weights("a"), weights("b", _noise(1e-7))
    on_cpu, on_gpu = compare_weights(a, b, "cpu"), compare_weights(a, b, "cuda")
    assert not on_cpu.ok and on_cpu.describe().endswith("(bit-identical required on cpu)")
    assert on_gpu.ok and 0 < on_gpu.max_relative_difference < GPU_RELATIVE_TOLERANCE
    assert on_gpu.worst_tensor == "embed.weight"
    text = on_gpu.describe()
    assert (
        text.startswith("within tolerance: max relative difference")
        and "allowed 1e-03 relative per tensor on cuda" in text
    )


def test_a_resume_bug_fails_on_a_gpu_too(weights):
    wrong = compare_weights(weights("a"), weights("b", _missed_adamw_step), "cuda")
    assert not wrong.ok and wrong.max_relative_difference > 5 * GPU_RELATIVE_TOLERANCE
    assert wrong.describe().startswith("DIFFERENT: max relative difference")


def test_a_missing_tensor_or_file_is_different(weights, tmp_path):
    fewer = compare_weights(weights("a"), weights("b", lambda t: t.pop("norm.weight")), "cuda")
    assert not fewer.ok and fewer.worst_tensor == "norm.weight"
    gone = compare_weights(weights("a"), tmp_path / "never-written.safetensors", "rocm")
    assert not gone.ok and "missing" in gone.worst_tensor
