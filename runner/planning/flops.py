"""Parameter counts and FLOPs per token of a model recipe, under a named convention.

Owns: the exact parameter count of the Llama architecture the trainer builds (it must equal
`sum(p.numel())` of transformers' LlamaForCausalLM), and the FLOPs-per-token formulas of the
SPEC's MFU conventions (`6N`, `6N+attn`, all/non-embedding params, causal halving, recompute).
Never: reads hardware, times anything, or builds a model (counting is arithmetic only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from runner.config.schema import ExperimentSchema, ModelRecipe
from runner.errors import RunnerError

FLOPS_FORMULAS = ("6N", "6N+attn")
PARAMS_COUNTED = ("all", "non_embedding", "active")


@dataclass(frozen=True)
class Convention:
    """How FLOPs per token are counted; recorded next to every MFU figure (SPEC table)."""

    flops_formula: str = "6N+attn"
    params_counted: str = "non_embedding"
    attention_causal_half: bool = False
    recompute_counted: bool = False

    def __post_init__(self) -> None:
        if self.flops_formula not in FLOPS_FORMULAS:
            raise RunnerError(
                f"flops_formula must be one of {FLOPS_FORMULAS}, got {self.flops_formula!r}",
                key="convention.flops_formula",
            )
        if self.params_counted not in PARAMS_COUNTED:
            raise RunnerError(
                f"params_counted must be one of {PARAMS_COUNTED}, got {self.params_counted!r}",
                key="convention.params_counted",
            )

    @property
    def kind(self) -> str:
        """`HFU` when activation recomputation is counted, else `MFU`."""
        return "HFU" if self.recompute_counted else "MFU"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Convention:
        known = {
            k: d[k] for k in ("flops_formula", "params_counted", "attention_causal_half", "recompute_counted") if k in d
        }
        return cls(**known)


# The convention runs record by default: PaLM's MFU (appendix B) with non-embedding params,
# no causal halving, no recompute (so it stays MFU even with activation checkpointing on).
DEFAULT_CONVENTION = Convention()


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, by block."""

    q_proj: int
    k_proj: int
    v_proj: int
    o_proj: int
    gate_proj: int
    up_proj: int
    down_proj: int
    input_norm: int
    post_attention_norm: int

    @property
    def attention(self) -> int:
        return self.q_proj + self.k_proj + self.v_proj + self.o_proj

    @property
    def mlp(self) -> int:
        return self.gate_proj + self.up_proj + self.down_proj

    @property
    def norms(self) -> int:
        return self.input_norm + self.post_attention_norm

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms

    def to_dict(self) -> dict[str, int]:
        d = asdict(self)
        d.update(attention=self.attention, mlp=self.mlp, norms=self.norms, total=self.total)
        return d


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a Llama model. `all` counts a tied head/embedding matrix once."""

    all: int
    non_embedding: int
    embedding: int
    lm_head: int
    final_norm: int
    n_layers: int
    layer: LayerParams
    tie_embeddings: bool

    @property
    def layers(self) -> int:
        return self.n_layers * self.layer.total

    def get(self, params_counted: str) -> int:
        if params_counted == "all":
            return self.all
        if params_counted in ("non_embedding", "active"):  # dense model: active == non-embedding
            return self.non_embedding
        raise RunnerError(f"params_counted must be one of {PARAMS_COUNTED}, got {params_counted!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "all": self.all,
            "non_embedding": self.non_embedding,
            "embedding": self.embedding,
            "lm_head": self.lm_head,
            "final_norm": self.final_norm,
            "n_layers": self.n_layers,
            "layers": self.layers,
            "per_layer": self.layer.to_dict(),
            "tie_embeddings": self.tie_embeddings,
        }


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RunnerError(f"must be a positive integer, got {value!r}", key=key)
    return value


def count_params(model: ModelRecipe, vocab_size: int) -> ParamCounts:
    """Exact parameter counts of the Llama model section (q,k,v,o with GQA; SwiGLU; RMSNorm; no biases)."""
    if model.arch != "llama":
        raise RunnerError(f"only 'llama' is counted, got {model.arch!r}", key="model.arch")
    d_model, n_layers = _positive(model.hidden_size, "model.hidden_size"), _positive(model.n_layers, "model.n_layers")
    n_heads = _positive(model.n_heads, "model.n_heads")
    n_kv_heads = _positive(model.n_kv_heads, "model.n_kv_heads")
    d_ff = _positive(model.intermediate_size, "model.intermediate_size")
    if d_model % n_heads:
        raise RunnerError(f"hidden_size {d_model} is not divisible by n_heads {n_heads}", key="model.n_heads")
    if n_heads % n_kv_heads:
        raise RunnerError(f"n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}", key="model.n_kv_heads")
    vocab_size = _positive(vocab_size, "tokenizer.vocab_size")
    head_dim = d_model // n_heads
    kv_dim = n_kv_heads * head_dim
    layer = LayerParams(
        q_proj=d_model * n_heads * head_dim,
        k_proj=d_model * kv_dim,
        v_proj=d_model * kv_dim,
        o_proj=n_heads * head_dim * d_model,
        gate_proj=d_model * d_ff,
        up_proj=d_model * d_ff,
        down_proj=d_ff * d_model,
        input_norm=d_model,
        post_attention_norm=d_model,
    )
    tied = model.tie_embeddings
    embedding = vocab_size * d_model
    lm_head = vocab_size * d_model
    body = n_layers * layer.total + d_model
    total = embedding + body + (0 if tied else lm_head)
    # Non-embedding: the input lookup is excluded, the head (a matmul) counted even when tied.
    non_embedding = body + lm_head
    return ParamCounts(
        all=total,
        non_embedding=non_embedding,
        embedding=embedding,
        lm_head=lm_head,
        final_norm=d_model,
        n_layers=n_layers,
        layer=layer,
        tie_embeddings=tied,
    )


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Embedding rows: the tokenizer's `vocab_size` rounded up to `multiple` (model.pad_vocab_multiple)."""
    vocab, multiple = _positive(vocab_size, "tokenizer.vocab_size"), _positive(multiple, "model.pad_vocab_multiple")
    return -(-vocab // multiple) * multiple


def params_of_config(cfg: ExperimentSchema) -> ParamCounts:
    """`count_params` of a resolved experiment config, over its padded vocabulary."""
    return count_params(cfg.model, padded_vocab_size(cfg.tokenizer.vocab_size, cfg.model.pad_vocab_multiple))


def attention_flops_per_token(n_layers: int, d_model: int, seq_len: int) -> int:
    """PaLM appendix B attention term, forward + backward: 12 * n_layers * d_model * seq_len."""
    return 12 * n_layers * d_model * seq_len


def flops_per_token_from_counts(
    counts: ParamCounts, seq_len: int, d_model: int, convention: Convention = DEFAULT_CONVENTION
) -> float:
    """FLOPs per processed token from parameter counts (the pure arithmetic of `flops_per_token`)."""
    n_params = counts.get(convention.params_counted)
    # Forward 2N + backward 4N; recomputation repeats the forward: 8N (HFU).
    passes = 8 if convention.recompute_counted else 6
    flops: float = passes * n_params
    if convention.flops_formula == "6N+attn":
        attn = attention_flops_per_token(counts.n_layers, d_model, seq_len) * passes / 6
        if convention.attention_causal_half:
            attn /= 2
        flops += attn
    return float(flops)


def flops_per_token(
    cfg: ExperimentSchema, convention: Convention = DEFAULT_CONVENTION, *, seq_len: int | None = None
) -> float:
    """FLOPs per processed token of a resolved experiment config under `convention`."""
    counts = params_of_config(cfg)
    if seq_len is None:
        seq_len = cfg.train.seq_len
    if convention.flops_formula == "6N+attn" and not (isinstance(seq_len, int) and seq_len > 0):
        raise RunnerError(f"must be a positive integer for 6N+attn, got {seq_len!r}", key="train.seq_len")
    return flops_per_token_from_counts(counts, seq_len or 0, cfg.model.hidden_size, convention)


def hfu_convention(convention: Convention = DEFAULT_CONVENTION) -> Convention:
    """The same convention with the recomputed forward counted: HFU's, never MFU's."""
    return replace(convention, recompute_counted=True)


def hfu_flops_per_token(
    cfg: ExperimentSchema, convention: Convention = DEFAULT_CONVENTION, *, seq_len: int | None = None
) -> float | None:
    """FLOPs per token the hardware executes when activation checkpointing runs the forward again in
    backward (8N where the model needs 6N): the HFU numerator. None without activation checkpointing."""
    if not cfg.model.activation_checkpointing:
        return None
    return flops_per_token(cfg, hfu_convention(convention), seq_len=seq_len)
