"""The one schema of recipes and experiments: every field, its type, default and a one-line doc,
and the rules each section's values obey on their own.

Owns: the frozen dataclasses each recipe kind and the experiment resolve into (the typed config
every stage reads by attribute: `cfg.train.seq_len`), the allowed choices (`Literal` types), the
keys left out of the fingerprint, and each section's `validate` (ranges, divisibility, formats)
next to its fields. Never reads files (runner.config.load does) and never judges values across
sections or against other modules' tables (runner.config.rules does).
Its parts, each a module of its own: the base (runner.config.section: Section, Recipe, from_plain),
the data recipes (runner.config.data_recipes: tokenizer, mixture, Hub files) and the eval recipe
(runner.config.eval_recipe: targets, downstream tasks); this module holds the model, optim and
hardware recipes, the experiment's own sections and the key tables. All of them import nothing but
the standard library, runner.errors and runner.config.moe_rules (which imports the same), so a
script with only torch can build these objects (bench/gpu_bench.py).
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from runner.config.data_recipes import MixtureRecipe, TokenizerRecipe
from runner.config.eval_recipe import EvalRecipe
from runner.config.moe_rules import validate_deepseek_keys, validate_moe_layers
from runner.config.section import (
    MISSING,
    SEED_MAX,
    File,
    Recipe,
    Section,
    at_least_one,
    sha256_format,
    within,
)
from runner.errors import Problems, join_key

KINDS = ("tokenizer", "mixture", "model", "optim", "hardware", "eval")

Arch = Literal["llama", "olmoe"]
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"]
SdpaKernel = Literal["flash", "efficient", "cudnn", "math"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
Schedule = Literal["cosine", "wsd", "constant"]
Accelerator = Literal["cpu", "cuda", "rocm"]
Precision = Literal["bf16", "fp32"]
Distributed = Literal["none", "ddp", "fsdp"]
CpuPeak = Literal["theoretical", "measured"]
ExportDtype = Literal["bf16", "fp32"]
CompileScope = Literal["model", "regional"]
Kernels = Literal["none", "liger"]
CrossEntropy = Literal["plain", "chunked", "liger"]
CheckpointWrite = Literal["background", "foreground"]
MicroBatchPolicy = Literal["fixed", "auto"]
MoeRouter = Literal["softmax", "sigmoid", "sqrt_softplus"]
MoeBalancing = Literal["aux_loss", "aux_free"]
QkNorm = Literal["full", "per_head", "none"]

#: model.activation_checkpointing's modes; true means full and false none (the same fingerprint)
AC_MODES = ("full", "selective", "none")


def checkpointing_mode(value: bool | str) -> str:
    """full | selective | none of a model.activation_checkpointing value (true: full, false: none)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value


