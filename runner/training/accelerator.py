"""Device identity, attention-backend checks and the torch runtime settings of a run.

Owns: which accelerator this process runs on (real, or simulated through RUNNER_SIMULATE_DEVICE so
CPU tests can stand in for an H200 or an MI300X), whether a requested attention implementation can
run there, turning the hardware/model recipe flags into torch settings (TF32, fused AdamW, pinned
memory, torch.compile) and the accelerate mixed-precision string. Returns a plain record of what was
applied (kernels, loss path and compile scope included), which the trainer logs with the run.
Never: installs or downloads anything (transformers' hub "kernels" fallback included), falls back
to another attention backend than the one asked for, or holds a table of device peaks (that is
runner.planning.hardware's). Imports only torch, runner.errors, runner.config.schema and
runner.planning.hardware at module level, so bench/gpu_bench.py can use it on a machine with
nothing but the repository, torch and transformers.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, packages_distributions
from importlib.metadata import version as dist_version
from typing import Any, cast

import torch
import torch.nn.attention
from torch.nn.attention import SDPBackend

from runner.config.schema import (
    Accelerator,
    AttnImplementation,
    HardwareRecipe,
    ModelRecipe,
    OptimRecipe,
    Precision,
    SdpaKernel,
)
from runner.errors import RunnerError
from runner.planning.hardware import DeviceIdentity, check_device_matches, detect_device, parse_simulated

ACCELERATORS: tuple[str, ...] = typing.get_args(Accelerator)
ATTENTION_BACKENDS: tuple[str, ...] = typing.get_args(AttnImplementation)
SDPA_KERNELS: tuple[str, ...] = typing.get_args(SdpaKernel)
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
#: torch.backends.cudnn, untyped: its stubs predate the fp32_precision API (torch 2.9)
_CUDNN: Any = torch.backends.cudnn

# Compute capability of CUDA parts, for simulated names given without an `sm_XY` arch.
CUDA_CAPABILITY = {
    "A100": (8, 0),
    "H100": (9, 0),
    "H200": (9, 0),
    "GH200": (9, 0),
    "B200": (10, 0),
    "GB200": (10, 0),
    "B300": (10, 3),
}

_INSTALL = {
    ("flash_attention_2", "cuda"): "pip install flash-attn --no-build-isolation",
    ("flash_attention_2", "rocm"): (
        "build ROCm's CK flash-attention: GPU_ARCHS=<gfx942|gfx950> pip install "
        "--no-build-isolation git+https://github.com/ROCm/flash-attention"
    ),
    ("flash_attention_3", "cuda"): (
        "build FlashAttention-3 from the hopper/ folder of "
        "https://github.com/Dao-AILab/flash-attention (cd hopper && python setup.py "
        "install), which provides flash_attn_interface"
    ),
    ("flash_attention_3", "rocm"): (
        "install ROCm's FlashAttention-3 build (CK/aiter backend, "
        "https://github.com/ROCm/flash-attention) that provides flash_attn_interface"
    ),
}
_PACKAGE = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
_TRANSFORMERS_CHECK = {
    "flash_attention_2": "is_flash_attn_2_available",
    "flash_attention_3": "is_flash_attn_3_available",
}


def device_identity(simulate: str | None = None) -> DeviceIdentity:
    """runner.planning.hardware's detection: `simulate`, else $RUNNER_SIMULATE_DEVICE, else what torch sees."""
    return detect_device(simulate)


def is_gpu(dev: DeviceIdentity) -> bool:
    return dev.accelerator in ("cuda", "rocm")


def torch_device_type(dev: DeviceIdentity) -> str:
    # ROCm builds of torch expose HIP devices under the "cuda" device type.
    return "cuda" if is_gpu(dev) else "cpu"


def describe(dev: DeviceIdentity) -> str:
    arch = f" ({dev.arch})" if dev.arch else ""
    return f"{dev.accelerator} {dev.name or dev.canonical or 'unnamed'}{arch}" + (
        " [simulated]" if dev.simulated else ""
    )


