"""The one schema of recipes and experiments: every field, its type, default and a one-line doc.

Owns: the dataclasses each recipe kind and the experiment resolve into, the allowed choices and the
keys left out of the fingerprint. Never reads files (runner.config.load does) or judges values across
keys (runner.config.rules does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("tokenizer", "mixture", "model", "optim", "hardware", "eval")
TOKEN_DTYPES = {"uint16": 65_536, "uint32": 4_294_967_296}


@dataclass
class TokenizerRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    path: str = "???"  #: tokenizer.json, relative to the project root or absolute
    sha256: str | None = "???"  #: sha256 of that file; null = not pinned yet (launch refuses)
    vocab_size: int = "???"  # type: ignore[assignment]
    eos_id: int = "???"  # type: ignore[assignment]
    token_dtype: str = "???"  #: uint16 (vocab <= 65,536) or uint32


@dataclass
class DomainRecipe:
    target_ratio: float = "???"  # type: ignore[assignment]
    max_repetition_ratio: float = 1.0  #: max epochs over the domain's pool (>= 1.0)


@dataclass
class MixtureRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    domains: dict[str, DomainRecipe] = field(default_factory=dict)


@dataclass
class MoeSection:
    """Mixture-of-experts settings of a model recipe (arch olmoe); absent (null) for dense models."""

    n_experts: int = "???"  # type: ignore[assignment]  #: routed experts per layer
    experts_per_token: int = "???"  # type: ignore[assignment]  #: k: experts each input position is routed to
    expert_intermediate_size: int = "???"  # type: ignore[assignment]  #: hidden size of each expert's SwiGLU MLP
    router_aux_loss_coef: float = 0.01  #: load-balancing loss weight (Switch: E * sum_e f_e P_e; 1.0 = balanced)
    router_z_loss_coef: float = 0.001  #: router z-loss weight (ST-MoE: mean squared log-sum-exp of router logits)


@dataclass
class ModelRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    arch: str = "llama"
    hidden_size: int = "???"  # type: ignore[assignment]
    n_layers: int = "???"  # type: ignore[assignment]
    n_heads: int = "???"  # type: ignore[assignment]
    n_kv_heads: int = "???"  # type: ignore[assignment]
    intermediate_size: int = "???"  # type: ignore[assignment]
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02
    pad_vocab_multiple: int = 1  #: embedding rows = tokenizer vocab rounded up to this multiple
    attn_implementation: str = "sdpa"  #: sdpa | eager | flash_attention_2 | flash_attention_3
    sdpa_kernel: str | None = None  #: sdpa only: pin flash | efficient | cudnn | math (null = torch picks)
    activation_checkpointing: bool = False
    compile: bool = False
    compile_mode: str = "default"  #: torch.compile mode: default | reduce-overhead | max-autotune
    moe: MoeSection | None = None  #: arch olmoe: experts, k, expert size, router loss weights; null = dense


@dataclass
class OptimRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    lr: float = "???"  # type: ignore[assignment]
    min_lr_ratio: float = 0.1  #: final lr = lr * min_lr_ratio
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  #: max global grad norm; 0 disables clipping
    fused: bool = False
    schedule: str = "cosine"  #: cosine | wsd | constant, over train.max_duration_tokens
    warmup_tokens: int = 0
    decay_fraction: float = 0.2  #: wsd only: share of max_duration spent decaying


@dataclass
class HardwareRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    accelerator: str = "???"  #: cpu | cuda | rocm
    device_name: str = "???"  #: e.g. "H200 SXM", "MI300X"; must match the detected device
    peak_tflops: float | None = None  #: dense peak for peak_dtype; null = from the peak table
    peak_dtype: str = "bf16"
    peak_source: str | None = None
    memory_gib: float = "???"  # type: ignore[assignment]
    price_per_device_hour_usd: float = "???"  # type: ignore[assignment]
    devices_per_node: int = 1
    nodes: int = 1
    precision: str = "bf16"  #: bf16 (mixed, fp32 master weights) | fp32
    distributed: str = "none"  #: none | ddp | fsdp
    tf32: bool = True
    pin_memory: bool = True
    default_mfu: float = 0.4  #: what the planner assumes before a measurement exists
    cpu_peak: str | None = (
        None  #: CPU, when peak_tflops is null: theoretical (cores x clock x FLOP/cycle) | measured (best fp32 matmul burst)
    )


@dataclass
class EvalRecipe:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    interval_steps: int = "???"  # type: ignore[assignment]
    samples_per_domain: int = "???"  # type: ignore[assignment]
    micro_batch_sequences: int = 8


@dataclass
class CheckpointSection:
    interval_steps: int = 1000
    interval_minutes: float = 60.0
    keep_last: int = 3


@dataclass
class TrainSection:
    seq_len: int = "???"  # type: ignore[assignment]
    global_batch_sequences: int = "???"  # type: ignore[assignment]
    micro_batch_sequences: int = "???"  # type: ignore[assignment]
    exposure_tokens: int = "???"  # type: ignore[assignment]
    max_duration_tokens: int | None = None  #: lr-schedule length; null = exposure_tokens
    hard_stop_tokens: int | None = None  #: stop early without changing the schedule
    log_interval_steps: int = 1
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)


@dataclass
class ManifestPin:
    path: str = "???"  #: manifest.json, relative to the project root or absolute
    sha256: str | None = "???"  #: its manifest_sha256; null = not pinned yet (launch refuses)


@dataclass
class DataSection:
    manifests: dict[str, ManifestPin] = field(default_factory=dict)


@dataclass
class PlanSection:
    checkpoint_overhead_fraction: float = 0.02
    eval_overhead_fraction: float = 0.03
    recovery_overhead_fraction: float = 0.05
    raw_bytes_per_token: float = 4.2
    inference_tokens: float = 0.0


@dataclass
class ExperimentSchema:
    name: str = "???"
    version: int = "???"  # type: ignore[assignment]
    description: str = "???"
    seed: int = "???"  # type: ignore[assignment]
    recipes: dict[str, str] = field(default_factory=dict)
    tokenizer: TokenizerRecipe = field(default_factory=TokenizerRecipe)
    mixture: MixtureRecipe = field(default_factory=MixtureRecipe)
    model: ModelRecipe = field(default_factory=ModelRecipe)
    optim: OptimRecipe = field(default_factory=OptimRecipe)
    hardware: HardwareRecipe = field(default_factory=HardwareRecipe)
    eval: EvalRecipe = field(default_factory=EvalRecipe)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    plan: PlanSection = field(default_factory=PlanSection)


RECIPE_SCHEMAS = {
    "tokenizer": TokenizerRecipe,
    "mixture": MixtureRecipe,
    "model": ModelRecipe,
    "optim": OptimRecipe,
    "hardware": HardwareRecipe,
    "eval": EvalRecipe,
}
#: keys an experiment file may hold at top level (the rest come from recipes)
EXPERIMENT_KEYS = ("name", "version", "description", "base", "seed", "recipes", "overrides", "train", "data", "plan")
CHOICES = {
    "model.arch": ("llama", "olmoe"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2", "flash_attention_3"),
    "model.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "hardware.accelerator": ("cpu", "cuda", "rocm"),
    "hardware.precision": ("bf16", "fp32"),
    "hardware.distributed": ("none", "ddp", "fsdp"),
    "tokenizer.token_dtype": tuple(TOKEN_DTYPES),
}
#: keys that say how a run is operated, not what it trains: left out of the fingerprint, so
#: relocating data, stopping early or checkpointing more often never changes an experiment's identity.
OPERATIONAL_KEYS = (
    "recipes",
    "plan",
    "tokenizer.path",
    "data.manifests.*.path",
    "train.hard_stop_tokens",
    "train.checkpoint",
    "train.log_interval_steps",
    "eval.interval_steps",
)
LABEL_KEYS = ("name", "version", "description")
#: keys added after fingerprints were published: left out of the canonical meaning while null, so
#: every experiment that does not use them keeps the fingerprint it had before they existed.
OMITTED_WHEN_NULL = ("model.moe",)
