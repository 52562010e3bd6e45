"""One-shot device benchmark: the BF16 matmul ceiling, then 1p3b training throughput per variant.

Owns: measuring, on whatever device this process sees, (a) the achieved dense BF16 matmul rate and
its fraction of the datasheet peak, (b) training tokens/s, MFU, peak memory (and the memory plan's
figure beside it) of the 1p3b model for a ladder of variants: plain -> Liger kernels -> the
runner's chunked loss -> regional compile -> the gpu-smoke experiment's own settings -> a micro
batch sweep of the best -> whole-model compile and the rest, inside one global time budget. The
model and its loss are the runner's own (runner.training.model.RunnerLlama), so a variant measures
exactly what `runner launch` runs with those recipe options. `--part decisive` measures the ceiling
and the rows that decide (the 1p3b recipe's own settings, then gpu-smoke's settings row); `--part
rest` the ladder after them (the 1p3b recipe at twice the micro batch first), appending to the same
file. Writes the JSON record as it measures (each row
replaces the file atomically: a bench killed at its cap leaves every finished row, `complete` false),
prints a table. Never: crashes on a variant (OOM, a missing backend, a kernel error become rows),
lets a variant's build, warm-up (compile) or timing run past its time box (SIGALRM: a `timeout`
row), downloads anything, or invents a peak for an unknown device.

Standalone: `python bench/gpu_bench.py --out results.json` needs only this repository, torch and
transformers. runner modules are imported lazily; the recipe loader (omegaconf) is optional.
`--cpu-tiny` (automatic without a GPU) runs the same code at a tiny size in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (after the path tweak so `runner` resolves to this checkout)

# Used only when runner.planning.hardware is absent (a bare checkout of this script). Same SPEC figures.
FALLBACK_PEAKS_TFLOPS = {
    "A100": 312.0,
    "H100": 989.4,
    "H200": 989.4,
    "MI300X": 1307.4,
    "MI325X": 1307.4,
    "MI355X": 2516.6,
    "B200": 2250.0,
}
DEFAULT_SHAPE = {
    "hidden_size": 2048,
    "n_layers": 24,
    "n_heads": 16,
    "n_kv_heads": 16,
    "intermediate_size": 5504,
    "vocab_size": 50304,
    "seq_len": 2048,
    "tie_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
TINY_SHAPE = {
    "hidden_size": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 4,
    "intermediate_size": 176,
    "vocab_size": 512,
    "seq_len": 64,
    "tie_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}


@dataclass
class Variant:
    name: str
    micro_batch: int
    attn: str = "sdpa"  # transformers attn_implementation
    sdpa_kernel: str | None = "flash"  # pinned SDPA kernel when attn == sdpa
    compile: str = "none"  # none | model | regional (model.compile + model.compile_scope)
    kernels: str = "none"  # none | liger (model.kernels)
    cross_entropy: str = "plain"  # plain | chunked | liger (model.cross_entropy)
    fused_adamw: bool = True
    autocast_bf16: bool = True
    shape: str = "main"  # main (--experiment) | smoke (--smoke-experiment)
    budget_factor: float = 1.0  # compile pays its compilation inside the variant's time box

    def settings(self) -> tuple:
        """What makes two variants the same program, micro batch and shape aside."""
        return (
            self.attn,
            self.sdpa_kernel,
            self.compile,
            self.kernels,
            self.cross_entropy,
            self.fused_adamw,
            self.autocast_bf16,
        )


@dataclass
class Row:
    variant: str
    micro_batch: int
    attn: str
    compile: str
    fused_adamw: bool
    autocast_bf16: bool
    kernels: str = "none"
    cross_entropy: str = "plain"
    shape: str = "main"
    status: str = "ok"  # ok | oom | unavailable | error | timeout | skipped
    detail: str = ""
    steps_timed: int = 0
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    model_tflops: float | None = None
    mfu: float | None = None
    fraction_of_matmul: float | None = None
    peak_memory_gib: float | None = None
    planned_memory_gib: float | None = None
    build_seconds: float | None = None
    extra: dict = field(default_factory=dict)


def _row(v: Variant, **kw) -> Row:
    attn = v.attn + (f"/{v.sdpa_kernel}" if v.attn == "sdpa" and v.sdpa_kernel else "")
    return Row(
        v.name,
        v.micro_batch,
        attn,
        v.compile,
        v.fused_adamw,
        v.autocast_bf16,
        v.kernels,
        v.cross_entropy,
        v.shape,
        **kw,
    )


# --- device and environment ----------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_facts() -> dict[str, Any]:
    """Name, arch, versions and driver of the device this process uses (CPU when no GPU)."""
    facts: dict[str, Any] = {
        "torch_version": str(torch.__version__),
        "python": platform.python_version(),
        "cuda_version": torch.version.cuda,
        "hip_version": getattr(torch.version, "hip", None),
        "host": platform.node(),
    }
    try:
        import transformers

        facts["transformers_version"] = transformers.__version__
    except ImportError:
        facts["transformers_version"] = None
    if not torch.cuda.is_available():
        facts.update(
            accelerator="cpu",
            device_name=platform.processor() or "cpu",
            arch=None,
            device_count=0,
            driver=None,
            threads=torch.get_num_threads(),
        )
        return facts
    props = torch.cuda.get_device_properties(0)
    rocm = bool(facts["hip_version"])
    arch = (
        (str(getattr(props, "gcnArchName", "")).split(":")[0] or None)
        if rocm
        else "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    )
    facts.update(
        accelerator="rocm" if rocm else "cuda",
        device_name=props.name,
        arch=arch,
        device_count=torch.cuda.device_count(),
        memory_gib=round(props.total_memory / 2**30, 1),
        driver=_driver_version(rocm),
    )
    return facts


def _driver_version(rocm: bool) -> str | None:
    cmd = (
        ["rocm-smi", "--showdriverversion"]
        if rocm
        else ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    )
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if rocm:
        lines = [ln for ln in out.splitlines() if "version" in ln.lower()]
        return lines[0].split(":")[-1].strip() if lines else (out or None)
    return out.splitlines()[0].strip() if out else None


def datasheet_peak(device_name: str | None, arch: str | None) -> tuple[float | None, str]:
    """Dense BF16 peak of one device and its source, from runner.planning.hardware; None for unknown parts."""
    try:
        from runner.planning.hardware import PEAKS, ROCM_ARCH, canonical_device
    except ImportError:
        tokens = (device_name or "").upper().replace("-", " ").split()
        if any(t in ("PCIE", "NVL") for t in tokens):
            return None, "unknown part (PCIe/NVL variants have other peaks)"
        for key, tflops in FALLBACK_PEAKS_TFLOPS.items():
            if key in tokens:
                return tflops, f"bench fallback table ({key}); runner.planning.hardware not importable"
        return None, f"no datasheet peak known for {device_name!r}"
    key = canonical_device(device_name) or (ROCM_ARCH.get(arch) if arch else None)
    if key is None:
        return None, f"no datasheet peak known for {device_name!r} ({arch})"
    return PEAKS[key].dense_bf16_tflops, PEAKS[key].source


# --- model shape and FLOPs -------------------------------------------------------------------


def load_shape(experiment: Path) -> tuple[dict[str, Any], str]:
    """The model section + vocab + seq_len of `experiment`; defaults (and why) when it can't be read."""
    try:
        from runner.config.load import load_experiment
        from runner.config.rules import model_vocab_size

        cfg = load_experiment(experiment).config
        m = cfg.model
        shape = {
            "hidden_size": m.hidden_size,
            "n_layers": m.n_layers,
            "n_heads": m.n_heads,
            "n_kv_heads": m.n_kv_heads,
            "intermediate_size": m.intermediate_size,
            "vocab_size": model_vocab_size(cfg),
            "seq_len": cfg.train.seq_len,
            "tie_embeddings": m.tie_embeddings,
            "rope_theta": m.rope_theta,
            "rms_norm_eps": m.rms_norm_eps,
        }
        return shape, f"{experiment} (runner.config)"
    except Exception as exc:  # no omegaconf, no recipe, a bad recipe: measure the documented shape
        return dict(DEFAULT_SHAPE), f"built-in 1p3b defaults ({type(exc).__name__}: {str(exc)[:120]})"


