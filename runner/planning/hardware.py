"""Device peaks, device identity, and the MFU / cost arithmetic of the SPEC.

Owns: the table of dense BF16 peaks (with sources), resolving the peak a run divides by,
detecting which device this process runs on (or simulating one for tests), refusing a recipe
that names a different device, and the `mfu` / `goodput_mfu` / cost formulas.
Never: falls back to another device's peak, divides by a sparse peak, or guesses an unknown
device. An unknown device without a stated peak is a RunnerError.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from runner.config.schema import HardwareRecipe
from runner.errors import RunnerError
from runner.planning.flops import Convention

SIMULATE_ENV = "RUNNER_SIMULATE_DEVICE"


@dataclass(frozen=True)
class PeakEntry:
    device: str
    dense_bf16_tflops: float
    source: str


# Dense BF16 tensor peaks of one device (SPEC). Sparse ("with sparsity") figures are twice these.
PEAKS: dict[str, PeakEntry] = {
    e.device: e
    for e in (
        PeakEntry("A100", 312.0, "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense (624 sparse)"),
        PeakEntry("H100 SXM", 989.4, "NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS sparse / 2"),
        PeakEntry("H200 SXM", 989.4, "NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS sparse / 2"),
        PeakEntry("MI300X", 1307.4, "AMD Instinct MI300X datasheet: BF16 1307.4 TFLOPS dense"),
        PeakEntry("MI325X", 1307.4, "AMD Instinct MI325X datasheet: BF16 1307.4 TFLOPS dense"),
        PeakEntry("MI355X", 2516.6, "AMD Instinct MI355X datasheet: BF16 2516.6 TFLOPS dense"),
        PeakEntry("B200", 2250.0, "NVIDIA HGX B200 datasheet: BF16 4.5 PFLOPS sparse / 2, per GPU"),
    )
}

# ROCm architecture names used only when the device name does not identify the part. gfx942 is
# also MI325X (same peak) and MI300A (a different one, whose name says so and is matched first).
ROCM_ARCH = {"gfx942": "MI300X", "gfx950": "MI355X"}


def canonical_device(name: str | None) -> str | None:
    """The PEAKS key a device name denotes, or None. Variants with other peaks (PCIe, NVL) are None."""
    if not name:
        return None
    n = re.sub(r"[\s_\-]+", " ", str(name).upper()).strip()
    # H100/H200 PCIe and NVL parts have lower peaks; they must not borrow the SXM figure.
    if re.search(r"\b(H100|H200)\b", n) and re.search(r"PCIE|NVL", n):
        return None
    for key, pattern in (
        ("A100", r"\bA100\b"),
        ("H100 SXM", r"\bH100\b"),
        ("H200 SXM", r"\bH200\b"),
        ("MI300X", r"\bMI300X\b"),
        ("MI325X", r"\bMI325X\b"),
        ("MI355X", r"\bMI355X\b"),
        ("B200", r"\bB200\b"),
    ):
        if re.search(pattern, n):
            return key
    return None


@dataclass(frozen=True)
class Peak:
    """The denominator of MFU: dense peak of one device for the compute dtype, and its source."""

    peak_tflops: float
    peak_dtype: str
    peak_source: str
    device_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_peak(hw: HardwareRecipe, *, measure_seconds: float = 1.0) -> Peak:
    """The recipe's stated peak if any; else a measured CPU peak if asked; else the table by device name."""
    if hw.peak_tflops is not None:
        stated = hw.peak_tflops
        if isinstance(stated, bool) or not isinstance(stated, (int, float)) or stated <= 0:
            raise RunnerError(f"must be a positive number, got {stated!r}", key="hardware.peak_tflops")
        source = hw.peak_source or "stated in the hardware recipe (no source given)"
        return Peak(float(stated), hw.peak_dtype, source, hw.device_name)
    if hw.accelerator == "cpu":
        if hw.cpu_peak == "theoretical":  # the cores the recipe's threads compute on (null: torch's count)
            return cpu_theoretical_tflops(hw.threads, measure_seconds=measure_seconds)
        if hw.cpu_peak == "measured":
            return measure_cpu_matmul_tflops(seconds=measure_seconds)
        raise RunnerError(
            "a CPU has no datasheet peak: state hardware.peak_tflops or set hardware.cpu_peak: theoretical | measured",
            key="hardware.peak_tflops",
        )
    key = canonical_device(hw.device_name)
    if key is None:
        raise RunnerError(
            f"unknown device {hw.device_name!r} and no hardware.peak_tflops stated (known: {', '.join(PEAKS)})",
            key="hardware.device_name",
        )
    if hw.peak_dtype != "bf16":
        raise RunnerError(
            f"the peak table holds dense bf16 figures; for {hw.peak_dtype!r} state hardware.peak_tflops",
            key="hardware.peak_dtype",
        )
    entry = PEAKS[key]
    return Peak(entry.dense_bf16_tflops, "bf16", entry.source, key)