@dataclass(frozen=True)
class MoeSection(Section):
    """Mixture-of-experts settings of a model recipe (arch olmoe); absent (null) for dense models."""

    n_experts: int = MISSING  #: routed experts per layer
    experts_per_token: int = MISSING  #: k: experts each input position is routed to
    expert_intermediate_size: int = MISSING  #: hidden size of each expert's SwiGLU MLP
    router_aux_loss_coef: float = 0.01  #: load-balancing loss weight (Switch: E * sum_e f_e P_e; 1.0 = balanced)
    router_z_loss_coef: float = 0.001  #: router z-loss weight (ST-MoE: mean squared log-sum-exp of router logits)
    # DeepSeek-style keys (runner.config.moe_rules checks how they combine); each is left out of the
    # fingerprint at its default (OMITTED_AT_DEFAULT), so OLMoE experiments keep theirs.
    router: MoeRouter = "softmax"  #: score of an expert: softmax (OLMoE) | sigmoid (DeepSeek-V3) | sqrt_softplus (V4)
    #: aux_loss (router_aux_loss_coef) | aux_free (DeepSeek-V3: a per-expert bias steers the top-k choice only)
    balancing: MoeBalancing = "aux_loss"
    bias_update_rate: float = 0.001  #: aux_free: b_i += rate * sign(mean load - load_i) once per optimizer step
    sequence_aux_loss_coef: float = 0.0  #: DeepSeek-V3's sequence-wise balance loss weight (0 = none)
    shared_experts: int = 0  #: experts every position passes through besides its k routed ones
    shared_expert_intermediate_size: int | None = None  #: width of each shared expert (null = expert_intermediate_size)
    routed_scaling_factor: float = 1.0  #: the routed experts' gate weights are multiplied by this
    norm_topk_prob: bool = False  #: gate weights of the k chosen experts renormalised to sum to 1 (OLMoE: false)
    first_dense_layers: int = 0  #: the first N layers have a dense SwiGLU MLP of model.intermediate_size
    hash_layers: int = 0  #: the first N MoE layers route by a fixed token id -> k experts table (DeepSeek-V4)
    swiglu_limit: float | None = None  #: DeepSeek-V4's clip of the experts' gate (max) and up (+-) (null = none)

    @property
    def shared_intermediate_size(self) -> int:
        """Width of one shared expert."""
        size = self.shared_expert_intermediate_size
        return self.expert_intermediate_size if size is None else size

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        at_least_one(problems, file, prefix, self, ("n_experts", "experts_per_token", "expert_intermediate_size"))
        if self.experts_per_token > self.n_experts:
            problems.add(
                file,
                join_key(prefix, "experts_per_token"),
                f"{self.experts_per_token} experts per token but only {self.n_experts} experts",
            )
        for k in ("router_aux_loss_coef", "router_z_loss_coef", "sequence_aux_loss_coef"):
            value = getattr(self, k)
            if not (value >= 0 and math.isfinite(value)):
                problems.add(file, join_key(prefix, k), f"must be a finite number >= 0, got {value}")
        validate_deepseek_keys(self, problems, file, prefix)


