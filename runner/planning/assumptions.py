"""What the planner assumes before a run has measured it, with its source: the MFU per architecture,
and what `runner export` of the trained model costs its host (the module's last section).

Owns: the sourced reference figures (dense, and a fine-grained mixture of experts) and the rule that
picks the MFU of a plan. Precedence, first that applies:
  1. `runner plan --mfu X`: X, for any architecture (source "--mfu").
  2. a figure measured on a device for this experiment's model, tokenizer, hardware recipe and speed
     settings (MEASURED_MFU: where, with what versions, when, at which commit); basis "measured".
     These live here, never in a recipe, so no experiment's fingerprint moves when one is measured.
  3. the hardware recipe's `default_mfu`: the device's figure for a dense model (the schema's 0.40 is
     DENSE_REFERENCE); a mixture of experts assumes it times MOE_TO_DENSE, the ratio of the published
     MoE throughput to a dense one on the same device and training stack.
`runner plan --calibrate RUN` never changes the assumption: it fills the plan's `measured` column
from the run (its tokens/s when it trained this model and hardware, else its MFU carried over,
times MOE_TO_DENSE or its inverse when the run's architecture differs from the plan's).
Never: reads runs, or changes a recipe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from runner.config.schema import checkpointing_mode

H100_DENSE_BF16_TFLOPS = 989.4  # the peak table's H100 SXM figure (runner.planning.hardware.PEAKS)

#: OLMo-core's published BF16 throughput for its 7B at sequence length 4096 on H100: 10,000 tokens/s per
#: device (ai2-olmo-core 1.4.0 README, "Official training scripts" table): 6 x 7e9 x 10,000 / 989.4e12 = 42.5%.
DENSE_7B_TOKENS_PER_SECOND, DENSE_7B_PARAMS = 10_000.0, 7e9
#: OLMoE-1B-7B (Muennighoff et al. 2024, ICLR 2025), section 4.1.4: dropless token-choice routing at about
#: 24,400 tokens/s per H100 (its expert-choice variant 29,400), 1.3B active parameters (its Table 1):
#: 6 x 1.3e9 x 24,400 / 989.4e12 = 19.2%, read in the summary of the paper at
#: github.com/bzhng-development/summary-of-some-paper-in-cuda docs/architecture/OLMoE-OpenMixture-of-ExpertsLanguageModels.md.
MOE_TOKENS_PER_SECOND, MOE_ACTIVE_PARAMS = 24_400.0, 1.3e9
MOE_TO_DENSE = (MOE_ACTIVE_PARAMS * MOE_TOKENS_PER_SECOND) / (DENSE_7B_PARAMS * DENSE_7B_TOKENS_PER_SECOND)  # 0.453
DENSE_REFERENCE = 0.40  #: the schema's hardware.default_mfu
DENSE_SOURCE = (
    "dense BF16 training reaches 40-46% of peak: OLMo-core 7B on H100 10,000 tokens/s/device = 42.5% (6N); "
    "llm-foundry MPT-7B on H100 46.4%; PaLM 540B on TPU v4 46.2%"
)
MOE_SOURCE = (
    f"a fine-grained mixture of experts reaches {MOE_TO_DENSE:.3f} of a dense model's MFU on the same stack: "
    "OLMoE-1B-7B (Muennighoff et al. 2024, section 4.1.4) 24,400 tokens/s/H100 x 1.3B active = 19.2% "
    "against OLMo-core 7B's 42.5%"
)


@dataclass(frozen=True)
class AssumedMfu:
    value: float
    architecture: str  # "dense" or "moe"
    rule: str  # how the value was reached, with its numbers
    source: str  # where the figures behind the rule come from
    basis: str = "assumed"  # "assumed" (a published reference, scaled), "measured" (MEASURED_MFU) or "--mfu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reference_mfu(architecture: str) -> float:
    """The published MFU of the architecture's reference run (dense 42.5%, MoE 19.2%, 6N on H100)."""
    if architecture == "moe":
        return 6 * MOE_ACTIVE_PARAMS * MOE_TOKENS_PER_SECOND / (H100_DENSE_BF16_TFLOPS * 1e12)
    return 6 * DENSE_7B_PARAMS * DENSE_7B_TOKENS_PER_SECOND / (H100_DENSE_BF16_TFLOPS * 1e12)