@dataclass(frozen=True)
class DeviceIdentity:
    accelerator: str  # cpu | cuda | rocm
    name: str | None  # torch's device name
    arch: str | None = None  # ROCm gcnArchName (e.g. gfx942)
    simulated: bool = False

    @property
    def canonical(self) -> str | None:
        key = canonical_device(self.name)
        if key is None and self.arch:
            key = ROCM_ARCH.get(self.arch.split(":")[0])
        return key

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["canonical"] = self.canonical
        return d


def parse_simulated(spec: str) -> DeviceIdentity:
    """`accelerator[:name[:arch]]`, e.g. `cuda:NVIDIA H200`, `rocm::gfx942`, `cpu`."""
    parts = spec.split(":")
    accel = parts[0].strip().lower()
    if accel not in ("cpu", "cuda", "rocm"):
        raise RunnerError(f"{SIMULATE_ENV} must look like 'cuda:NVIDIA H200', 'rocm::gfx942' or 'cpu', got {spec!r}")
    name = parts[1].strip() if len(parts) > 1 and parts[1].strip() else None
    arch = parts[2].strip() if len(parts) > 2 and parts[2].strip() else None
    return DeviceIdentity(accel, name if accel != "cpu" else (name or "cpu"), arch, simulated=True)


def detect_device(simulate: str | None = None) -> DeviceIdentity:
    """The device this process would train on; `simulate` or $RUNNER_SIMULATE_DEVICE overrides it."""
    spec = simulate if simulate is not None else os.environ.get(SIMULATE_ENV)
    if spec:
        return parse_simulated(spec)
    import torch  # noqa: PLC0415  (torch: kept off the loader's and the planner's start-up)

    if not torch.cuda.is_available():
        return DeviceIdentity("cpu", "cpu")
    props = torch.cuda.get_device_properties(0)
    if getattr(torch.version, "hip", None):
        return DeviceIdentity("rocm", props.name, getattr(props, "gcnArchName", None))
    return DeviceIdentity("cuda", props.name)


def check_device_matches(hw: HardwareRecipe, detected: DeviceIdentity) -> None:
    """Refuse to run a recipe written for one device on another (its peak and memory would lie)."""
    if hw.accelerator != detected.accelerator:
        raise RunnerError(
            f"recipe says {hw.accelerator} ({hw.device_name}), this process runs on "
            f"{detected.accelerator} ({detected.name})",
            key="hardware.accelerator",
        )
    if detected.accelerator == "cpu":
        return
    want = hw.device_name
    want_key = canonical_device(want)
    if want_key is not None:
        if detected.canonical != want_key:
            raise RunnerError(
                f"recipe says {want!r} ({want_key}), detected {detected.name!r}"
                f"{' (' + detected.arch + ')' if detected.arch else ''}",
                key="hardware.device_name",
            )
    elif (detected.name or "").strip().lower() != want.strip().lower():
        raise RunnerError(f"recipe says {want!r}, detected {detected.name!r}", key="hardware.device_name")


def measure_cpu_matmul_tflops(seconds: float = 1.0, size: int = 1024) -> Peak:
    """A measured fp32 matmul rate of this CPU: the best of repeated timed `torch.mm` bursts."""
    import torch  # noqa: PLC0415  (torch: kept off the loader's and the planner's start-up)

    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    torch.mm(a, b)  # first call pays for thread-pool start-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    reps = 4
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2 * size**3 * reps / dt / 1e12)
        if time.perf_counter() >= deadline:
            break
    source = f"measured: torch.mm fp32 {size}x{size}, {torch.get_num_threads()} threads, best burst over {seconds:g} s"
    return Peak(best, "fp32", source, "cpu")


