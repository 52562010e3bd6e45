"""Parameter counts and FLOPs per token of a model recipe, under a named convention.

Owns: the exact parameter count of the architectures the trainer builds (it must equal
`sum(p.numel())` of transformers' LlamaForCausalLM and OlmoeForCausalLM), the parameters a token
activates in a mixture-of-experts model, and the FLOPs-per-token formulas of the SPEC's MFU
conventions (`6N`, `6N+attn`, all/non-embedding/active params, causal halving, recompute).
Never: reads hardware, times anything, or builds a model (counting is arithmetic only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from runner.config.rules import padded_vocab_size
from runner.config.schema import ExperimentSchema, ModelRecipe, checkpointing_mode
from runner.errors import RunnerError

FLOPS_FORMULAS = ("6N", "6N+attn")
PARAMS_COUNTED = ("all", "non_embedding", "active")
ARCHS = ("llama", "olmoe")
MOE_ARCHS = ("olmoe",)


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
# A mixture of experts counts the parameters a token passes through (SPEC, "Mixture-of-experts").
MOE_CONVENTION = Convention(params_counted="active")


def is_moe(cfg: ExperimentSchema | ModelRecipe) -> bool:
    """Whether a resolved experiment config (or its model section) is a mixture-of-experts model."""
    model = cfg.model if isinstance(cfg, ExperimentSchema) else cfg
    return model.arch in MOE_ARCHS


def convention_for(cfg: ExperimentSchema) -> Convention:
    """The convention a run of `cfg` records: DEFAULT_CONVENTION, or MOE_CONVENTION (params_counted
    active) for a mixture of experts, whose compute is set by the experts a token is routed to."""
    return MOE_CONVENTION if is_moe(cfg) else DEFAULT_CONVENTION


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
class MoeLayerParams:
    """Parameters of one OLMoE-style decoder layer, by block: attention with q/k RMSNorm (over all
    heads, per head or none: model.qk_norm), a linear router (hidden -> experts) and `n_experts`
    SwiGLU experts, of which a token passes through `k`, plus the shared experts every token passes
    through (`shared`, DeepSeek's). A dense layer of such a model (moe.first_dense_layers) has no
    router and no expert: its whole SwiGLU MLP (`dense_mlp`) is active. A token's active parameters
    are attention, router, its k experts, the shared experts, a dense MLP and the norms (SPEC,
    "Mixture-of-experts"); a hash-routed layer counts k experts like a learned one."""

    q_proj: int
    k_proj: int
    v_proj: int
    o_proj: int
    q_norm: int
    k_norm: int
    router: int
    expert: int  # one expert's gate, up and down projections
    n_experts: int
    experts_per_token: int
    input_norm: int
    post_attention_norm: int
    shared: int = 0  # the shared experts' gate, up and down projections, all of them
    dense_mlp: int = 0  # a dense layer's SwiGLU MLP (then n_experts = k = router = 0)

    @property
    def attention(self) -> int:
        return self.q_proj + self.k_proj + self.v_proj + self.o_proj

    @property
    def mlp(self) -> int:
        """Every expert (and shared expert, or the dense MLP): what the layer holds in memory."""
        return self.n_experts * self.expert + self.shared + self.dense_mlp

    @property
    def mlp_active(self) -> int:
        """The k experts one token is routed to, the shared experts, or the dense MLP."""
        return self.experts_per_token * self.expert + self.shared + self.dense_mlp

    @property
    def norms(self) -> int:
        return self.input_norm + self.post_attention_norm + self.q_norm + self.k_norm

    @property
    def total(self) -> int:
        return self.attention + self.router + self.mlp + self.norms

    @property
    def active(self) -> int:
        return self.attention + self.router + self.mlp_active + self.norms

    def to_dict(self) -> dict[str, int]:
        d = asdict(self)
        for key in ("shared", "dense_mlp"):  # OLMoE's layers have neither: their records stay as they were
            if not d[key]:
                del d[key]
        d.update(
            attention=self.attention,
            mlp=self.mlp,
            mlp_active=self.mlp_active,
            norms=self.norms,
            total=self.total,
            active=self.active,
        )
        return d


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model. `all` counts a tied head/embedding matrix once. `active` is
    what one token passes through (SPEC): for a dense model its non-embedding count; for a
    mixture of experts, each layer's active part (k experts of n) plus final norm and head."""

    all: int
    non_embedding: int
    embedding: int
    lm_head: int
    final_norm: int
    n_layers: int
    layer: LayerParams | MoeLayerParams
    tie_embeddings: bool
    n_dense_layers: int = 0  # moe.first_dense_layers: the first layers are `dense_layer`, the rest `layer`
    dense_layer: MoeLayerParams | None = None

    @property
    def layers(self) -> int:
        return self._over_layers(lambda layer: layer.total)

    def _over_layers(self, size) -> int:
        dense = size(self.dense_layer) * self.n_dense_layers if self.dense_layer is not None else 0
        return (self.n_layers - self.n_dense_layers) * size(self.layer) + dense

    @property
    def moe(self) -> bool:
        return isinstance(self.layer, MoeLayerParams)

    @property
    def active(self) -> int:
        if isinstance(self.layer, MoeLayerParams):
            return self._over_layers(lambda layer: layer.active) + self.final_norm + self.lm_head
        return self.non_embedding

    def get(self, params_counted: str) -> int:
        if params_counted == "all":
            return self.all
        if params_counted == "non_embedding":
            return self.non_embedding
        if params_counted == "active":
            return self.active
        raise RunnerError(f"params_counted must be one of {PARAMS_COUNTED}, got {params_counted!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "all": self.all,
            "non_embedding": self.non_embedding,
            "active": self.active,
            "embedding": self.embedding,
            "lm_head": self.lm_head,
            "final_norm": self.final_norm,
            "n_layers": self.n_layers,
            "layers": self.layers,
            "per_layer": self.layer.to_dict(),
            "tie_embeddings": self.tie_embeddings,
            "moe": self.moe,
            **(
                {"n_dense_layers": self.n_dense_layers, "dense_layer": self.dense_layer.to_dict()}
                if self.dense_layer is not None and self.n_dense_layers
                else {}
            ),
        }


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RunnerError(f"must be a positive integer, got {value!r}", key=key)
    return value


def count_params(model: ModelRecipe, vocab_size: int) -> ParamCounts:
    """Exact parameter counts of the model section: Llama (q,k,v,o with GQA; SwiGLU; RMSNorm; no
    biases) or OLMoE (the same attention plus q/k RMSNorm; a router and SwiGLU experts for the MLP)."""
    if model.arch not in ARCHS:
        raise RunnerError(f"only {', '.join(ARCHS)} are counted, got {model.arch!r}", key="model.arch")
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
    layer: LayerParams | MoeLayerParams
    dense_layer: MoeLayerParams | None = None
    n_dense = 0
    if model.arch == "olmoe":
        layer = _moe_layer(model, d_model, n_heads * head_dim, kv_dim)
        assert model.moe is not None  # _moe_layer refused a model without one
        n_dense = model.moe.first_dense_layers
        if n_dense:
            if not 0 < n_dense < n_layers:
                raise RunnerError(
                    f"{n_dense} dense first layers leave no mixture-of-experts layer of n_layers {n_layers}",
                    key="model.moe.first_dense_layers",
                )
            dense_layer = replace(
                layer, router=0, expert=0, n_experts=0, experts_per_token=0, shared=0, dense_mlp=3 * d_model * d_ff
            )
    else:
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
    body = (n_layers - n_dense) * layer.total + (n_dense * dense_layer.total if dense_layer else 0) + d_model
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
        n_dense_layers=n_dense,
        dense_layer=dense_layer,
    )