def flops_per_token(shape: dict[str, Any]) -> tuple[float, int, str]:
    """(FLOPs per token, non-embedding params, formula): SPEC's 6N+attn, non-embedding, no causal halving."""
    d, layers, seq = shape["hidden_size"], shape["n_layers"], shape["seq_len"]
    try:
        from runner.config.schema import ModelRecipe
        from runner.planning.flops import Convention, count_params, flops_per_token_from_counts

        counts = count_params(
            ModelRecipe(
                **{
                    k: shape[k]
                    for k in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "tie_embeddings")
                }
            ),
            shape["vocab_size"],
        )
        n = counts.non_embedding
        fpt = flops_per_token_from_counts(counts, seq, d, Convention("6N+attn", "non_embedding", False, False))
    except ImportError:
        kv = shape["n_kv_heads"] * d // shape["n_heads"]
        layer = 2 * d * d + 2 * d * kv + 3 * d * shape["intermediate_size"] + 2 * d
        n = layers * layer + d + shape["vocab_size"] * d
        fpt = 6 * n + 12 * layers * d * seq
    formula = (
        f"6N+attn (PaLM B), N non-embedding = {n:,}: 6*{n:,} + 12*{layers}*{d}*{seq} "
        f"= {fpt:,.0f} FLOPs/token; attention_causal_half=false, recompute_counted=false"
    )
    return float(fpt), n, formula


