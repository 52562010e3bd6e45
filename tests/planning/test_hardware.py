"""Peaks resolve from the recipe or the table, never from another device; MFU/cost arithmetic."""

from pathlib import Path

import pytest
import torch

from runner.config.load import load_recipe_file
from runner.config.schema import HardwareRecipe
from runner.errors import Problems, RunnerError
from runner.planning import hardware
from runner.planning.flops import DEFAULT_CONVENTION
from runner.planning.hardware import (
    PEAKS,
    Peak,
    canonical_device,
    check_device_matches,
    convention_record,
    cost_per_billion_useful_tokens,
    detect_device,
    measure_cpu_matmul_tflops,
    mfu,
    resolve_peak,
)


def hw(**kw):
    d = dict(
        accelerator="cuda",
        device_name="NVIDIA H200",
        peak_tflops=None,
        peak_dtype="bf16",
        peak_source=None,
        memory_gib=141,
        cpu_peak=None,
    )
    d.update(kw)
    return HardwareRecipe(**d)


def test_spec_peaks_table():
    assert {k: e.dense_bf16_tflops for k, e in PEAKS.items()} == {
        "A100": 312.0,
        "H100 SXM": 989.4,
        "H200 SXM": 989.4,
        "MI300X": 1307.4,
        "MI325X": 1307.4,
        "MI355X": 2516.6,
        "B200": 2250.0,
    }
    assert all(e.source for e in PEAKS.values())


@pytest.mark.parametrize(
    "name,key",
    [
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA L4", None),
        ("AMD Instinct MI300A", None),
    ],
)
def test_canonical_device_names(name, key):
    assert canonical_device(name) == key


def test_resolve_peak_from_table_and_from_recipe():
    p = resolve_peak(hw())
    assert (p.peak_tflops, p.peak_dtype, p.device_name) == (989.4, "bf16", "H200 SXM")
    assert "datasheet" in p.peak_source
    stated = resolve_peak(hw(device_name="NVIDIA L40S", peak_tflops=362.05, peak_source="L40S datasheet"))
    assert (stated.peak_tflops, stated.peak_source) == (362.05, "L40S datasheet")


def test_unknown_device_is_an_error_not_a_fallback():
    with pytest.raises(RunnerError, match="hardware.device_name: unknown device 'NVIDIA H100 PCIe'"):
        resolve_peak(hw(device_name="NVIDIA H100 PCIe"))
    with pytest.raises(RunnerError, match="hardware.peak_dtype"):
        resolve_peak(hw(peak_dtype="fp8"))
    with pytest.raises(RunnerError, match="hardware.peak_tflops"):
        resolve_peak(hw(accelerator="cpu", device_name="cpu"))


def test_cpu_peak_is_measured():
    p = resolve_peak(
        hw(accelerator="cpu", device_name="cpu", peak_dtype="fp32", cpu_peak="measured"), measure_seconds=0.05
    )
    assert p.peak_dtype == "fp32" and p.peak_source.startswith("measured: ")
    assert 1e-4 < p.peak_tflops < 100
    assert measure_cpu_matmul_tflops(seconds=0.02, size=64).peak_tflops > 0


def test_detect_device_simulated(monkeypatch):
    monkeypatch.setenv("RUNNER_SIMULATE_DEVICE", "rocm::gfx942")
    d = detect_device()
    assert (d.accelerator, d.canonical, d.simulated) == ("rocm", "MI300X", True)
    assert detect_device("cuda:NVIDIA H200").canonical == "H200 SXM"
    monkeypatch.delenv("RUNNER_SIMULATE_DEVICE")
    assert detect_device().accelerator in ("cpu", "cuda", "rocm")
    with pytest.raises(RunnerError):
        detect_device("tpu:v5")


def test_check_device_matches():
    check_device_matches(hw(), detect_device("cuda:NVIDIA H200"))
    with pytest.raises(RunnerError, match="hardware.device_name: recipe says 'NVIDIA H200'"):
        check_device_matches(hw(), detect_device("cuda:NVIDIA H100 80GB HBM3"))
    with pytest.raises(RunnerError, match="hardware.accelerator"):
        check_device_matches(hw(), detect_device("cpu"))
    with pytest.raises(RunnerError, match="hardware.device_name"):
        check_device_matches(hw(accelerator="rocm", device_name="AMD Instinct MI355X"), detect_device("rocm::gfx942"))
    check_device_matches(hw(accelerator="cpu", device_name="cpu"), detect_device("cpu"))