#: Where the H200 figures were measured (bench/measurements/h200-20261204/README.md lists every figure).
H200_PROVENANCE = (
    "one NVIDIA H200 SXM (sm_90, 139.8 GiB), torch 2.11.0+cu130, CUDA 13.0, transformers 5.17.0, triton 3.6.0, "
    "2026-12-04, commit 6b9382b"
)

#: Where the OLMoE rows of the runner's MoE layer were measured (the same machine type and versions).
H200_PROVENANCE_MOE = (
    "one NVIDIA H200 (sm_90, 139.8 GiB), torch 2.11.0+cu130, CUDA 13.0, transformers 5.17.0, triton 3.6.0, "
    "2026-12-04, commit 41ac04e (main with the wall and moe branches merged)"
)


@dataclass(frozen=True)
class MeasuredMfu:
    """An MFU a device measured, and the configuration it holds for: every `match` key (a dotted path
    into the resolved experiment, `recipes.model` the recipe reference) must hold the value."""

    value: float
    what: str
    match: tuple[tuple[str, Any], ...]
    source: str


_SPEED_DEFAULTS = (("model.attn_implementation", "sdpa"), ("model.sdpa_kernel", None), ("hardware.precision", "bf16"))


def _olmoe_regional_selective(micro_batch: int) -> tuple[tuple[str, Any], ...]:
    """The match of an OLMoE-1B-7B bench row on one H200: regional compile, selective checkpointing."""
    return (
        ("recipes.model", "olmoe-1b-7b@1"),
        ("recipes.tokenizer", "gpt-neox-20b@2"),
        ("recipes.hardware", "h200@1"),
        ("model.compile", True),
        ("model.compile_scope", "regional"),
        ("model.activation_checkpointing", "selective"),
        ("train.seq_len", 2048),
        ("train.micro_batch_sequences", micro_batch),
        *_SPEED_DEFAULTS,
    )


MEASURED_MFU: tuple[MeasuredMfu, ...] = (
    MeasuredMfu(
        0.568,
        "the 1p3b recipe (whole-model compile, plain loss) on one H200",
        (
            ("recipes.model", "llama-1p3b@1"),
            ("recipes.tokenizer", "gpt-neox-20b@2"),
            ("recipes.hardware", "h200@1"),
            ("model.compile", True),
            ("model.compile_scope", "model"),
            ("model.kernels", "none"),
            ("model.cross_entropy", "plain"),
            ("model.activation_checkpointing", False),
            ("train.seq_len", 2048),
            *_SPEED_DEFAULTS,
        ),
        "measured: bench/gpu_bench.py row '1p3b recipe mb8' (61,695 tok/s, 6N+attn over 989.4 TFLOP/s; a second "
        f"session 55.8%), bench/measurements/h200-20261204/bench.json; {H200_PROVENANCE}",
    ),
    MeasuredMfu(
        0.144,
        "OLMoE-1B-7B (the runner's MoE layer, eager, full activation checkpointing, micro batch 4) on one H200",
        (
            ("recipes.model", "olmoe-1b-7b@1"),
            ("recipes.tokenizer", "gpt-neox-20b@2"),
            ("recipes.hardware", "h200@1"),
            ("model.compile", False),
            ("model.activation_checkpointing", True),
            ("train.seq_len", 2048),
            ("train.micro_batch_sequences", 4),
            *_SPEED_DEFAULTS,
        ),
        "measured: bench/gpu_bench.py --part moe row 'moe runner eager full mb4' (18,072 tok/s, 14.4% of 989.4 "
        "TFLOP/s over active parameters, 6N+attn; transformers' experts path before it: 13.0-13.1%), "
        f"bench/measurements/h200-20261204-session2/call2/bench-moe.json; {H200_PROVENANCE_MOE}",
    ),
    MeasuredMfu(
        0.249,
        "OLMoE-1B-7B (the runner's MoE layer, regional compile, selective activation checkpointing, micro batch 4) "
        "on one H200, one optimizer step per micro batch (a step that accumulates amortizes it: a lower bound)",
        _olmoe_regional_selective(4),
        "measured: bench/gpu_bench.py --part moe row 'moe runner regional selective mb4' (31,328 tok/s, 24.9% of "
        "989.4 TFLOP/s over active parameters, 6N+attn), bench/measurements/h200-20261204-session2/call2/"
        f"bench-moe.json; {H200_PROVENANCE_MOE}",
    ),
    MeasuredMfu(
        0.312,
        "OLMoE-1B-7B (the runner's MoE layer, regional compile, selective activation checkpointing, micro batch 8) "
        "on one H200",
        _olmoe_regional_selective(8),
        "measured: bench/gpu_bench.py --part moe row 'moe runner regional selective mb8' (39,164 tok/s, 31.2% of "
        "989.4 TFLOP/s over active parameters, 6N+attn), bench/measurements/h200-20261204-session2/call2/"
        f"bench-moe.json; {H200_PROVENANCE_MOE}",
    ),
)