#: fp32 FLOPs per cycle per core: vector lanes x 2 (FMA) x FMA pipes, by the widest ISA the CPU reports
CPU_FP32_FLOPS_PER_CYCLE = (
    ("avx512f", 64, "AVX-512: 16 lanes x FMA x 2 pipes"),
    ("avx2", 32, "AVX2: 8 lanes x FMA x 2 pipes"),
    ("asimd", 16, "NEON: 4 lanes x FMA x 2 pipes"),
    ("avx", 16, "AVX: 8 lanes x (mul + add)"),
    ("sse2", 8, "SSE2: 4 lanes x (mul + add)"),
)


#: where a theoretical CPU peak's clock comes from: the maximum (turbo included) or the clock the
#: kernel reports now, which a virtual machine reports as its nominal clock (turbo may exceed it)
CLOCK_MAX, CLOCK_REPORTED = "cpufreq maximum", "reported clock: turbo may exceed it"


def _cpu_clock() -> tuple[float, str] | None:
    """(GHz, CLOCK_MAX | CLOCK_REPORTED): cpufreq's maximum when present, else /proc/cpuinfo's MHz."""
    try:
        return int(open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read()) / 1e6, CLOCK_MAX
    except (OSError, ValueError):
        pass
    try:
        mhz = [float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.lower().startswith("cpu mhz")]
    except (OSError, ValueError, IndexError):
        return None
    return (max(mhz) / 1e3, CLOCK_REPORTED) if mhz else None


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.lower().startswith(("flags", "features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_theoretical_tflops(threads: int | None = None, *, measure_seconds: float = 1.0) -> Peak:
    """Theoretical fp32 peak of the cores this process computes on: threads x clock x FLOPs/cycle.

    Stable where a measured matmul burst is not (a shared machine measured 12x apart), and an
    upper bound at cpufreq's maximum clock, so MFU stays below 100%. Where only the clock the kernel
    reports is known (a virtual machine: its nominal clock), turbo can run above it and the source
    says so ("reported clock: turbo may exceed it"); CI measured a matmul 6% above such a peak. Where the CPU does not describe itself (no /proc/cpuinfo,
    e.g. macOS), falls back to a measured burst and says so in the source."""
    import torch  # noqa: PLC0415  (torch: kept off the loader's and the planner's start-up)

    threads = threads or torch.get_num_threads()
    clock, flags = _cpu_clock(), _cpu_flags()
    for flag, per_cycle, why in CPU_FP32_FLOPS_PER_CYCLE:
        if flag in flags and clock:
            ghz, clock_source = clock
            tflops = threads * ghz * 1e9 * per_cycle / 1e12
            return Peak(
                tflops,
                "fp32",
                f"theoretical: {threads} cores x {ghz:.3f} GHz x {per_cycle} fp32 FLOP/cycle ({why}; {clock_source})",
                "cpu",
            )
    measured = measure_cpu_matmul_tflops(seconds=measure_seconds)
    return Peak(
        measured.peak_tflops, "fp32", measured.peak_source + " (no CPU description for a theoretical peak)", "cpu"
    )


_THEORETICAL_SOURCE = re.compile(
    r"^theoretical: (?P<cores>\d+) cores x (?P<ghz>[0-9.]+) GHz x (?P<per_cycle>\d+) fp32 FLOP/cycle\b"
)


def theoretical_peak_from_source(source: str) -> tuple[float, float] | None:
    """(peak TFLOP/s, relative rounding) recomputed from a `cpu_theoretical_tflops` source string,
    cores x clock x FLOP/cycle as recorded; None when the source is not one. The clock is recorded
    to 1 MHz, so the recomputation is exact to within half of that, relative to the clock."""
    found = _THEORETICAL_SOURCE.match(str(source))
    if found is None:
        return None
    cores, ghz, per_cycle = int(found["cores"]), float(found["ghz"]), int(found["per_cycle"])
    if not (cores > 0 and ghz > 0 and per_cycle > 0):
        return None
    return cores * ghz * 1e9 * per_cycle / 1e12, 0.0005 / ghz


def mfu(flops_per_token: float, tokens: float, seconds: float, peak_tflops: float, devices: int) -> float:
    """flops_per_token * tokens / (seconds * peak * devices). Use processed tokens and step time
    for `mfu`, useful tokens and wall time for `goodput_mfu` (SPEC). `seconds` may be device-seconds
    (summed over attempts that held different device counts) with `devices=1`."""
    if seconds <= 0 or peak_tflops <= 0 or devices <= 0:
        raise RunnerError(f"mfu needs positive seconds, peak and devices, got {seconds}, {peak_tflops}, {devices}")
    return flops_per_token * tokens / (seconds * peak_tflops * 1e12 * devices)


def cost_per_billion_useful_tokens(
    devices: int, price_per_device_hour: float, wall_seconds: float, useful_tokens: float
) -> float:
    """devices * price per device-hour * wall hours / (useful tokens / 1e9), in the price's currency."""
    if useful_tokens <= 0:
        raise RunnerError(f"cost per useful token needs useful tokens > 0, got {useful_tokens}")
    return devices * price_per_device_hour * (wall_seconds / 3600) / (useful_tokens / 1e9)


@dataclass(frozen=True)
class RunEfficiency:
    """A run's MFU (processed tokens over device step time), goodput MFU (useful tokens over device
    wall time), HFU (recomputation counted; None without activation checkpointing) and cost per
    billion useful tokens (None without useful tokens): the loop's summary and the report's table."""

    mfu: float
    goodput_mfu: float
    hfu: float | None
    cost_per_billion_useful_tokens: float | None

    def to_dict(self) -> dict[str, float]:
        """The figures run.json records (in this order; HFU only where there is one)."""
        out = {"mfu": self.mfu, "goodput_mfu": self.goodput_mfu}
        if self.hfu is not None:
            out["hfu"] = self.hfu
        if self.cost_per_billion_useful_tokens is not None:
            out["cost_per_billion_useful_tokens"] = self.cost_per_billion_useful_tokens
        return out


def run_efficiency(
    flops_per_token: float,
    hfu_flops_per_token: float | None,
    processed_tokens: float,
    useful_tokens: float,
    device_step_seconds: float,
    device_wall_seconds: float,
    peak_tflops: float,
    price_per_device_hour: float,
) -> RunEfficiency:
    """The one computation of a run's MFU, goodput MFU, HFU and cost, over device-seconds (time x
    devices held, summed over attempts: a run resumed on another world size is measured against what
    each attempt held; the same as seconds x devices otherwise)."""
    return RunEfficiency(
        mfu=mfu(flops_per_token, processed_tokens, device_step_seconds, peak_tflops, 1),
        goodput_mfu=mfu(flops_per_token, useful_tokens, device_wall_seconds, peak_tflops, 1),
        hfu=(
            mfu(hfu_flops_per_token, processed_tokens, device_step_seconds, peak_tflops, 1)
            if hfu_flops_per_token is not None
            else None
        ),
        cost_per_billion_useful_tokens=(
            cost_per_billion_useful_tokens(1, price_per_device_hour, device_wall_seconds, useful_tokens)
            if useful_tokens > 0
            else None
        ),
    )


def convention_record(
    convention: Convention, peak: Peak, devices_counted: int, time_basis: str, step_clock: str | None = None
) -> dict:
    """The full SPEC convention record stored next to an MFU figure; `step_clock` (step basis, runs
    only): `device` when step time was read after the device finished the step (records without it:
    `host`, read when the host had queued it)."""
    if time_basis not in ("step", "wall"):
        raise RunnerError(f"time_basis must be 'step' or 'wall', got {time_basis!r}")
    clock = {"step_clock": step_clock} if step_clock is not None and time_basis == "step" else {}
    return {
        **clock,
        **convention.to_dict(),
        "peak_tflops": peak.peak_tflops,
        "peak_dtype": peak.peak_dtype,
        "peak_source": peak.peak_source,
        "devices_counted": devices_counted,
        "time_basis": time_basis,
    }