def test_mfu_and_cost_by_hand():
    # 1e6 tokens at 6e9 FLOPs/token in 10 s on 2 devices of 989.4 TFLOP/s
    assert mfu(6e9, 1e6, 10.0, 989.4, 2) == pytest.approx(6e15 / (10 * 989.4e12 * 2))
    # 8 devices at $2.50/h for 10 h, 1e9 useful tokens -> $200 per billion
    assert cost_per_billion_useful_tokens(8, 2.5, 36000, 1e9) == pytest.approx(200.0)
    with pytest.raises(RunnerError):
        mfu(1, 1, 0, 989.4, 1)


def test_convention_record_has_every_spec_field():
    rec = convention_record(DEFAULT_CONVENTION, Peak(989.4, "bf16", "x"), 8, "step")
    assert set(rec) == {
        "flops_formula",
        "params_counted",
        "attention_causal_half",
        "recompute_counted",
        "peak_tflops",
        "peak_dtype",
        "peak_source",
        "devices_counted",
        "time_basis",
    }


def test_a_sparse_peak_cannot_reach_the_denominator(tmp_path: Path):
    # No recipe key can mark a peak as sparse: the loader refuses one, and the table holds dense figures.
    recipe = tmp_path / "h200.yaml"
    recipe.write_text("name: h200\nversion: 1\ndescription: x\naccelerator: cuda\nsparse: true\n")
    problems = Problems()
    load_recipe_file(recipe, "hardware", problems)
    assert any("sparse: unknown key" in line for line in problems.lines)
    assert resolve_peak(hw()).peak_tflops == PEAKS["H200 SXM"].dense_bf16_tflops


def test_cpu_theoretical_peak_is_cores_x_clock_x_flops_per_cycle(monkeypatch):
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: {"fpu", "avx", "avx2", "fma"})
    monkeypatch.setattr(hardware, "_cpu_clock", lambda: (3.0, hardware.CLOCK_MAX))
    cpu = {"accelerator": "cpu", "device_name": "cpu", "peak_dtype": "fp32", "cpu_peak": "theoretical"}
    # hardware.threads: the cores the peak counts (null: torch's own count)
    default = resolve_peak(hw(**cpu, threads=None))
    assert default.peak_source.startswith(f"theoretical: {torch.get_num_threads()} cores x 3.000 GHz x 32")
    p = resolve_peak(hw(**cpu, threads=3))
    assert p.peak_tflops == pytest.approx(3 * 3.0e9 * 32 / 1e12)
    assert p.peak_source.startswith("theoretical: 3 cores x 3.000 GHz x 32")
    assert p.peak_source.endswith("; cpufreq maximum)")
    # The audit recomputes it from what the source records, whichever clock it names.
    assert hardware.theoretical_peak_from_source(p.peak_source)[0] == pytest.approx(p.peak_tflops)


#: how far above the clock a virtual machine reports (its nominal one) a core may run in turbo: server
#: parts boost at most ~1.5x their base clock (an EPYC 7B13: 2.45 GHz base, 3.5 GHz boost = 1.43x)
TURBO_HEADROOM = 1.6


def test_cpu_theoretical_peak_bounds_what_a_matmul_achieves():
    theoretical = hardware.cpu_theoretical_tflops()
    if not theoretical.peak_source.startswith("theoretical"):
        pytest.skip(f"no CPU description here: {theoretical.peak_source}")
    measured = measure_cpu_matmul_tflops(seconds=0.3).peak_tflops
    if theoretical.peak_source.endswith(f"; {hardware.CLOCK_MAX})"):
        assert measured <= theoretical.peak_tflops  # at the maximum clock: a true upper bound
    else:  # a reported (nominal) clock: turbo can beat it, by a bounded factor; the source says so
        assert theoretical.peak_source.endswith(f"; {hardware.CLOCK_REPORTED})")
        assert measured <= TURBO_HEADROOM * theoretical.peak_tflops