# --- measurements ----------------------------------------------------------------------------


def matmul_ceiling(device: torch.device, size: int, seconds: float) -> dict[str, Any]:
    """Best and median TFLOP/s of repeated size^3 matmuls in bf16 (fp32 on CPU), synchronized."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    _sync(device)
    t0 = time.perf_counter()
    torch.mm(a, b, out=out)
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(200, int(0.2 / one)))  # bursts of ~0.2 s keep launch overhead out of the rate
    rates, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 3:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        _sync(device)
        rates.append(2 * size**3 * reps / (time.perf_counter() - t0) / 1e12)
        if len(rates) >= 50:
            break
    rates.sort()
    del a, b, out
    return {
        "size": size,
        "dtype": str(dtype).replace("torch.", ""),
        "bursts": len(rates),
        "matmuls_per_burst": reps,
        "best_tflops": rates[-1],
        "median_tflops": rates[len(rates) // 2],
    }


def _check_variant(v: Variant, device: torch.device) -> str | None:
    """Why the variant cannot run here (None when it can): its attention, Liger, the runner's model."""
    if "liger" in (v.kernels, v.cross_entropy):
        if device.type != "cuda":
            return "liger's Triton kernels need a CUDA or ROCm GPU"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (bench/fetch_device_wheels.sh carries it to the device)"
    if (v.kernels, v.cross_entropy) != ("none", "plain") and _runner_llama() is None:
        return "the runner's model (runner.training.model) is not importable here"
    return _check_backend(v, device)


def _check_backend(v: Variant, device: torch.device) -> str | None:
    """Why the variant's attention cannot run here (None when it can); no fallback, no download."""
    try:
        from runner.errors import RunnerError
        from runner.training.accelerator import check_attention_backend
    except ImportError:
        if v.attn in ("flash_attention_2", "flash_attention_3"):
            package = "flash_attn" if v.attn == "flash_attention_2" else "flash_attn_interface"
            if device.type != "cuda" or importlib.util.find_spec(package) is None:
                return f"{v.attn}: {package} not installed or no GPU"
        return None
    try:
        check_attention_backend(
            v.attn, "cuda" if device.type == "cuda" else "cpu", sdpa_kernel=v.sdpa_kernel if v.attn == "sdpa" else None
        )
    except RunnerError as exc:
        return str(exc)
    return None


def _attention_context(v: Variant):
    if v.attn != "sdpa" or v.sdpa_kernel is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }[v.sdpa_kernel]
    )


def _runner_llama():
    """runner.training.model, or None where the runner's modules cannot be imported."""
    try:
        from runner.training import model as runner_model
    except Exception:  # a bare checkout of this script, or a dependency missing on the device
        return None
    return runner_model