def cuda_capability(dev: DeviceIdentity) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device: from torch when real, from `sm_XY` or the part name when simulated."""
    if dev.accelerator != "cuda":
        return None
    if not dev.simulated:
        major, minor = torch.cuda.get_device_capability(0)
        return major, minor
    arch = (dev.arch or "").lower()
    if arch.startswith("sm_") and arch[3:].isdigit() and len(arch) >= 5:
        return int(arch[3:-1]), int(arch[-1])
    tokens = (dev.name or "").upper().replace("-", " ").split()
    return next((CUDA_CAPABILITY[t] for t in tokens if t in CUDA_CAPABILITY), None)


def _as_device(device: DeviceIdentity | str | torch.device | None) -> DeviceIdentity:
    if isinstance(device, DeviceIdentity):
        return device
    if device is None:
        return device_identity()
    text = str(device)
    if text == "cpu":
        return DeviceIdentity("cpu", "cpu")
    head, _, tail = text.partition(":")
    if head in ("cuda", "rocm") and (not tail or tail.isdigit()):  # "cuda:0" is an index, not a name
        real = detect_device("")
        if not is_gpu(real):
            raise RunnerError(f"asked for {text} but torch sees no GPU on this machine", key="hardware.accelerator")
        return real
    return parse_simulated(text)


@dataclass(frozen=True)
class AttentionBackend:
    """A checked attention choice: the transformers `attn_implementation` and the SDPA kernel pin."""

    attn_implementation: str
    sdpa_kernel: str | None
    device: str
    package: str | None = None
    package_version: str | None = None

    def context(self) -> contextlib.AbstractContextManager:
        """Wrap forward/backward in this to pin SDPA to the checked kernel (no silent fallback)."""
        if self.attn_implementation != "sdpa" or self.sdpa_kernel is None:
            return contextlib.nullcontext()
        return torch.nn.attention.sdpa_kernel(_sdpa_backend(self.sdpa_kernel))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Runtime:
    """What `apply_runtime` applied: the flat record (run.json's `runtime`, MLflow params) and the
    attention choice it checked, kept typed: the loop enters `attention.context()` around each micro
    step's forward and backward and around evaluation, so what is recorded as `sdpa_kernel` is the
    kernel that runs (activation recomputation in backward included)."""

    record: dict[str, Any]
    attention: AttentionBackend


class StepClock:
    """Times optimizer steps on the device's clock: a step ends when the device has finished the work
    the host queued for it (the optimizer's kernels included), read after one synchronize per
    optimizer step, never per micro batch (each would stall the host's queueing ahead). A CPU computes
    synchronously: its host clock is its device clock. `sync` and `now`: tests inject a device."""

    basis = "device"  # the MFU convention's step_clock

    def __init__(
        self, device: torch.device, sync: Callable[[], None] | None = None, now: Callable[[], float] = time.perf_counter
    ):
        if sync is None:
            sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self._sync, self.now = sync, now

    def seconds_since(self, t0: float) -> float:
        """Seconds from `t0` (a `now()` reading) to the device finishing everything queued so far."""
        self._sync()
        return self.now() - t0


def step_clock(device: torch.device) -> StepClock:
    """The clock a run on `device` times its optimizer steps with."""
    return StepClock(device)


def _sdpa_backend(kernel: str) -> SDPBackend:
    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[kernel]


def _sdpa_kernel_supported(kernel: str, dev: DeviceIdentity) -> str | None:
    """Why `kernel` cannot run on `dev` (None when it can), from the device identity alone."""
    if kernel == "math":
        return None
    if dev.accelerator == "cpu":
        return None if kernel == "flash" else f"SDPA {kernel} has no CPU kernel (flash and math do)"
    if dev.accelerator == "rocm":
        return "SDPA cudnn is CUDA-only" if kernel == "cudnn" else None
    cap = cuda_capability(dev) or (0, 0)
    if kernel in ("flash", "cudnn") and cap < (8, 0):
        return f"SDPA {kernel} needs compute capability 8.0+, {dev.name} is {cap[0]}.{cap[1]}"
    return None


def _probe_sdpa(kernel: str, dev: DeviceIdentity) -> str | None:
    """Run one tiny causal SDPA pinned to `kernel` on the real device; the error text if it fails."""
    dtype = torch.bfloat16 if is_gpu(dev) else torch.float32
    q = torch.randn(1, 2, 16, 64, device=torch_device_type(dev), dtype=dtype)
    try:
        with torch.nn.attention.sdpa_kernel(_sdpa_backend(kernel)):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0]
    return None


def _package_problem(backend: str, dev: DeviceIdentity) -> tuple[str | None, str | None]:
    """(why the flash-attention package of `backend` is unusable or None, its version)."""
    package = _PACKAGE[backend]
    if importlib.util.find_spec(package) is None:
        return f"the {package} package is not installed", None
    version = None
    for dist in packages_distributions().get(package, []):
        with contextlib.suppress(PackageNotFoundError):
            version = dist_version(dist)
            break
    if dev.simulated:
        return None, version  # importing would load GPU libraries this machine does not have
    try:
        importlib.import_module(package)
    except Exception as exc:  # a broken build fails here with ImportError/OSError/RuntimeError
        return (
            f"the {package} package is installed but fails to import ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
            version,
        )
    from transformers.utils import import_utils  # noqa: PLC0415  (transformers: only a flash backend needs it)

    if not getattr(import_utils, _TRANSFORMERS_CHECK[backend])():
        # transformers would then reach for its hub "kernels" fallback: refuse instead.
        return (
            f"{package} imports but transformers does not accept it as {backend} "
            f"(check the distribution name/version it was built under)"
        ), version
    return None, version


def _check_sdpa_kernel(name: str, kernel: str, dev: DeviceIdentity, file: str | None) -> AttentionBackend:
    """SDPA pinned to `kernel`: only with sdpa, a known kernel, and one that runs on `dev` (probed when real)."""
    if name != "sdpa":
        raise RunnerError(
            f"an SDPA kernel ({kernel!r}) only applies to attn_implementation sdpa, not {name}",
            file=file,
            key="model.sdpa_kernel",
        )
    if kernel not in SDPA_KERNELS:
        raise RunnerError(
            f"unknown SDPA kernel {kernel!r}; one of {list(SDPA_KERNELS)}", file=file, key="model.sdpa_kernel"
        )
    why = _sdpa_kernel_supported(kernel, dev)
    if why is None and not dev.simulated:
        why = _probe_sdpa(kernel, dev)
    if why:
        raise RunnerError(
            f"sdpa with the {kernel} kernel cannot run on {describe(dev)}: {why}; "
            f"choose another model.sdpa_kernel (math always runs) or leave it unset",
            file=file,
            key="model.attn_implementation",
        )
    return AttentionBackend("sdpa", kernel, describe(dev))


def check_attention_backend(
    name: str,
    device: DeviceIdentity | str | torch.device | None = None,
    *,
    sdpa_kernel: str | None = None,
    file: str | None = None,
) -> AttentionBackend:
    """Check that attention backend `name` (and SDPA kernel) can run on `device`, or raise RunnerError.

    `device`: a DeviceIdentity, "cpu", "cuda", or a simulation spec such as "rocm:AMD Instinct
    MI300X:gfx942"; None detects it (honouring $RUNNER_SIMULATE_DEVICE).
    """
    key = "model.attn_implementation"
    if name not in ATTENTION_BACKENDS:
        raise RunnerError(f"unknown attention backend {name!r}; one of {list(ATTENTION_BACKENDS)}", file=file, key=key)
    dev = _as_device(device)
    if sdpa_kernel is not None:
        return _check_sdpa_kernel(name, sdpa_kernel, dev, file)
    if name in ("sdpa", "eager"):
        return AttentionBackend(name, None, describe(dev))
    if not is_gpu(dev):
        raise RunnerError(
            f"{name} needs a CUDA or ROCm GPU, this run is on {describe(dev)}; use sdpa", file=file, key=key
        )
    cap = cuda_capability(dev)
    if dev.accelerator == "cuda" and cap is not None:
        if cap < (8, 0):
            raise RunnerError(
                f"{name} needs compute capability 8.0+, {dev.name} is {cap[0]}.{cap[1]}; use sdpa", file=file, key=key
            )
        if name == "flash_attention_3" and cap >= (10, 0):
            raise RunnerError(
                f"flash_attention_3 is built for Hopper (sm_90); {dev.name} is sm_{cap[0]}{cap[1]}: "
                "use sdpa or flash_attention_2",
                file=file,
                key=key,
            )
    problem, version = _package_problem(name, dev)
    if problem:
        raise RunnerError(
            f"{name} unavailable on {describe(dev)}: {problem}; nothing is downloaded. "
            f"Install: {_INSTALL[(name, dev.accelerator)]}; or set it to sdpa",
            file=file,
            key=key,
        )
    return AttentionBackend(name, None, describe(dev), package=_PACKAGE[name], package_version=version)


def _accelerator(hw: HardwareRecipe, file: str | None) -> str:
    if hw.accelerator not in ACCELERATORS:  # a recipe built in code, not loaded (bench scripts)
        raise RunnerError(
            f"must be one of {list(ACCELERATORS)}, got {hw.accelerator!r}", file=file, key="hardware.accelerator"
        )
    return hw.accelerator


def accelerate_mixed_precision(hw: HardwareRecipe, *, file: str | None = None) -> str:
    """accelerate's `mixed_precision`: 'bf16' on a GPU recipe with precision bf16, else 'no'."""
    if hw.precision not in PRECISIONS:
        raise RunnerError(
            f"must be one of {list(PRECISIONS)}, got {hw.precision!r}", file=file, key="hardware.precision"
        )
    if _accelerator(hw, file) == "cpu":
        return "no"  # CPU runs are the fp32 reference; bf16 autocast there is slower, not faster
    return "bf16" if hw.precision == "bf16" else "no"


def fused_adamw_available(dev: DeviceIdentity) -> bool:
    """Whether torch.optim.AdamW(fused=True) has a kernel for the device type this run uses."""
    try:
        # Private torch API: deferred, so a release without it costs this check, not the module.
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # noqa: PLC0415

        return torch_device_type(dev) in _get_fused_kernels_supported_devices()
    except ImportError:  # very old torch: fused AdamW was CUDA-only
        return torch_device_type(dev) == "cuda"


def _set_tf32(enabled: bool) -> dict[str, Any]:
    """Set TF32 for matmul and cuDNN, with the API this torch has (mixing old and new raises in 2.9+)."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        mode = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        _CUDNN.conv.fp32_precision = mode
        _CUDNN.rnn.fp32_precision = mode
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        return {
            "tf32_api": "fp32_precision",
            "matmul_fp32_precision": torch.backends.cuda.matmul.fp32_precision,
            "cudnn_fp32_precision": _CUDNN.conv.fp32_precision,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    return {
        "tf32_api": "allow_tf32",
        "matmul_fp32_precision": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        "cudnn_fp32_precision": "tf32" if torch.backends.cudnn.allow_tf32 else "ieee",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _tf32_record(tf32: bool, dev: DeviceIdentity) -> dict[str, Any]:
    if is_gpu(dev):
        return {"tf32": tf32, **_set_tf32(tf32)}
    # No TF32 units on a CPU; leaving the flags alone keeps fp32 CPU matmuls exact.
    return {
        "tf32": False,
        "tf32_api": None,
        "matmul_fp32_precision": None,
        "cudnn_fp32_precision": None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _fused_adamw_record(optim_cfg: OptimRecipe | None, dev: DeviceIdentity, file: str | None) -> dict[str, Any]:
    """Fused AdamW: used when asked for and available; asked for and unavailable is an error."""
    fused_ok = fused_adamw_available(dev)
    fused_wanted = optim_cfg is not None and optim_cfg.fused
    if fused_wanted and not fused_ok:
        raise RunnerError(
            f"fused AdamW has no kernel for {torch_device_type(dev)} in torch {torch.__version__}; "
            "set optim.fused: false",
            file=file,
            key="optim.fused",
        )
    return {"fused_adamw_available": fused_ok, "adamw_fused": fused_wanted and fused_ok}


def _compile_record(model_cfg: ModelRecipe, dev: DeviceIdentity, file: str | None) -> dict[str, Any]:
    compile_on = model_cfg.compile
    if compile_on and is_gpu(dev) and not dev.simulated and importlib.util.find_spec("triton") is None:
        raise RunnerError(
            "torch.compile on a GPU needs the triton package, which is not installed; "
            "set model.compile: false or install the triton matching this torch",
            file=file,
            key="model.compile",
        )
    return {
        "compile": compile_on,
        "compile_mode": model_cfg.compile_mode if compile_on else None,
        "compile_scope": model_cfg.compile_scope if compile_on else None,
    }


def apply_runtime(
    hardware_cfg: HardwareRecipe,
    model_cfg: ModelRecipe,
    *,
    optim_cfg: OptimRecipe | None = None,
    device: DeviceIdentity | str | None = None,
    file: str | None = None,
) -> Runtime:
    """Apply the recipe's torch settings for this process and return what was applied.

    The record is flat and JSON-serialisable (log it as run params). `optim_cfg`, when given, makes
    a requested-but-unavailable fused AdamW an error instead of a silent unfused optimizer.
    """
    accelerator = _accelerator(hardware_cfg, file)
    dev = _as_device(device)
    if accelerator != "cpu":
        # The recipe's peak and memory describe one part; running it on another would make MFU lie.
        try:
            check_device_matches(hardware_cfg, dev)
        except RunnerError as exc:
            raise RunnerError(exc.detail, file=file, key=exc.key) from None
    # A CPU recipe on a GPU machine computes on the CPU: every check below is about that device.
    run_dev = dev if accelerator != "cpu" else DeviceIdentity("cpu", "cpu", simulated=dev.simulated)
    record: dict[str, Any] = {
        "device_accelerator": run_dev.accelerator,
        "device_name": run_dev.name,
        "device_arch": run_dev.arch,
        "device_canonical": run_dev.canonical,
        "device_count": torch.cuda.device_count() if is_gpu(run_dev) and not run_dev.simulated else 1,
        "device_simulated": run_dev.simulated,
        "torch_version": str(torch.__version__),
        "cuda_version": _str_or_none(torch.version.cuda),
        "hip_version": _str_or_none(getattr(torch.version, "hip", None)),
        "mixed_precision": accelerate_mixed_precision(hardware_cfg, file=file),
        **_tf32_record(hardware_cfg.tf32, run_dev),
    }
    attention = check_attention_backend(
        model_cfg.attn_implementation, run_dev, sdpa_kernel=model_cfg.sdpa_kernel, file=file
    )
    record.update(
        attn_implementation=attention.attn_implementation,
        sdpa_kernel=attention.sdpa_kernel,
        attention_package=attention.package,
        attention_package_version=attention.package_version,
    )
    record.update(_fused_adamw_record(optim_cfg, run_dev, file))
    # Pinned host memory only pays off when a copy to a GPU follows; non_blocking needs it to be async.
    pin = hardware_cfg.pin_memory and is_gpu(run_dev)
    record.update(pin_memory=pin, non_blocking=pin)
    record.update(_compile_record(model_cfg, run_dev, file))
    record.update(_kernel_record(model_cfg, run_dev, file))
    return Runtime(record, attention)


def _kernel_record(model_cfg: ModelRecipe, dev: DeviceIdentity, file: str | None) -> dict[str, Any]:
    """`model.kernels` and `model.cross_entropy`, checked for this device: Liger's Triton kernels
    run on CUDA and ROCm only, and a missing or broken liger-kernel is an error, never a fallback."""
    kernels, cross_entropy = model_cfg.kernels, model_cfg.cross_entropy
    wants = [k for k, v in (("kernels", kernels), ("cross_entropy", cross_entropy)) if v == "liger"]
    version = None
    if wants:
        if not is_gpu(dev):
            raise RunnerError(
                f"liger's Triton kernels need a CUDA or ROCm GPU, this run is on {describe(dev)}; "
                + (
                    "use cross_entropy: chunked (the runner's own fused loss)"
                    if wants == ["cross_entropy"]
                    else "use none"
                ),
                file=file,
                key=f"model.{wants[0]}",
            )
        version = liger_version()
        if version is None:
            raise RunnerError(
                "liger-kernel is not installed; nothing is downloaded. Install: pip install liger-kernel; "
                "or set model.kernels: none and model.cross_entropy: chunked",
                file=file,
                key=f"model.{wants[0]}",
            )
    return {"kernels": kernels, "cross_entropy": cross_entropy, "liger_kernel_version": version}


#: runtime record keys that say how the FLOPs were executed: the MFU convention record carries them too
EXECUTION_KEYS = (
    "attn_implementation",
    "sdpa_kernel",
    "kernels",
    "cross_entropy",
    "compile",
    "compile_scope",
    "adamw_fused",
    "mixed_precision",
    "micro_batch_sequences",
    "prefetch_batches",
)


def execution_record(runtime: dict[str, Any], device_busy_source: str) -> dict[str, Any]:
    """How a run executed its FLOPs (its flops_per_token is the same whatever they are) and what its
    device-busy figure measures: the part of the runtime record the MFU convention record repeats."""
    return {**{k: runtime.get(k) for k in EXECUTION_KEYS}, "device_busy_source": device_busy_source}


def liger_version() -> str | None:
    """The installed liger-kernel's version, None when absent (its import is left to the model)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None

    try:
        return dist_version("liger-kernel")
    except PackageNotFoundError:
        return "unknown"


def restore_default_settings() -> None:
    """Undo what apply_runtime set globally (tests and benchmarks that switch recipes)."""
    _set_tf32(False)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "none"
        _CUDNN.conv.fp32_precision = "none"
        _CUDNN.rnn.fp32_precision = "none"


# ---- sharding -----------------------------------------------------------------------------------


def node_count(world: int, env: dict[str, str] | None = None) -> int:
    """Nodes (launcher agents) the processes run on: torchrun's `GROUP_WORLD_SIZE` (accelerate
    launch sets it too: it starts torchrun's agent), else the world over `LOCAL_WORLD_SIZE`, else 1.
    With the c10d rendezvous a node's place is `GROUP_RANK` (torchrun orders agents itself and
    ignores `--node-rank`)."""
    env = dict(os.environ) if env is None else env
    if env.get("GROUP_WORLD_SIZE", "").isdigit():
        return max(1, int(env["GROUP_WORLD_SIZE"]))
    local = env.get("LOCAL_WORLD_SIZE", "")
    return max(1, world // int(local)) if local.isdigit() and int(local) > 0 else 1


SHARD_NONE = "none"
SHARD_ACCELERATE = "accelerate-fsdp2"  # accelerate's FSDP2 plugin wraps the model in prepare()
SHARD_RUNNER_CPU = "runner-fsdp2-cpu"  # CPU processes: the runner applies the same FSDP2 wrapping


def sharding_mode(hardware_cfg: HardwareRecipe, acc: Any, *, file: str | None = None) -> str:
    """Which code shards the model, checked against the recipe's `hardware.distributed`.

    accelerate offers FSDP only on accelerators: on CPU processes it sets up DDP (MULTI_CPU) even
    when asked for FSDP. There the runner applies FSDP2 itself, exactly as accelerate's
    `fsdp2_prepare_model` does (`fully_shard` per decoder layer, then the root, resharding after
    forward), so the sharded path (gather, checkpoint, resume) runs and is tested on CPU."""
    wanted = hardware_cfg.distributed
    kind = acc.distributed_type.name
    world = int(acc.num_processes)
    if kind == "FSDP":
        if wanted != "fsdp":
            raise RunnerError(
                f"accelerate is set up for FSDP but the recipe says distributed: {wanted}; "
                "use a distributed: fsdp hardware recipe or a DDP accelerate config",
                file=file,
                key="hardware.distributed",
            )
        version = int(getattr(acc.state.fsdp_plugin, "fsdp_version", 1) or 1)
        if version != 2:
            raise RunnerError(
                f"accelerate's FSDP plugin is version {version}; the runner supports FSDP2 "
                "(fsdp_version: 2, as in recipes/hardware/accelerate/fsdp2-*.yaml)",
                file=file,
                key="hardware.distributed",
            )
        return SHARD_ACCELERATE
    if wanted != "fsdp" or world == 1:
        return SHARD_NONE  # one process holds the whole model whatever the recipe plans
    if acc.device.type == "cpu":
        return SHARD_RUNNER_CPU
    raise RunnerError(
        f"the recipe says distributed: fsdp but accelerate set up {kind} over {world} processes; "
        "launch with --config_file recipes/hardware/accelerate/fsdp2-1x8.yaml (or fsdp2-Nx8.yaml)",
        file=file,
        key="hardware.distributed",
    )


def fsdp_plugin(hardware_cfg: HardwareRecipe, environ: typing.Mapping[str, str] | None = None) -> Any:
    """The FSDP2 plugin for `Accelerator(fsdp_plugin=...)` when `accelerate launch` set up FSDP2 (its
    FSDP_* environment gives the rest), else None. A bf16 recipe gets bf16 parameters for compute and
    fp32 gradient reduction: accelerate's default policy reduces in bf16, and under no_sync FSDP2
    accumulates the unsharded gradients in the reduce dtype, so bf16 would make FSDP runs round
    what DDP runs (fp32 gradients of the fp32 parameters under autocast) sum exactly."""
    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or environ.get("FSDP_VERSION") != "2":
        return None  # FSDP1 is refused by sharding_mode, with its way out
    # accelerate and FSDP2 only on this path: a DDP or single-process run never imports them here.
    from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: PLC0415

    policy = bf16_fsdp_policy() if accelerate_mixed_precision(hardware_cfg) == "bf16" else None
    return FullyShardedDataParallelPlugin(mixed_precision_policy=policy)


def bf16_fsdp_policy(reduce_dtype: torch.dtype = torch.float32) -> Any:
    """FSDP2's mixed precision for a bf16 recipe: bf16 parameters for compute, gradients reduced (and,
    under no_sync, accumulated) in `reduce_dtype`: fp32, what DDP sums (bf16 only to show the difference)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415  (FSDP2: torch >= 2.6)

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, output_dtype=torch.bfloat16)


def fsdp_record(acc: Any) -> dict[str, Any]:
    """The FSDP2 mixed-precision policy accelerate holds (None under DDP or one process), for run.json `runtime`."""
    plugin = getattr(acc.state, "fsdp_plugin", None) if acc.distributed_type.name == "FSDP" else None
    policy = getattr(plugin, "mixed_precision_policy", None)
    return {
        "fsdp_param_dtype": _str_or_none(getattr(policy, "param_dtype", None)),
        "fsdp_reduce_dtype": _str_or_none(getattr(policy, "reduce_dtype", None)),
    }


def ddp_kwargs_handlers() -> list[Any]:
    """accelerate's kwargs for the DDP wrapper it builds: no buffer broadcast before every forward (a
    collective per micro batch, and a graph break under compile); the models' only buffers, RoPE's
    inv_freq, are computed from the config alike on every rank and synced when DDP is built."""
    from accelerate.utils import DistributedDataParallelKwargs  # noqa: PLC0415  (accelerate: launch only)

    return [DistributedDataParallelKwargs(broadcast_buffers=False)]


def ddp_compile_settings(model: torch.nn.Module, compile_on: bool) -> dict[str, Any]:
    """Before compiling a DDP-wrapped model: dynamo's DDP optimizer off, so compiled graphs stay whole
    (it splits every graph at the gradient buckets: ~210 subgraphs for 1p3b whole-model, 8 per regional
    layer; the price is no overlap of the one all-reduce per optimizer step with the whole model's
    backward, whereas regional graphs still overlap it layer by layer). Returns the DDP settings that
    ran, read off the wrapper, for run.json `runtime` (None without DDP)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return {"ddp_broadcast_buffers": None, "ddp_bucket_cap_mb": None, "dynamo_optimize_ddp": None}
    optimize_ddp = None
    if compile_on:
        dynamo_config: Any = torch._dynamo.config  # dynamo is imported only by a compiled run
        dynamo_config.optimize_ddp = False
        optimize_ddp = bool(dynamo_config.optimize_ddp)
    return {
        "ddp_broadcast_buffers": bool(model.broadcast_buffers),
        "ddp_bucket_cap_mb": round(int(model.bucket_bytes_cap) / 2**20, 3),
        "dynamo_optimize_ddp": optimize_ddp,
    }


def shard_fsdp2_cpu(model: torch.nn.Module, world: int, mp_policy: Any = None) -> torch.nn.Module:
    """FSDP2 full shard over `world` CPU (gloo) processes: each decoder layer is one unit, then the root.
    `mp_policy` (bf16_fsdp_policy): a mixed-precision policy; None, the runner's CPU runs, is fp32."""
    # FSDP2's public API exists from torch 2.6 (the dependency allows 2.4): only CPU sharding needs it.
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (world,))
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for layer in cast(torch.nn.ModuleList, model.get_submodule("model.layers")):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    return model