@dataclass(frozen=True)
class ModelRecipe(Recipe):
    arch: Arch = "llama"  #: the architecture the trainer builds
    hidden_size: int = MISSING  #: d_model
    n_layers: int = MISSING  #: decoder layers
    n_heads: int = MISSING  #: attention heads (hidden_size / n_heads = head dim, even for RoPE)
    n_kv_heads: int = MISSING  #: grouped-query attention: key/value heads (n_heads = plain attention)
    intermediate_size: int = MISSING  #: SwiGLU width
    tie_embeddings: bool = False  #: the LM head shares the input embedding matrix
    rope_theta: float = 10_000.0  #: RoPE base
    rms_norm_eps: float = 1e-5  #: RMSNorm epsilon
    init_std: float = 0.02  #: std of the normal weight init
    pad_vocab_multiple: int = 1  #: embedding rows = tokenizer vocab rounded up to this multiple
    attn_implementation: AttnImplementation = "sdpa"  #: sdpa | eager | flash_attention_2 | flash_attention_3
    sdpa_kernel: SdpaKernel | None = None  #: sdpa only: pin flash | efficient | cudnn | math (null = torch picks)
    #: recompute in the backward (less memory; HFU reported): full (= true: each decoder layer's whole
    #: forward) | selective (keep matmul and attention outputs, recompute the element-wise ops) | none (= false)
    activation_checkpointing: bool | str = False
    compile: bool = False  #: torch.compile the model
    compile_mode: CompileMode = "default"  #: torch.compile mode: default | reduce-overhead | max-autotune
    #: with compile: true, what is compiled: model (one graph) | regional (each decoder layer alone: same kernels, minutes less to compile)
    compile_scope: CompileScope = "model"
    #: none | liger (Liger's Triton RMSNorm, SwiGLU and RoPE; CUDA/ROCm only, refused on CPU)
    kernels: Kernels = "none"
    #: LM head + loss: plain (fp32 logits [batch, seq, vocab]) | chunked (the runner's: head and loss per chunk of tokens, full logits never exist) | liger (Liger's fused linear cross-entropy; CUDA/ROCm only)
    cross_entropy: CrossEntropy = "plain"
    moe: MoeSection | None = None  #: arch olmoe: experts, k, expert size, router loss weights; null = dense
    #: arch olmoe: RMSNorm of q and k over all heads (full: OLMoE's), per head (per_head: GLM-4.5's) or none (null = full)
    qk_norm: QkNorm | None = None

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        super().validate(problems, file, prefix)
        at_least_one(
            problems,
            file,
            prefix,
            self,
            ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "pad_vocab_multiple"),
        )
        within(problems, file, prefix, self, "rope_theta", 0, low_open=True, means="RoPE's base")
        within(problems, file, prefix, self, "rms_norm_eps", 0, low_open=True, means="added to the mean square")
        within(
            problems, file, prefix, self, "init_std", 0, 1, low_open=True, means="the weights' std: transformers' range"
        )
        heads, kv = self.n_heads, self.n_kv_heads
        if heads >= 1 and self.hidden_size % heads:
            problems.add(
                file,
                join_key(prefix, "n_heads"),
                f"hidden_size {self.hidden_size} is not divisible by n_heads {heads}",
            )
        elif heads >= 1 and (self.hidden_size // heads) % 2:
            problems.add(
                file, join_key(prefix, "n_heads"), f"head dim {self.hidden_size // heads} must be even for RoPE"
            )
        if kv >= 1 and heads % kv:
            problems.add(file, join_key(prefix, "n_kv_heads"), f"n_heads {heads} is not divisible by n_kv_heads {kv}")
        if self.sdpa_kernel is not None and self.attn_implementation != "sdpa":
            problems.add(
                file,
                join_key(prefix, "sdpa_kernel"),
                f"only applies to attn_implementation sdpa, not {self.attn_implementation}",
            )
        self._validate_moe(problems, file, prefix)
        if not isinstance(self.activation_checkpointing, bool) and self.activation_checkpointing not in AC_MODES:
            problems.add(
                file,
                join_key(prefix, "activation_checkpointing"),
                f"'{self.activation_checkpointing}' is not one of true, false, {', '.join(AC_MODES)}",
            )
        if self.compile_scope != "model" and not self.compile:
            problems.add(
                file, join_key(prefix, "compile_scope"), f"{self.compile_scope} applies only with model.compile: true"
            )

    def _validate_moe(self, problems: Problems, file: File, prefix: str) -> None:
        """A mixture-of-experts model (arch olmoe) has a `moe` section that makes sense; a dense one has none."""
        key = join_key(prefix, "moe")
        if self.arch != "olmoe":
            if self.qk_norm is not None:
                problems.add(file, join_key(prefix, "qk_norm"), f"only arch olmoe has q/k norms, not {self.arch}")
            if self.moe is not None:
                problems.add(file, key, f"only a mixture-of-experts arch (olmoe) has experts, not {self.arch}")
            return
        if self.moe is None:
            problems.add(
                file, key, "arch olmoe needs a moe section (n_experts, experts_per_token, expert_intermediate_size)"
            )
            return
        self.moe.validate(problems, file, key)
        validate_moe_layers(self, problems, file, prefix)
        for k, plain in (("kernels", "none"), ("cross_entropy", "plain")):
            if getattr(self, k) != plain:
                problems.add(file, join_key(prefix, k), f"arch olmoe runs transformers' OLMoE: {k} {plain} only")
        if self.moe.first_dense_layers == 0 and self.intermediate_size != self.moe.expert_intermediate_size:
            problems.add(
                file,
                join_key(prefix, "intermediate_size"),
                f"olmoe has no dense MLP: its MLPs are the experts, so intermediate_size ({self.intermediate_size}) "
                f"must equal moe.expert_intermediate_size ({self.moe.expert_intermediate_size}); "
                "write intermediate_size: ${model.moe.expert_intermediate_size} (or give the first layers a dense MLP "
                "of their own with moe.first_dense_layers)",
            )


@dataclass(frozen=True)
class OptimRecipe(Recipe):
    lr: float = MISSING  #: peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  #: final lr = lr * min_lr_ratio
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  #: AdamW (beta1, beta2)
    eps: float = 1e-8  #: AdamW epsilon
    weight_decay: float = 0.1  #: on matrices only; norms' gains are not decayed
    grad_clip: float = 1.0  #: max global grad norm; 0 disables clipping
    fused: bool = False  #: fused AdamW kernel (refused where the device has none)
    schedule: Schedule = "cosine"  #: cosine | wsd | constant, over train.max_duration_tokens
    warmup_tokens: int = 0  #: linear warm-up to lr over this many exposure tokens
    decay_fraction: float = 0.2  #: wsd only: share of max_duration spent decaying

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        super().validate(problems, file, prefix)
        if self.lr <= 0:
            problems.add(file, join_key(prefix, "lr"), f"must be > 0, got {self.lr}")
        elif self.lr > MAX_LR:  # 1e308 was torch's RuntimeError (no float32 holds it) after a run folder was made
            problems.add(
                file, join_key(prefix, "lr"), f"must be at most {MAX_LR:g} (torch holds it in float32), got {self.lr:g}"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.add(file, join_key(prefix, "betas"), f"must be two numbers in [0, 1), got {list(self.betas)}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.add(file, join_key(prefix, "min_lr_ratio"), f"must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_fraction <= 1:
            problems.add(file, join_key(prefix, "decay_fraction"), f"must be in (0, 1], got {self.decay_fraction}")
        if self.warmup_tokens < 0:
            problems.add(file, join_key(prefix, "warmup_tokens"), f"must be >= 0, got {self.warmup_tokens}")
        within(problems, file, prefix, self, "eps", 0, low_open=True, means="AdamW's epsilon: 0 divides 0 by 0")
        within(problems, file, prefix, self, "weight_decay", 0, means="a negative decay grows the weights")


#: the largest learning rate torch's float32 schedule holds (a test drives a loss non-finite with 1e30)
MAX_LR = 1e38
#: the most GiB a device's or a node's host memory is taken to hold (a million: any larger is a typo)
MAX_GIB = 1e6
#: the longest a run's threads wait in one go (a day): a wait past threading.TIMEOUT_MAX (292 years) is an
#: OverflowError in the thread (system_metrics_interval_seconds: 1.0e+300 printed a sampler's traceback)
MAX_WAIT_SECONDS = 86_400.0


@dataclass(frozen=True)
class HardwareRecipe(Recipe):
    accelerator: Accelerator = MISSING  #: cpu | cuda | rocm
    device_name: str = MISSING  #: e.g. "H200 SXM", "MI300X"; must match the detected device
    peak_tflops: float | None = None  #: dense peak for peak_dtype; null = from the peak table
    peak_dtype: str = "bf16"  #: the dtype peak_tflops is for (the peak table holds bf16)
    peak_source: str | None = None  #: where a stated peak_tflops comes from (datasheet, measurement)
    memory_gib: float = MISSING  #: memory of one device
    #: host (CPU) memory of one node in GiB: rank 0 gathers the full training state there to write a
    #: checkpoint (null = unknown: validate and plan warn). Operational: not part of the fingerprint
    host_memory_gib: float | None = None
    price_per_device_hour_usd: float = MISSING  #: for cost per useful token
    devices_per_node: int = 1  #: devices the recipe plans per node (a launcher may start more: MFU counts the held)
    nodes: int = 1  #: nodes the recipe plans
    precision: Precision = "bf16"  #: bf16 (mixed, fp32 master weights) | fp32
    distributed: Distributed = "none"  #: none | ddp | fsdp
    tf32: bool = True
    pin_memory: bool = True  #: page-locked host batches for asynchronous copies (GPU only)
    default_mfu: float = 0.4  #: what the planner assumes before a measurement exists
    #: CPU, when peak_tflops is null: theoretical (cores x clock x FLOP/cycle) | measured (best fp32 matmul burst)
    cpu_peak: CpuPeak | None = None
    #: torch's CPU threads per process (torch.set_num_threads; on a CPU the cores its peak counts).
    #: 1 is the fastest on a shared 2-core machine (bench/bench_threads.py) and what torchrun gives each
    #: process; null = torch's default (every core, or OMP_NUM_THREADS). Operational: not part of the
    #: fingerprint, recorded in run.json; a resume computes with the run's recorded count
    threads: int | None = 1

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        super().validate(problems, file, prefix)
        at_least_one(problems, file, prefix, self, ("devices_per_node", "nodes"))
        if self.threads is not None and self.threads < 1:
            problems.add(
                file, join_key(prefix, "threads"), f"must be >= 1 (or null: torch's default), got {self.threads}"
            )
        within(problems, file, prefix, self, "memory_gib", 0, MAX_GIB, low_open=True, means="GiB of one device")
        within(
            problems, file, prefix, self, "host_memory_gib", 0, MAX_GIB, low_open=True, means="GiB of one node's host"
        )
        within(problems, file, prefix, self, "price_per_device_hour_usd", 0, 1e6, means="USD per device-hour")
        within(problems, file, prefix, self, "default_mfu", 0, 1, low_open=True, means="a fraction of the peak")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            problems.add(file, join_key(prefix, "peak_tflops"), f"must be > 0, got {self.peak_tflops}")
        if self.peak_tflops is not None and not self.peak_source:
            problems.add(
                file, join_key(prefix, "peak_source"), "a stated peak_tflops needs its source (datasheet, measurement)"
            )
        if self.accelerator != "cpu":
            return
        if self.peak_tflops is None and self.cpu_peak is None:
            problems.add(
                file,
                join_key(prefix, "cpu_peak"),
                "a CPU has no datasheet peak: state peak_tflops, or set cpu_peak: theoretical | measured",
            )
        if self.precision != "fp32":
            problems.add(file, join_key(prefix, "precision"), "CPU training runs in fp32")


@dataclass(frozen=True)
class CheckpointSection(Section):
    interval_steps: int = 1000  #: checkpoint every this many committed steps (0 = by the clock only)
    interval_minutes: float = 60.0  #: or when this long has passed since the last save (rank 0's clock; 0 = off)
    keep_last: int = 3  #: complete checkpoints kept (older ones deleted)
    #: background (the loop copies the state to host memory and goes on while a thread writes and hashes it; the next checkpoint waits for it) | foreground (the loop waits for the write)
    write: CheckpointWrite = "background"
    #: with more than one rank: after a stop signal, the most seconds a process takes to save the stop
    #: checkpoint and exit; past it (a rank gone or hung) it exits without one and the previous stands.
    #: Below torchrun's 30 s from SIGTERM to SIGKILL; a scheduler's grace period can allow more
    stop_timeout_seconds: float = 25.0

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        if self.keep_last < 1:
            problems.add(
                file,
                join_key(prefix, "keep_last"),
                f"must be >= 1, got {self.keep_last}: the newest verified checkpoint is what a resume starts from",
            )
        if self.interval_steps < 0 or self.interval_minutes < 0:
            problems.add(file, prefix, "interval_steps and interval_minutes must be >= 0 (0 = off)")
        within(
            problems,
            file,
            prefix,
            self,
            "stop_timeout_seconds",
            0,
            MAX_WAIT_SECONDS,
            low_open=True,
            means="the seconds a stopping rank waits for the others",
        )


@dataclass(frozen=True)
class TrainSection(Section):
    seq_len: int = MISSING  #: L: input positions per sample
    global_batch_sequences: int = MISSING  #: sequences per optimizer step, all devices
    micro_batch_sequences: int = MISSING  #: sequences per forward/backward on one device
    #: fixed | auto (the largest micro batch <= micro_batch_sequences that divides the per-device batch and that the memory plan fits on the device)
    micro_batch_policy: MicroBatchPolicy = "fixed"
    exposure_tokens: int = MISSING  #: the exposure budget: a whole number of global batches
    max_duration_tokens: int | None = None  #: lr-schedule length; null = exposure_tokens
    hard_stop_tokens: int | None = None  #: stop early without changing the schedule
    log_interval_steps: int = 1  #: MLflow metrics every this many steps (metrics/train.jsonl logs every step)
    prefetch_batches: int = (
        1  #: global batches read ahead in a background thread while a step trains (0 = read in the step)
    )
    system_metrics_interval_seconds: float = (
        10.0  #: period of the GPU/CPU utilisation, memory and power samples (0 = off)
    )
    checkpoint: CheckpointSection = field(
        default_factory=CheckpointSection
    )  #: when checkpoints are written (operational: not in the fingerprint)

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        self.checkpoint.validate(problems, file, join_key(prefix, "checkpoint"))
        keys = ("seq_len", "global_batch_sequences", "micro_batch_sequences", "exposure_tokens", "log_interval_steps")
        before = len(problems.lines)
        at_least_one(problems, file, prefix, self, keys)
        if len(problems.lines) > before:
            return  # the budget arithmetic below divides by these
        batch = self.global_batch_sequences * self.seq_len
        for k in ("exposure_tokens", "max_duration_tokens", "hard_stop_tokens"):
            tokens = getattr(self, k)
            if tokens is not None and tokens % batch:
                lo = tokens // batch * batch
                problems.add(
                    file,
                    join_key(prefix, k),
                    f"{tokens:,} is not a whole number of global batches of {batch:,} tokens "
                    f"({self.global_batch_sequences} x {self.seq_len}): use {lo:,} or {lo + batch:,}",
                )
        if self.max_duration_tokens is not None and self.max_duration_tokens < self.exposure_tokens:
            problems.add(
                file,
                join_key(prefix, "max_duration_tokens"),
                f"{self.max_duration_tokens:,} is below exposure_tokens {self.exposure_tokens:,}: "
                "use hard_stop_tokens to stop early",
            )
        if self.hard_stop_tokens is not None and not 0 < self.hard_stop_tokens <= self.exposure_tokens:
            problems.add(
                file,
                join_key(prefix, "hard_stop_tokens"),
                f"must be in (0, exposure_tokens], got {self.hard_stop_tokens:,}",
            )
        if self.prefetch_batches < 0:
            problems.add(
                file,
                join_key(prefix, "prefetch_batches"),
                f"must be >= 0 (0 reads in the step), got {self.prefetch_batches}",
            )
        within(problems, file, prefix, self, "system_metrics_interval_seconds", 0, MAX_WAIT_SECONDS, means="0 = off")


@dataclass(frozen=True)
class ManifestPin(Section):
    path: str = MISSING  #: manifest.json, relative to the project root or absolute
    sha256: str | None = MISSING  #: its manifest_sha256; null = not pinned yet (launch refuses)
    pool_tokens: int | None = None  #: the manifest's pool_tokens (`runner pin`): mixture feasibility without the data
    validation_tokens: int | None = (
        None  #: the manifest's validation_tokens (`runner pin`): small-set warnings without the data
    )

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        sha256_format(problems, file, join_key(prefix, "sha256"), self.sha256)
        for k in ("pool_tokens", "validation_tokens"):
            value = getattr(self, k)
            if value is not None and value < 0:
                problems.add(file, join_key(prefix, k), f"must be >= 0, got {value}")


@dataclass(frozen=True)
class DataSection(Section):
    manifests: dict[str, ManifestPin] = field(default_factory=dict)  #: domain -> its pinned manifest

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        for d, pin in self.manifests.items():
            pin.validate(problems, file, join_key(join_key(prefix, "manifests"), d))


@dataclass(frozen=True)
class PlanSection(Section):
    checkpoint_overhead_fraction: float = 0.02  #: checkpoint time as a fraction of pure training time
    eval_overhead_fraction: float = 0.03  #: evaluation time as a fraction of pure training time
    recovery_overhead_fraction: float = 0.05  #: restarts and lost work
    raw_bytes_per_token: float = 4.2  #: UTF-8 bytes of source text per token, for storage
    #: tokens the model will serve: `runner plan` adds their forward FLOPs (its FLOPs per token / 3 each)
    inference_tokens: float = 0.0

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        for k in ("checkpoint_overhead_fraction", "eval_overhead_fraction", "recovery_overhead_fraction"):
            within(problems, file, prefix, self, k, 0, 10, means="a fraction of pure training time: 0.05 = 5%")
        within(
            problems, file, prefix, self, "raw_bytes_per_token", 0, 1000, low_open=True, means="UTF-8 bytes per token"
        )
        within(problems, file, prefix, self, "inference_tokens", 0, 1e24, means="tokens to serve")


@dataclass(frozen=True)
class SamplesSection(Section):
    """Fixed-prompt greedy samples logged to MLflow at every evaluation (runner.training.samples)."""

    prompts: list[str] = field(default_factory=list)  #: text to continue; none = no samples
    max_new_tokens: int = 32  #: tokens generated per prompt (greedy; stops after an EOS)

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        at_least_one(problems, file, prefix, self, ("max_new_tokens",))
        for i, p in enumerate(self.prompts):
            if not str(p):
                problems.add(file, join_key(prefix, f"prompts[{i}]"), "must be non-empty text to continue")


#: a Hugging Face Hub licence id (apache-2.0, cc-by-nc-sa-4.0, openrail++, llama3.1): what the model
#: card's metadata and its Licence section carry (a backtick or a Markdown link in it went into the card as text)
HUB_LICENSE_ID = re.compile(r"^[a-z0-9][a-z0-9.+-]{0,63}$")


@dataclass(frozen=True)
class ExportSection(Section):
    """What `runner export` writes and whether a run exports itself (operational: not in the fingerprint)."""

    at_end: str | None = (
        None  #: folder a finished run exports its final checkpoint to (outside the run folder); null = off
    )
    dtype: ExportDtype = "bf16"  #: weights' dtype of that export: bf16 | fp32
    license: str | None = None  #: the model card's `license` (a Hub license id, e.g. apache-2.0); null = other
    samples: SamplesSection = field(default_factory=SamplesSection)  #: text samples at each evaluation

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        self.samples.validate(problems, file, join_key(prefix, "samples"))
        if self.at_end is not None and not str(self.at_end).strip():
            problems.add(file, join_key(prefix, "at_end"), "must be a folder path, or null (no export at the end)")
        if self.license is not None and not HUB_LICENSE_ID.match(str(self.license)):
            problems.add(
                file,
                join_key(prefix, "license"),
                "must be a Hub licence id (lowercase letters, digits, '.', '+', '-': apache-2.0, mit, cc-by-4.0; "
                "https://huggingface.co/docs/hub/repositories-licenses), or null: it goes into the model card's "
                "metadata and text",
            )


@dataclass(frozen=True)
class ExperimentSchema(Section):
    """The resolved experiment: every section present, defaults filled, interpolations resolved."""

    name: str = MISSING  #: the experiment's file name
    version: int = MISSING  #: an integer >= 1, bumped on every change
    description: str = MISSING  #: what the experiment is for
    seed: int = MISSING  #: seeds the weights' init (the sampler's order is keyed by it too)
    recipes: dict[str, str] = field(default_factory=dict)  #: kind -> name@version of each recipe used
    tokenizer: TokenizerRecipe = field(default_factory=TokenizerRecipe)
    mixture: MixtureRecipe = field(default_factory=MixtureRecipe)
    model: ModelRecipe = field(default_factory=ModelRecipe)
    optim: OptimRecipe = field(default_factory=OptimRecipe)
    hardware: HardwareRecipe = field(default_factory=HardwareRecipe)
    eval: EvalRecipe = field(default_factory=EvalRecipe)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    plan: PlanSection = field(default_factory=PlanSection)
    export: ExportSection = field(default_factory=ExportSection)  #: `runner export` (operational)

    def validate(self, problems: Problems, file: File, prefix: str = "") -> None:
        """Every section's own rules (the rules across sections are runner.config.rules')."""
        if self.version < 1:  # as a recipe's (check-pr asks for a bump from what the base ref had)
            problems.add(file, join_key(prefix, "version"), f"must be an integer >= 1, got {self.version!r}")
        if not 0 <= self.seed <= SEED_MAX:
            problems.add(
                file,
                join_key(prefix, "seed"),
                f"must be in [0, 2**32 - 1] (the range numpy, torch and Python seed from), got {self.seed}",
            )
        for f in fields(self):
            section = getattr(self, f.name)
            if isinstance(section, Section):
                section.validate(problems, file, join_key(prefix, f.name))


RECIPE_SCHEMAS: dict[str, type[Recipe]] = {
    "tokenizer": TokenizerRecipe,
    "mixture": MixtureRecipe,
    "model": ModelRecipe,
    "optim": OptimRecipe,
    "hardware": HardwareRecipe,
    "eval": EvalRecipe,
}
#: keys an experiment file may hold at top level (the rest come from recipes)
EXPERIMENT_KEYS = (
    "name",
    "version",
    "description",
    "base",
    "seed",
    "recipes",
    "overrides",
    "train",
    "data",
    "plan",
    "export",
)


def literal_choices(typ: Any) -> tuple[str, ...] | None:
    """The choices of a `Literal[...]` (or `Literal[...] | None`) field type, else None."""
    if typing.get_origin(typ) is Literal:
        return typing.get_args(typ)
    for arg in typing.get_args(typ):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def _choices(schema: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, typ in typing.get_type_hints(schema).items():
        key = join_key(prefix, name)
        options = literal_choices(typ)
        if options is not None:
            out[key] = options
        elif isinstance(typ, type) and is_dataclass(typ):
            out.update(_choices(typ, key))
    return out


#: dotted key -> allowed values, read off the `Literal` field types (the one place choices live)
CHOICES = _choices(ExperimentSchema)
#: keys that say how a run is operated, not what it trains: left out of the fingerprint, so
#: relocating data, stopping early or checkpointing more often never changes an experiment's identity.
OPERATIONAL_KEYS = (
    "recipes",
    "plan",
    "export",
    "tokenizer.path",
    "data.manifests.*.path",
    # implied by the manifest's sha256, which is in the fingerprint: pinning them changes no training
    "data.manifests.*.pool_tokens",
    "data.manifests.*.validation_tokens",
    "mixture.domains.*.source.local_dir",
    "mixture.domains.*.source.local_dir_outside_project",
    "train.hard_stop_tokens",
    "train.checkpoint",
    "hardware.host_memory_gib",  # where a checkpoint is gathered, not what is trained
    "hardware.threads",  # how fast a CPU computes, not what (a resume keeps the run's count: runner.training.threads)
    "train.log_interval_steps",
    "train.prefetch_batches",
    "train.system_metrics_interval_seconds",
    "eval.interval_steps",
    # downstream tasks measure what was trained, as targets judge it: each figure carries its own
    # convention record (task file sha256, subset, ...), so a figure never needs the fingerprint to compare
    "eval.tasks",
    "eval.downstream_interval_steps",
    "eval.downstream_micro_batch",
    "eval.aggregate",
    "eval.targets",  # targets say when a run is good enough, not what it trains (SPEC "Quality targets")
)
#: optional sections left out of the fingerprint while null, so that adding them to the schema kept
#: every existing experiment's fingerprint; once set (a Hub commit), they are part of what is trained.
ABSENT_WHEN_NULL = ("tokenizer.hub", "mixture.domains.*.source", "model.moe")
#: keys added after runs were recorded, left out of the fingerprint while they hold this value (what
#: every earlier run did), so adding them moved no fingerprint; any other value is part of the meaning.
OMITTED_AT_DEFAULT = {
    "model.compile_scope": "model",
    "model.kernels": "none",
    "model.cross_entropy": "plain",
    "train.micro_batch_policy": "fixed",
    "model.qk_norm": None,
    "model.moe.router": "softmax",
    "model.moe.balancing": "aux_loss",
    "model.moe.bias_update_rate": 0.001,
    "model.moe.sequence_aux_loss_coef": 0.0,
    "model.moe.shared_experts": 0,
    "model.moe.shared_expert_intermediate_size": None,
    "model.moe.routed_scaling_factor": 1.0,
    "model.moe.norm_topk_prob": False,
    "model.moe.first_dense_layers": 0,
    "model.moe.hash_layers": 0,
    "model.moe.swiglu_limit": None,
}
LABEL_KEYS = ("name", "version", "description")