def _dotted(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def _same(key: str, value: Any, wanted: Any) -> bool:
    if key == "model.activation_checkpointing":  # true is full and false none: one meaning
        return value is not None and checkpointing_mode(value) == checkpointing_mode(wanted)
    return bool(value == wanted)


def measured_mfu(cfg: Any) -> MeasuredMfu | None:
    """The measured figure whose configuration this experiment (a typed or plain resolved config) has."""
    for m in MEASURED_MFU:
        if all(_same(k, _dotted(cfg, k), v) for k, v in m.match):
            return m
    return None


def assumed_mfu(
    architecture: str, default_mfu: float, hardware_recipe: str, cli_mfu: float | None, cfg: Any = None
) -> AssumedMfu:
    """The plan's MFU by the module docstring's precedence (`cfg`: the experiment, for a measured figure)."""
    if cli_mfu is not None:
        return AssumedMfu(cli_mfu, architecture, f"--mfu {cli_mfu:g}", "given on the command line", "--mfu")
    found = measured_mfu(cfg) if cfg is not None else None
    if found is not None:
        return AssumedMfu(
            found.value, architecture, f"measured {found.value:.1%}: {found.what}", found.source, "measured"
        )
    stated = f"hardware.default_mfu {default_mfu:.0%} ({hardware_recipe + ', ' if hardware_recipe else ''}dense)"
    if architecture == "moe":
        rule = f"{stated} x {MOE_TO_DENSE:.3f} for a mixture of experts"
        return AssumedMfu(default_mfu * MOE_TO_DENSE, architecture, rule, MOE_SOURCE)
    return AssumedMfu(default_mfu, architecture, stated, DENSE_SOURCE)


def carried_mfu(run_mfu: float, run_architecture: str, plan_architecture: str) -> tuple[float, str]:
    """A calibration run's MFU carried to a plan of another model, and a note when the architectures
    differ: a dense run's MFU times MOE_TO_DENSE for a mixture-of-experts plan (the dense figure
    overstates it); a mixture of experts' MFU carried to a dense plan as measured (a lower bound)."""
    if run_architecture == plan_architecture:
        return run_mfu, ""
    if plan_architecture == "moe":
        return run_mfu * MOE_TO_DENSE, (
            f"the calibration run is dense, this plan a mixture of experts: its MFU {run_mfu:.1%} x "
            f"{MOE_TO_DENSE:.3f} = {run_mfu * MOE_TO_DENSE:.1%} ({MOE_SOURCE})"
        )
    return run_mfu, (
        f"the calibration run is a mixture of experts, this plan dense: its MFU {run_mfu:.1%} carried as "
        "measured, a lower bound for a dense model"
    )


# ---------------------------------------------------------------- `runner export` of a finished run
#: What `runner export` costs the host it runs on (one CPU process: it never needs the accelerator),
#: measured on this project's CI-class machine (2 cores, no bf16 matrix units, four other jobs running),
#: at two sizes, with `/usr/bin/time -v runner export RUN --out DIR --dtype D` over a 1-step run of
#: cpu-tiny (0.3M parameters) and of an override of it at 124M parameters (hidden 1024, 8 layers):
#:   peak resident memory: 0.55 GB at 0.3M for either dtype; at 124M 1.82 GB (bf16) and 1.59 GB (fp32),
#:     i.e. 10.1 and 8.3 bytes per parameter above the fixed 0.55 GB: the checkpoint's fp32 weights and
#:     the runner's fp32 model (4 + 4 B/param), then for bf16 the cast copy verification compares with.
#:   export's own time (the line `runner export` prints, imports excluded): 3.9 s at 0.3M, 45.1 s at
#:     124M (bf16; fp32 within 10%): 0.33 s per million parameters above the fixed part, of which about
#:     half is the verification forwards (bf16 matmuls on a CPU without bf16 units) and the rest reading,
#:     writing and reading back the weights and hashing the sealed checkpoint.
#: A host with more cores (a GPU node's) is faster; the memory figure holds on any host.
EXPORT_FIXED_HOST_BYTES = 0.55e9
EXPORT_HOST_BYTES_PER_PARAM = {"bf16": 10.1, "fp32": 8.3}
EXPORT_FIXED_SECONDS = 3.9
EXPORT_SECONDS_PER_PARAM = 0.33e-6
EXPORT_SOURCE = (
    "measured with /usr/bin/time -v runner export on a 2-core CI-class host at 0.3M and 124M parameters "
    "(runner.planning.assumptions); a larger host is faster, the memory holds"
)


# ---------------------------------------------------------------- writing a checkpoint
#: What a checkpoint costs (runner plan's t_checkpoint; the loop records the real figures per checkpoint
#: in run.json `checkpoints`). A checkpoint is the full fp32 state (12 B/param) on rank 0. Measured on
#: the H200 machine (bench/measurements/h200-20261204-session2/pinned.json, pinned_probe.py: 146 fp32
#: tensors, 15.6 GB; one NVIDIA H200, torch 2.11.0+cu130, 2026-12-04, commit 6b9382b):
#:   device -> pinned host buffers, non_blocking on a side stream: enqueued in 1.5 ms, done in 0.282 s
#:     (55 GB/s), the same on reuse: the loop's checkpoint copy on a GPU without FSDP
#:     (runner.training.staging.PinnedStaging: buffers allocated once per run, 7.6-8.0 s for 15.6 GB,
#:     in a background thread at the attempt's start). The loop enqueues and goes on; its next optimizer
#:     step waits on the device for the copy: the stall is at most the copy (an upper bound).
#:   device -> pageable host memory (`.to("cpu")` per tensor): 9.80 s, 1.59 GB/s: FSDP's gather
#:     (cpu_offload) still copies so.
#:   a CPU run: torch.clone of a 256 MiB fp32 tensor on this project's 2-core CI-class host, three
#:     times under load 3: 2.2, 1.4, 1.35 GB/s (1.4 taken).
#:   the files' write + fsync 1.31 GB/s (the work disk of that machine) and sha256 on one host core
#:     1.28 GB/s: the writer hashes each chunk in a thread while it writes the next
#:     (runner.training.staging.save_safetensors_hashed), so the write takes the slower of the two.
PINNED_COPY_BYTES_PER_S = 55.2e9
PAGEABLE_COPY_BYTES_PER_S = 1.59e9
HOST_MEMCPY_BYTES_PER_S = 1.4e9
DISK_WRITE_BYTES_PER_S = 1.31e9
SHA256_BYTES_PER_S = 1.28e9
CHECKPOINT_SOURCE = (
    "measured on one H200 machine (bench/measurements/h200-20261204-session2/pinned.json, 2026-12-04, commit "
    "6b9382b): device to pinned host 55 GB/s on a side stream (FSDP's pageable gather 1.59 GB/s), write + fsync "
    "1.31 GB/s, sha256 1.28 GB/s hashed beside the write; a CPU run's copy: memcpy on a 2-core host, 1.4 GB/s "
    "(runner.planning.assumptions)"
)


# ---------------------------------------------------------------- what torch.compile saves in memory
#: The fraction of the eager decoder layers' saved activation bytes (runner.planning.plan.
#: saved_activation_bytes' "layers") that a compiled step keeps, by (compile_scope, kernels):
#: AOTAutograd's min-cut partitioner recomputes pointwise ops in the backward instead of saving them,
#: which no first-principles count here reproduces yet, so each factor is measured: max_memory_allocated
#: of one bench row, less the plan's model state at the backward's peak (no gradients: one micro batch
#: per step), the head's saved bytes and the loss's transient, over the eager layers' count. Rows:
#: bench/measurements/h200-20261204 (one H200 SXM, torch 2.11.0+cu130, transformers 5.17.0, triton
#: 3.6.0, liger-kernel 0.8.5, 2026-12-04, commit 6b9382b). Whole-model compile + Liger is refused on
#: CUDA (runner.config.rules.check_speed_options), so it has no factor.
_H200_BENCH = "bench/measurements/h200-20261204"
COMPILE_SAVED_FRACTION: dict[tuple[str, str], tuple[float, str]] = {
    # "1p3b recipe mb8": 1p3b's shape, sdpa, plain loss, mb 8: 47.46 GiB allocated vs 69.51 planned eager
    ("model", "none"): (
        0.471,
        f"measured: H200 bench row '1p3b recipe mb8' (whole-model compile), {_H200_BENCH}/bench.json",
    ),
    # "gpu-smoke settings mb16": gpu-smoke's shape (vocab 4,096), chunked loss, mb 16: 68.96 GiB vs 100.15 eager
    ("regional", "none"): (
        0.626,
        f"measured: H200 bench row 'gpu-smoke settings mb16' (regional compile), {_H200_BENCH}/bench-extra-rows.json",
    ),
    # "compile-regional liger mb8": inductor falls back on Liger's RMSNorm kernel and cannot recompute
    # through Liger's autograd functions: 49.79 GiB vs 50.97 eager
    ("regional", "liger"): (
        0.963,
        f"measured: H200 bench row 'compile-regional liger mb8', {_H200_BENCH}/bench-extra-rows.json",
    ),
}

#: The same fraction for a mixture of experts (the runner's MoE layer, runner.training.moe), by
#: (compile_scope, activation checkpointing mode), measured on the OLMoE-1B-7B rows of `gpu_bench.py
#: --part moe` (bench/measurements/h200-20261204-session2/call2/bench-moe.json). Under compile the
#: plan keeps no bf16 copy of a compiled layer's weights (`autocast_weight_copy_params`: the cast
#: happens inside the compiled region and the partitioner recomputes it from the fp32 parameter in
#: the backward); the fraction is then what the row's max_memory_allocated leaves for the layers'
#: saved bytes, over the eager selective count: (106.24 GiB - 77.40 model state at the backward -
#: 0.19 the LM head's copy - 3.38 head - 4.39 recomputed layer - 6.14 loss transient) / 23.05. One
#: row fits it (mb 8); the others (mb 4, mb 1, full checkpointing) peak at the optimizer step and
#: are held by it within 5% (tests/planning/test_memory_measured.py). A mode with no entry is
#: counted eager (an upper bound); `none` under compile takes the dense model's factor above.
_H200_MOE_BENCH = "bench/measurements/h200-20261204-session2/call2/bench-moe.json"
COMPILE_SAVED_FRACTION_MOE: dict[tuple[str, str], tuple[float, str]] = {
    ("regional", "selective"): (
        0.638,
        f"measured: H200 bench row 'moe runner regional selective mb8' (OLMoE-1B-7B), {_H200_MOE_BENCH}",
    ),
}