def params_of_config(cfg: ExperimentSchema) -> ParamCounts:
    """`count_params` of a resolved experiment config, over its padded vocabulary."""
    return count_params(cfg.model, padded_vocab_size(cfg.tokenizer.vocab_size, cfg.model.pad_vocab_multiple))


def _moe_layer(model: ModelRecipe, d_model: int, q_dim: int, kv_dim: int) -> MoeLayerParams:
    moe = model.moe
    if moe is None:
        raise RunnerError("arch olmoe needs a moe section", key="model.moe")
    n_experts = _positive(moe.n_experts, "model.moe.n_experts")
    k = _positive(moe.experts_per_token, "model.moe.experts_per_token")
    d_expert = _positive(moe.expert_intermediate_size, "model.moe.expert_intermediate_size")
    if k > n_experts:
        raise RunnerError(f"{k} experts per token but only {n_experts} experts", key="model.moe.experts_per_token")
    head_dim = q_dim // model.n_heads
    # OLMoE normalises q and k over all heads at once; GLM-4.5 per head (one head_dim gain each)
    q_norm, k_norm = {"full": (q_dim, kv_dim), "per_head": (head_dim, head_dim), "none": (0, 0)}[
        model.qk_norm or "full"
    ]
    shared = moe.shared_experts * 3 * d_model * moe.shared_intermediate_size
    return MoeLayerParams(
        q_proj=d_model * q_dim,
        k_proj=d_model * kv_dim,
        v_proj=d_model * kv_dim,
        o_proj=q_dim * d_model,
        q_norm=q_norm,
        k_norm=k_norm,
        router=d_model * n_experts,
        expert=3 * d_model * d_expert,  # SwiGLU: gate and up (hidden -> expert), down (expert -> hidden)
        n_experts=n_experts,
        experts_per_token=k,
        input_norm=d_model,
        post_attention_norm=d_model,
        shared=shared,
    )


def attention_flops_per_token(n_layers: int, d_model: int, seq_len: int) -> int:
    """PaLM appendix B attention term, forward + backward: 12 * n_layers * d_model * seq_len."""
    return 12 * n_layers * d_model * seq_len


def forward_flops_per_token(training_flops_per_token: float) -> float:
    """A forward pass's FLOPs per token under a training convention: a third of the training figure (2N
    of 6N, the attention term likewise), what a scoring or a served token costs."""
    return training_flops_per_token / 3.0


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
    backward (8N where the model needs 6N): the HFU numerator. None without activation checkpointing,
    and for `selective` (it recomputes no matmul: the FLOPs executed are the model's)."""
    if checkpointing_mode(cfg.model.activation_checkpointing) != "full":
        return None
    return flops_per_token(cfg, hfu_convention(convention), seq_len=seq_len)