def build_model(shape: dict[str, Any], v: Variant, device: torch.device):
    """The runner's Llama (its loss, Liger kernels, compile scope) at `shape`, on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    runner_model = _runner_llama()
    # The runner's config marks its causal attention mask-free (flash under whole-model compile too).
    config_cls = getattr(runner_model, "RunnerLlamaConfig", LlamaConfig) if runner_model is not None else LlamaConfig
    config = config_cls(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"],
        intermediate_size=shape["intermediate_size"],
        tie_word_embeddings=shape["tie_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
        rms_norm_eps=shape["rms_norm_eps"],
        max_position_embeddings=shape["seq_len"],
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cls = runner_model.RunnerLlama if runner_model is not None else LlamaForCausalLM
    with device:  # initialise on the device: a 1.4B CPU init alone would eat a tenth of the budget
        model = cls._from_config(config, attn_implementation=v.attn, dtype=torch.float32)
    if runner_model is not None:
        model.cross_entropy = v.cross_entropy
        runner_model.apply_kernels(model, v.kernels)
    if v.compile == "regional":
        for layer in model.model.layers:
            layer.compile()
    elif v.compile == "model":
        model.compile()
    return model.train()


def train_step(model, optimizer, batch, v: Variant, device: torch.device) -> None:
    """One optimizer step as the trainer takes it: the summed loss over the useful targets, divided
    by their count, backward, AdamW step."""
    input_ids, targets, mask = batch
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if v.autocast_bf16 else contextlib.nullcontext()
    with _attention_context(v), autocast:
        if hasattr(model, "cross_entropy"):  # the runner's model (compiled in place: still the same object)
            loss = model(input_ids=input_ids, loss_targets=targets, loss_mask=mask) / mask.numel()
        else:
            loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def planned_memory_gib(shape: dict[str, Any], v: Variant, device: torch.device) -> float | None:
    """runner.planning's peak memory per device for this variant (None without the runner): its compile
    scope, kernels, loss and micro batch, one micro batch per optimizer step (as train_step takes it)."""
    try:
        from runner.planning.measured_memory import planned_row_bytes
    except Exception:
        return None
    return planned_row_bytes(shape, asdict(v), gpu=device.type == "cuda") / 2**30


def run_variant(
    v: Variant,
    shape: dict[str, Any],
    device: torch.device,
    *,
    deadline: float,
    warmup_steps: int,
    timed_steps: int,
    fpt: float,
    peak_tflops: float | None,
    ceiling_tflops: float | None,
) -> Row:
    """Measure one variant inside [now, deadline]; every failure is a row, never an exception."""
    row = _row(v)
    why = _check_variant(v, device)
    if why:
        row.status, row.detail = "unavailable", why
        return row
    row.planned_memory_gib = planned_memory_gib(shape, v, device)
    model = optimizer = batch = None
    stage = ["build"]  # where the time box caught it, for the row's detail
    try:
        with time_box(deadline + max(1.0, 0.1 * (deadline - time.perf_counter()))):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            model = build_model(shape, v, device)
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=v.fused_adamw
            )
            gen = torch.Generator(device="cpu").manual_seed(0)
            size = (v.micro_batch, shape["seq_len"])
            batch = (
                torch.randint(0, shape["vocab_size"], size, generator=gen).to(device),
                torch.randint(0, shape["vocab_size"], size, generator=gen).to(device),
                torch.ones(size, dtype=torch.bool, device=device),
            )
            stage[0] = "warm-up (compile)"
            for _ in range(warmup_steps):  # the first steps pay for compilation, autotuning and allocator growth
                train_step(model, optimizer, batch, v, device)
            _sync(device)
            row.build_seconds = time.perf_counter() - t0
            stage[0] = "timed steps"
            _time_steps(row, model, optimizer, batch, v, device, deadline, timed_steps, shape["seq_len"])
        row.model_tflops = fpt * row.tokens_per_second / 1e12
        row.mfu = row.model_tflops / peak_tflops if peak_tflops else None
        row.fraction_of_matmul = row.model_tflops / ceiling_tflops if ceiling_tflops else None
        if device.type == "cuda":
            row.peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2**30
        if time.perf_counter() > deadline:
            row.detail = "variant time box reached during warmup/timing; fewer steps timed"
    except VariantTimeout as exc:
        row.status, row.detail = "timeout", f"{stage[0]} passed the variant's time box ({exc})"
    except torch.OutOfMemoryError as exc:
        row.status, row.detail = "oom", str(exc).strip().splitlines()[0][:200]
    except Exception as exc:  # a kernel or compile failure is a finding about this variant, not a crash
        row.status, row.detail = (
            "error",
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}",
        )
    finally:
        del model, optimizer, batch
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if v.compile != "none":
            with contextlib.suppress(Exception):
                torch._dynamo.reset()
    return row


def _time_steps(row: Row, model, optimizer, batch, v: Variant, device, deadline: float, steps_max: int, seq: int):
    """Up to `steps_max` optimizer steps between two synchronizes, fewer when the deadline passes."""
    t_start = time.perf_counter()
    steps = 0
    while steps < steps_max and (steps == 0 or time.perf_counter() < deadline):
        train_step(model, optimizer, batch, v, device)
        steps += 1
    _sync(device)
    elapsed = time.perf_counter() - t_start
    row.steps_timed, row.step_seconds = steps, elapsed / steps
    row.tokens_per_second = steps * v.micro_batch * seq / elapsed


class VariantTimeout(BaseException):
    """Raised by `time_box`'s alarm: a BaseException, so no `except Exception` in torch's compile stack
    swallows it."""


@contextlib.contextmanager
def time_box(until: float):
    """Interrupt the body at perf_counter() == `until` (SIGALRM; the main thread only, else unbounded).
    Compile runs Python between its kernels, where the alarm's exception lands."""
    if (
        not math.isfinite(until)
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "setitimer")
    ):
        yield
        return
    seconds = max(until - time.perf_counter(), 0.001)

    def fire(signum, frame):
        raise VariantTimeout(f"{seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def variants(micro_batches: list[int], smoke: Variant | None = None) -> list[Variant]:
    """The ladder, in priority order (what the budget cuts comes last); the micro-batch sweep of the
    best of these is added by `sweep` once they are measured."""
    mid = micro_batches[len(micro_batches) // 2]
    regional = 3.0  # compile's time box: compiling one decoder layer's graphs, forward and backward
    return [
        Variant(f"plain mb{mid}", mid),
        Variant(f"liger mb{mid}", mid, kernels="liger", cross_entropy="liger"),
        Variant(f"chunked-ce mb{mid}", mid, cross_entropy="chunked"),
        Variant(f"compile-regional mb{mid}", mid, compile="regional", budget_factor=regional),
        Variant(
            f"compile-regional chunked-ce mb{mid}",
            mid,
            compile="regional",
            cross_entropy="chunked",
            budget_factor=regional,
        ),
        Variant(
            f"compile-regional liger mb{mid}",
            mid,
            compile="regional",
            kernels="liger",
            cross_entropy="liger",
            budget_factor=regional,
        ),
    ]


def tail_variants(micro_batches: list[int]) -> list[Variant]:
    """After the sweep, if time is left: whole-model compile and the reference points."""
    mid = micro_batches[len(micro_batches) // 2]
    return [
        Variant(f"compile-model mb{mid}", mid, compile="model", budget_factor=4.0),
        Variant(f"sdpa-efficient mb{mid}", mid, sdpa_kernel="efficient"),
        Variant(f"fa3 mb{mid}", mid, attn="flash_attention_3", sdpa_kernel=None),
        Variant(f"plain mb{mid} unfused-adamw", mid, fused_adamw=False),
        Variant(f"plain mb{micro_batches[0]} fp32 (no autocast)", micro_batches[0], autocast_bf16=False),
    ]


def sweep(done: list[tuple[Variant, Row]], micro_batches: list[int]) -> list[Variant]:
    """The best main-shape variant so far (tokens/s) at the micro batches it was not measured at."""
    ok = [(v, r) for v, r in done if r.status == "ok" and v.shape == "main" and r.tokens_per_second]
    if not ok:
        return []
    best, _ = max(ok, key=lambda vr: vr[1].tokens_per_second)
    measured = {v.micro_batch for v, _ in done if v.settings() == best.settings() and v.shape == "main"}
    base = best.name.rsplit(" mb", 1)[0]
    return [replace(best, name=f"{base} mb{mb}", micro_batch=mb) for mb in micro_batches if mb not in measured]


# --- reporting -------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: dict[str, Any]) -> None:
    mm = result["matmul"]
    print(
        f"device: {result['device']['device_name']} ({result['device']['accelerator']}, "
        f"{result['device'].get('arch')}), torch {result['device']['torch_version']}, "
        f"driver {result['device'].get('driver')}"
    )
    print(
        f"matmul {mm['size']}^3 {mm['dtype']}: best {mm['best_tflops']:.1f} TFLOP/s, median "
        f"{mm['median_tflops']:.1f}; datasheet peak {_fmt(result['peak_tflops'], '.1f')} "
        f"-> {_fmt(mm.get('fraction_of_peak'), '.1%')} of peak"
    )
    print(f"model: {result['model_source']}\nMFU: {result['flops_formula']}")
    print(f"smoke rows: {result['smoke_source']} (micro batch {result['smoke_micro_batch']})")
    head = (
        f"{'variant':38} {'status':11} {'tok/s':>10} {'step_s':>7} {'TFLOP/s':>8} {'MFU':>6} "
        f"{'of_mm':>6} {'mem_GiB':>8} {'plan_GiB':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(
            f"{r['variant'][:38]:38} {r['status']:11} {_fmt(r['tokens_per_second'], ',.0f'):>10} "
            f"{_fmt(r['step_seconds'], '.3f'):>7} {_fmt(r['model_tflops'], '.1f'):>8} {_fmt(r['mfu'], '.1%'):>6} "
            f"{_fmt(r['fraction_of_matmul'], '.1%'):>6} {_fmt(r['peak_memory_gib'], '.1f'):>8} "
            f"{_fmt(r.get('planned_memory_gib'), '.1f'):>8}"
            + (f"  {r['detail'][:110]}" if r["detail"] and r["status"] != "ok" else "")
        )
    print(f"elapsed {result['elapsed_seconds']:.1f} s of a {result['budget_seconds']:.0f} s budget")


def smoke_settings(experiment: Path, device: torch.device) -> tuple[dict[str, Any], str, Variant]:
    """The smoke experiment's shape, and a variant with its settings: compile scope, loss, kernels,
    precision and the micro batch its `auto` policy picks on this device (what `runner launch` runs)."""
    shape, source = load_shape(experiment)
    try:
        from runner.config.load import load_experiment
        from runner.planning.memory import choose_micro_batch

        exp = load_experiment(experiment, check_files=False)
        cfg, m = exp.config, exp.config.model
        memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        micro = (
            choose_micro_batch(exp.to_container(), 1, memory)[0]
            if cfg.train.micro_batch_policy == "auto"
            else int(cfg.train.micro_batch_sequences)
        )
        v = Variant(
            f"{cfg.name} settings mb{micro}",
            micro,
            attn=str(m.attn_implementation),
            sdpa_kernel=m.sdpa_kernel,
            compile=str(m.compile_scope) if m.compile else "none",
            kernels=str(m.kernels),
            cross_entropy=str(m.cross_entropy),
            fused_adamw=bool(cfg.optim.fused) and device.type == "cuda",
            autocast_bf16=cfg.hardware.precision == "bf16" and cfg.hardware.accelerator != "cpu",
            shape="smoke",
            budget_factor=3.0 if m.compile else 1.0,
        )
        return shape, f"{experiment} (runner.config)", v
    except Exception as exc:  # no omegaconf or no recipe: gpu-smoke's settings as shipped
        v = Variant("gpu-smoke settings mb16", 16, compile="regional", cross_entropy="chunked", shape="smoke")
        return shape, f"{source}; gpu-smoke's shipped settings assumed ({type(exc).__name__})", v


def _skipped(v: Variant, why: str) -> Row:
    return _row(v, status="skipped", detail=why)


def decisive_variants(experiment: Path, micro_batch: int, smoke: Variant | None = None) -> list[Variant]:
    """The rows that decide, measured first: the main experiment's own settings (1p3b: whole-model
    compile, plain loss, bf16) at the 1p3b shape, then `smoke` (gpu-smoke's settings, the row the
    runner's own launch is compared with). Liger under whole-model compile is no longer one: it failed
    on the H200 and validation refuses it (runner.config.rules.LIGER_WHOLE_MODEL_COMPILE)."""
    try:
        from runner.config.load import load_experiment

        m = load_experiment(experiment, check_files=False).config.model
        settings: dict[str, Any] = {
            "attn": str(m.attn_implementation),
            "sdpa_kernel": m.sdpa_kernel,
            "compile": str(m.compile_scope) if m.compile else "none",
            "cross_entropy": str(m.cross_entropy),
            "kernels": str(m.kernels),
        }
    except Exception:  # no omegaconf or no recipe: 1p3b's shipped settings
        settings = {"compile": "model"}
    name = experiment.stem
    factor = {"model": 4.0, "regional": 3.0}.get(settings.get("compile", "none"), 1.0)
    own = Variant(f"{name} recipe mb{micro_batch}", micro_batch, budget_factor=factor, **settings)
    return [own] + ([smoke] if smoke is not None else [])


def recipe_at(experiment: Path, micro_batch: int) -> Variant:
    """The main experiment's own settings at another micro batch (the memory plan fits 1p3b's mb 16
    on an H200: 47.5 GiB measured at mb 8)."""
    return decisive_variants(experiment, micro_batch)[0]


def _header(args, device, facts, peak, peak_source, mm, shapes, fpts, sources, smoke, tiny) -> dict[str, Any]:
    fpt, n_params, formula = fpts["main"]
    return {
        "format": "runner-gpu-bench/3",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "cpu-tiny" if tiny else "gpu",
        "part": args.part,
        "complete": False,  # true once every variant of this part has its row
        "device": facts,
        "peak_tflops": peak,
        "peak_dtype": "bf16",
        "peak_source": peak_source,
        "matmul": mm,
        "model_source": sources[0],
        "model_shape": shapes["main"],
        "params_non_embedding": n_params,
        "flops_per_token": fpt,
        "flops_formula": formula,
        "smoke_source": sources[1],
        "smoke_shape": shapes["smoke"],
        "smoke_micro_batch": smoke.micro_batch,
        "smoke_variant": smoke.name,
        "smoke_flops_per_token": fpts["smoke"][0],
        "best_main_variant": None,
        "convention": {
            "flops_formula": "6N+attn",
            "params_counted": "non_embedding",
            "attention_causal_half": False,
            "recompute_counted": False,
            "devices_counted": 1,
            "time_basis": "step",
        },
        "warmup_steps": 1 if tiny else args.warmup_steps,
        "timed_steps": args.steps if args.steps is not None else (2 if tiny else 10),
        "budget_seconds": args.budget_s,
        "elapsed_seconds": 0.0,
        "rows": [],
    }


def write_result(out: Path, result: dict[str, Any]) -> None:
    """Replace `out` atomically (a temporary file beside it, then os.replace): a reader, or a kill at
    any moment, sees the previous complete JSON or this one, never half of one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, out)


def _previous(out: Path) -> dict[str, Any] | None:
    """What an earlier `--part decisive` wrote to `out` (its ceiling and rows), for `--part rest`."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) and isinstance(old.get("matmul"), dict) and "rows" in old else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.part == "moe":  # the mixture-of-experts rows alone (bench/moe_rows.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import moe_rows

        return moe_rows.run_moe(args, sys.modules[__name__])
    t_begin = time.perf_counter()
    global_deadline = t_begin + args.budget_s
    out = Path(args.out)
    tiny = args.cpu_tiny or not torch.cuda.is_available()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_tiny else "cpu")
    facts = device_facts() if device.type == "cuda" else {**device_facts(), "accelerator": "cpu"}
    smoke_experiment = args.smoke_experiment or str(
        ROOT / "experiments" / ("gpu-smoke-cpu.yaml" if tiny else "gpu-smoke.yaml")
    )
    smoke_shape, smoke_source, smoke = smoke_settings(Path(smoke_experiment), device)
    if tiny:
        shape, source = dict(TINY_SHAPE), "cpu-tiny shape (same code path, tiny sizes)"
        micro_batches = [1, 2]
    else:
        shape, source = load_shape(Path(args.experiment))
        micro_batches = args.micro_batches
    shapes = {"main": shape, "smoke": smoke_shape}
    fpts = {name: flops_per_token(sh) for name, sh in shapes.items()}
    if device.type == "cuda":
        peak, peak_source = datasheet_peak(facts["device_name"], facts.get("arch"))
    else:
        peak, peak_source = None, "a CPU has no datasheet peak: MFU not computed, see fraction_of_matmul"
    before = _previous(out) if args.part == "rest" else None
    if before is not None:  # the decisive part measured the ceiling: the rest appends to its rows
        mm = before["matmul"]
    else:
        mm = matmul_ceiling(device, 256 if tiny else args.matmul_size, min(args.matmul_s, args.budget_s / 10))
        mm["fraction_of_peak"] = mm["best_tflops"] / peak if peak else None
    result = _header(args, device, facts, peak, peak_source, mm, shapes, fpts, (source, smoke_source), smoke, tiny)
    result["rows"] = list(before["rows"]) if before else []
    write_result(out, result)
    done: list[tuple[Variant, Row]] = []

    def measure(v: Variant) -> None:
        remaining = global_deadline - time.perf_counter()
        box = args.variant_s * v.budget_factor
        if tiny and v.compile != "none":
            row = _skipped(v, "torch.compile skipped in --cpu-tiny (needs a C++ toolchain and minutes)")
        elif remaining < box * 0.5:  # a compile cut at its box measures nothing: start it only with room
            row = _skipped(v, f"global budget: {max(remaining, 0):.0f} s left")
        else:
            row = run_variant(
                v,
                shapes[v.shape],
                device,
                deadline=time.perf_counter() + min(box, remaining),
                warmup_steps=result["warmup_steps"],
                timed_steps=result["timed_steps"],
                fpt=fpts[v.shape][0],
                peak_tflops=peak,
                ceiling_tflops=mm["best_tflops"],
            )
            print(f"  {row.variant}: {row.status} {_fmt(row.tokens_per_second, ',.0f')} tok/s", flush=True)
        done.append((v, row))
        result["rows"].append(asdict(row))
        result["elapsed_seconds"] = time.perf_counter() - t_begin
        write_result(out, result)  # every row as it is measured

    mid = micro_batches[len(micro_batches) // 2]
    if args.part in ("decisive", "all"):
        for v in decisive_variants(Path(args.experiment), mid, smoke):
            measure(v)
    if args.part in ("rest", "all"):
        bigger = [recipe_at(Path(args.experiment), 2 * mid)] if not tiny else []
        for v in bigger + variants(micro_batches):
            measure(v)
        for v in sweep(done, micro_batches) + tail_variants(micro_batches):
            measure(v)
    best = max(
        (r for r in result["rows"] if r["status"] == "ok" and r["shape"] == "main" and r["mfu"] is not None),
        key=lambda r: r["mfu"],
        default=None,
    )
    result.update(best_main_variant=best["variant"] if best else None, complete=True)
    result["elapsed_seconds"] = time.perf_counter() - t_begin
    write_result(out, result)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/gpu_bench.json", help="JSON output path")
    p.add_argument("--budget-s", type=float, default=270.0, help="global wall-clock budget, seconds")
    p.add_argument("--variant-s", type=float, default=40.0, help="time box of one variant (compile gets 3x)")
    p.add_argument("--matmul-s", type=float, default=8.0, help="seconds spent timing the matmul ceiling")
    p.add_argument("--matmul-size", type=int, default=8192, help="square matmul size (bf16)")
    p.add_argument("--experiment", default=str(ROOT / "experiments" / "1p3b.yaml"), help="model shape source")
    p.add_argument(
        "--smoke-experiment",
        default=None,
        help="experiment whose shape and settings make the smoke row, the one `runner launch` is compared with "
        "(default experiments/gpu-smoke.yaml; gpu-smoke-cpu.yaml with --cpu-tiny)",
    )
    p.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per variant (fewer if its box ends; default 10, 2 in --cpu-tiny)",
    )
    p.add_argument("--cpu-tiny", action="store_true", help="tiny sizes on CPU (automatic without a GPU)")
    p.add_argument(
        "--part",
        choices=("decisive", "rest", "all", "moe"),
        default="all",
        help="decisive: the ceiling, the main experiment's own settings and the smoke experiment's; "
        "rest: the ladder after them, appended to --out's rows; all: both (default); "
        "moe: the mixture-of-experts rows of --experiment (experiments/olmoe-1b-7b.yaml; cpu-tiny-moe's "
        "model with --cpu-tiny): transformers' experts, the runner's layer eager / regional compile / "
        "selective and no checkpointing / micro batches 4 and 8 (bench/moe_rows.py)",
    )
    args = p.parse_args(argv)
    if args.budget_s <= 0 or math.isnan(args.budget_s):
        p.error("--budget-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)  # writes --out as it measures
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
