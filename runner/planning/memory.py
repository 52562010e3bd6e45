"""The memory plan: bytes per device of a training step (weights, gradients, AdamW moments, bf16
copies, activations as autograd saves them under the model's checkpointing mode and compile scope, the
loss's and the optimizer step's temporaries) and the micro batch `micro_batch_policy: auto` picks.

Owns: the saved-activation count (held exact by the saved-tensor probe on CPU), compile's measured
saving, the per-device total, and the automatic micro batch.
Never: runs a model; reads only the typed config (and the measured fractions in assumptions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runner.config.rules import devices
from runner.config.schema import AC_MODES, ExperimentSchema, checkpointing_mode
from runner.config.section import from_plain
from runner.errors import RunnerError
from runner.planning import assumptions
from runner.planning.flops import params_of_config

GIB = 2.0**30
#: what memory_per_device counts, by hardware.precision
MEMORY_ASSUMPTIONS = {
    "bf16": "bf16 mixed: fp32 master weights + fp32 grads (at the backward's peak only when accumulating or "
    "DDP/FSDP) + 2 fp32 AdamW moments + bf16 copies of the matmul weights (a compiled mixture of experts: "
    "the LM head's only); activations as autograd saves them (calibrated: saved-tensor probe, exact on CPU) "
    "x compile's measured fraction + the loss's peak; within 5% of max_memory_allocated on an H200 (dense "
    "and OLMoE-1B-7B bench rows, bench/measurements/h200-20261204*); no CUDA context or allocator "
    "fragmentation",
    "fp32": "fp32: weights + grads (at the backward's peak only when accumulating or DDP/FSDP) + 2 AdamW "
    "moments at 4 B; activations as autograd saves them (calibrated: saved-tensor probe, exact on CPU) + "
    "the loss's peak; no framework overhead",
}


#: share of the device's memory the automatic micro batch may plan to fill: the rest is for what the
#: plan does not count (CUDA context, allocator fragmentation, communication buffers)
AUTO_MICRO_BATCH_MEMORY_FRACTION = 0.9
CHUNKED_LOSS_TOKENS = 1024  # runner.training.loss.CHUNK_TOKENS (planning never imports the trainer)


def as_schema(cfg: ExperimentSchema | Mapping[str, Any]) -> ExperimentSchema:
    """The typed config of a resolved experiment given as plain data (a saved experiment.yaml, a bench
    script's shape), the schema's defaults under it; a typed config as it is."""
    return cfg if isinstance(cfg, ExperimentSchema) else from_plain(ExperimentSchema, cfg)


def saved_activation_bytes(
    cfg: ExperimentSchema | Mapping[str, Any], micro_batch: int | None = None, checkpointing: bool | str | None = None
) -> dict[str, float]:
    """Bytes autograd saves for the backward during one training forward of a micro batch, by part.

    Counted tensor by tensor for transformers' Llama as the trainer runs it (calibrated against
    runner.training.memprobe, the saved-tensor probe: exact on CPU in fp32 and bf16 autocast, with
    sdpa and eager attention, plain and chunked loss, with and without checkpointing). Per token,
    with c the compute dtype's bytes (bf16 autocast 2, fp32 4); the residual stream and the RMSNorms
    stay fp32 under autocast (4 bytes):
      RMSNorm:   4h input + 4 rsqrt + 4h normalised product
      attention: norm + q,k,v inputs (3 casts of c*h under autocast, one fp32 tensor without)
                 + q c*h + k, v c*kv each + 4*heads logsumexp + c*h output (the o_proj input)
                 eager instead: k, v repeated to h each + softmax (4 + c under autocast, 4 without)
                 * heads * seq_len, no logsumexp
      mlp:       norm + gate, up inputs (2 casts under autocast) + gate, up, silu, product c*f each
      head:      norm + plain: lm_head input c*h, log-softmax 4*V, targets 8, mask 1;
                 chunked/liger: d/dhidden 4h (+ d/dW 4*V*h, once per micro batch)
      input ids 8; RoPE cos and sin, 2 * seq_len * head_dim * 4, once per micro batch.
    A mixture of experts (arch olmoe) is counted layer by layer as built (`_decoder_layer_saved_bytes`):
    OLMoE's layers, and DeepSeek's (dense first layers, score and hash routers, shared experts, the
    SwiGLU clip, q/k norms full, per head or none), each held by the probe too.
    With activation checkpointing each layer keeps only its input (4h) and the layer being
    recomputed (the largest) holds its own tensors again (`recompute_layer`); `selective` keeps the
    input and its matmul and attention outputs (`selective_layer_saved_bytes`). Liger's kernels
    (`model.kernels: liger`) save no normalised product and no silu output: estimated from Liger's
    source, to be measured on a GPU (bench/device_check.sh). Not counted: autocast's bf16 weight copies (model
    state), the parameters themselves."""
    cfg = as_schema(cfg)
    model, train, hw = cfg.model, cfg.train, cfg.hardware
    counts = params_of_config(cfg)
    s = train.seq_len
    b = micro_batch if micro_batch is not None else train.micro_batch_sequences
    h, heads = model.hidden_size, model.n_heads
    vocab = counts.embedding // h
    autocast = hw.precision == "bf16" and hw.accelerator != "cpu"
    c = 2 if autocast else 4
    n_layers = counts.n_layers
    norm, _ = _decoder_layer_saved_bytes(model, s, c, autocast, 0)
    per_layer = [_decoder_layer_saved_bytes(model, s, c, autocast, i)[1] for i in range(n_layers)]
    plain = model.cross_entropy == "plain"
    head_per_token = norm + (c * h + 4 * vocab + 9 if plain else 4 * h)
    head_fixed = 0 if plain else 4 * vocab * h
    tokens = s * b
    rope = 2 * s * (h // heads) * 4
    mode = checkpointing_mode(model.activation_checkpointing if checkpointing is None else checkpointing)
    checkpointing = mode != "none"
    kept = {
        "full": [4 * h] * n_layers,
        "selective": [selective_layer_saved_bytes(model, s, c, i) for i in range(n_layers)],
        "none": per_layer,
    }[mode]
    layers = sum(kept) * tokens
    layer = max(per_layer)  # the layer being recomputed: the largest (DeepSeek's dense first layers differ)
    return {
        "layers": float(layers),
        "head": float(head_per_token * tokens + head_fixed),
        "input_ids": float(8 * tokens),
        "rope": float(0 if checkpointing else rope),
        "recompute_layer": float(layer * tokens + rope if checkpointing else 0),
        "total": float(layers + head_per_token * tokens + head_fixed + 8 * tokens + (0 if checkpointing else rope)),
    }


def selective_layer_saved_bytes(model, s: int, c: int, index: int = 0) -> int:
    """Bytes per token decoder layer `index` keeps under `selective` checkpointing
    (runner.training.checkpointing): its input (4h, fp32) and the outputs of its matmuls and of
    attention, in the compute dtype (c bytes): q c*h, k and v c*kv each, attention output c*h and
    4*heads logsumexp (sdpa; eager: scores and probabilities c*heads*s each), o_proj c*h (q/k norms,
    full or per head, save nothing more); dense MLP (Llama's, DeepSeek's dense first layers) gate and
    up c*f each, down c*h; MoE router logits c*E (every router's, the score routers' too: autocast
    runs their matmul in c from hidden.float()), per routed copy gate+up 2*c*f_e and down c*h;
    DeepSeek's shared experts gate and up c*f_s each, down c*h (f_s = shared_experts x
    shared_intermediate_size). Within 0.1% of the saved-tensor probe on CPU for OLMoE and DeepSeek-V3/V4
    layers (tests/training/test_moe_layer.py)."""
    h, heads = model.hidden_size, model.n_heads
    kv = model.n_kv_heads * (h // heads)
    attention = c * h + 2 * c * kv + c * h + c * h
    attention += 2 * c * heads * s if model.attn_implementation == "eager" else 4 * heads
    moe = model.moe
    if moe is not None and index >= moe.first_dense_layers:
        mlp = c * moe.n_experts + moe.experts_per_token * (2 * c * moe.expert_intermediate_size + c * h)
        shared = moe.shared_experts * moe.shared_intermediate_size
        mlp += 2 * c * shared + c * h if shared else 0
    else:
        mlp = 2 * c * model.intermediate_size + c * h
    return 4 * h + attention + mlp


def _router_score(moe, moe_index: int) -> str | None:
    """The score function of the router of MoE layer `moe_index` (counted after the dense first
    layers) as runner.training.moe.deepseek._router builds it (planning never imports the trainer):
    None for OLMoE's SoftmaxTopKRouter (every layer of a model without DeepSeek keys), else the
    scored routers' (HashRouter in the first `hash_layers`, ScoreTopKRouter after) `moe.router`."""
    if moe_index < moe.hash_layers:
        return str(moe.router)
    if moe.router == "softmax" and moe.routed_scaling_factor == 1.0 and moe.balancing == "aux_loss":
        return None
    return str(moe.router)


def _moe_mlp_saved_bytes(model, c: int, autocast: bool, moe_index: int) -> int:
    """Saved bytes per token of MoE layer `moe_index`'s MLP past its RMSNorm (the runner's layer,
    runner.training.moe; DeepSeek's parts from runner.training.moe.deepseek), with k routed copies
    per token. Probed on CPU in fp32 and bf16 autocast; dtypes are CPU autocast's (CUDA's runs
    softplus, softmax and sum in fp32: a few E-sized router terms more, not probed).
      router, OLMoE's softmax: input c*h, fp32 probabilities 4E, top-k ids, sort order, source rows
        (8 B each per copy) and sorted weights (4 per copy);
      router, scored (sigmoid / sqrt_softplus / softmax score, hash or top-k choice): input c*h (the
        cast of hidden.float() under autocast), scores c*E (sqrt_softplus: logits and scores, 2*c*E),
        chosen ids 8 per copy (the gather's index), with norm_topk_prob the chosen scores c per copy
        and their sum c; the permutation's sort order and source rows 8 each and sorted weights c
        per copy;
      routed, per copy: the grouped matmul's input c*h, gate+up 2*c*f_e, silu(gate) and product
        c*f_e each (swiglu_limit: the clamped gate and up c*f_e each more), down output c*h,
        weighted output 4h (the residual's dtype);
      shared experts (f_s = shared_experts x shared_intermediate_size): their input cast for gate
        and up under autocast (2*c*h; fp32 shares the router's input), gate, up, silu and product
        c*f_s each (swiglu_limit: clamped gate and up c*f_s each more); their sum with the routed
        output saves nothing."""
    moe, h = model.moe, model.hidden_size
    k, f_e, n_experts = moe.experts_per_token, moe.expert_intermediate_size, moe.n_experts
    score = _router_score(moe, moe_index)
    if score is None:
        router = c * h + 4 * n_experts + 28 * k
    else:
        scores = (2 if score == "sqrt_softplus" else 1) * c * n_experts
        router = c * h + scores + 8 * k + (c * k + c if moe.norm_topk_prob else 0) + 16 * k + c * k
    swiglu = 6 if moe.swiglu_limit is not None else 4
    routed = k * (2 * c * h + swiglu * c * f_e + 4 * h)
    f_s = moe.shared_experts * moe.shared_intermediate_size
    shared = (2 * c * h if autocast else 0) + swiglu * c * f_s if f_s else 0
    return router + routed + shared


def _decoder_layer_saved_bytes(model, s: int, c: int, autocast: bool, index: int = 0) -> tuple[int, int]:
    """(one RMSNorm's, decoder layer `index`'s) saved bytes per token, by saved_activation_bytes'
    formula. A mixture of experts (arch olmoe) adds, per layer as built: q/k norms (`model.qk_norm`
    full, OLMoE's, or unset: inputs c*h and c*kv, fp32 products 4h and 4kv, rsqrt 4 each; per_head:
    rsqrt 4 per head of q and of k instead; none: nothing); its MLP is DeepSeek's dense SwiGLU of
    model.intermediate_size (the dense MLP's count) in the first `moe.first_dense_layers` layers,
    else an MoE MLP (`_moe_mlp_saved_bytes`). Within 0.1% of the saved-tensor probe on CPU, fp32 and
    bf16 autocast, for OLMoE (cpu-tiny-moe) and DeepSeek-V3/V4 (cpu-tiny-moe-v3, -ds)."""
    h, f, heads = model.hidden_size, model.intermediate_size, model.n_heads
    kv = model.n_kv_heads * (h // heads)
    liger = model.kernels == "liger"
    norm = 4 * h + 4 + (0 if liger else 4 * h)
    if model.attn_implementation == "eager":
        scores = (4 + (c if autocast else 0)) * heads * s
        attention = norm + (3 if autocast else 1) * c * h + c * h + 2 * c * h + scores + c * h
    else:
        attention = norm + (3 if autocast else 1) * c * h + c * h + 2 * c * kv + 4 * heads + c * h
    mlp = norm + (2 if autocast else 1) * c * h + (3 if liger else 4) * c * f
    moe = model.moe
    if moe is not None:
        qk = model.qk_norm or "full"
        if qk != "none":
            rsqrt = 8 if qk == "full" else 4 * (heads + model.n_kv_heads)
            attention += c * h + c * kv + 4 * h + 4 * kv + rsqrt
        if index >= moe.first_dense_layers:
            mlp = norm + _moe_mlp_saved_bytes(model, c, autocast, index - moe.first_dense_layers)
    return norm, attention + mlp


def head_transient_bytes(cfg: ExperimentSchema | Mapping[str, Any], micro_batch: int | None = None) -> float:
    """Bytes alive at the loss's peak beyond what is saved: plain cross-entropy's backward holds the
    gradient of the log-softmax and of its input, fp32 [tokens, vocab] each, next to the saved
    log-softmax; the chunked and Liger losses hold one chunk's logits and gradient."""
    cfg = as_schema(cfg)
    vocab = params_of_config(cfg).embedding // cfg.model.hidden_size
    tokens = cfg.train.seq_len * (micro_batch if micro_batch is not None else cfg.train.micro_batch_sequences)
    if cfg.model.cross_entropy == "plain":
        return float(8 * vocab * tokens)
    return float(12 * vocab * min(tokens, CHUNKED_LOSS_TOKENS))


def autocast_weight_copy_params(cfg: ExperimentSchema | Mapping[str, Any]) -> int:
    """Parameters whose bf16 copy autocast makes and autograd keeps for the backward: a dense model's
    decoder-layer matmul weights, plus the LM head's under the plain loss (the chunked and Liger losses
    cast per chunk); norms and the embedding are never cast. Probed on the H200 at gpu-smoke's shape:
    2,428,502,016 bytes = 2 x the 24 layers' matmul weights exactly (bench/measurements/h200-20261204/
    probe.json). A mixture of experts counts every parameter eager; compiled, only the LM head's under
    the plain loss: its layers cast their weights inside the compiled region and the partitioner
    recomputes the cast from the fp32 parameter in the backward instead of keeping a copy (the
    OLMoE-1B-7B rows of the H200 bench leave no room for 12.9 GiB of copies: assumptions.
    COMPILE_SAVED_FRACTION_MOE)."""
    cfg = as_schema(cfg)
    counts = params_of_config(cfg)
    if counts.moe:
        if cfg.model.compile:
            return counts.embedding if cfg.model.cross_entropy == "plain" else 0
        return counts.all
    lay = counts.layer
    matmul = lay.attention + lay.mlp
    head = counts.embedding if cfg.model.cross_entropy == "plain" else 0  # lm_head: vocab x hidden
    return counts.n_layers * matmul + head


def grads_held_at_peak(cfg: ExperimentSchema, micro_batch: int) -> bool:
    """Whether the fp32 gradients are alive at the backward's peak: when a step accumulates several
    micro batches (the earlier micro batches' gradients wait for the optimizer step) or DDP/FSDP hold
    them in communication buckets; a single micro batch per step on one device frees them at
    `zero_grad(set_to_none=True)`, so its backward peak (the loss's) comes before any gradient exists."""
    if cfg.hardware.distributed != "none":
        return True
    return cfg.train.global_batch_sequences // max(1, devices(cfg)) > micro_batch


def memory_per_device(
    cfg: ExperimentSchema | Mapping[str, Any], micro_batch: int | None = None, *, grads_held: bool | None = None
) -> dict[str, Any]:
    """Bytes per device at the training step's peak, with the assumptions stated in the result.

    Model state (per parameter): bf16 mixed precision keeps fp32 master weights (4 B), fp32 grads
    (4 B), AdamW's two fp32 moments (8 B), plus the bf16 copies autocast makes of the matmul weights
    (`autocast_weight_copy_params`, 2 B each: saved for the backward, so alive through it); fp32 drops
    the copies. FSDP (full shard) divides model state by the devices; DDP and single device hold it all.

    The peak is the larger of two moments (SPEC "Memory plan"):
      backward: at the loss's backward, weights + moments + copies + activations, plus the gradients
        only when `grads_held_at_peak` (accumulation or DDP/FSDP; `grads_held` overrides);
      optimizer step: weights + gradients + moments (fused AdamW's per-tensor temporaries not counted).
    Activations: `saved_activation_bytes` (what eager autograd keeps, calibrated against the
    saved-tensor probe) plus `head_transient_bytes` (the loss's peak); with `model.compile` the decoder
    layers' part times the measured fraction torch.compile leaves (runner.planning.assumptions.
    COMPILE_SAVED_FRACTION, by scope and kernels: the H200 bench); with activation checkpointing, the
    layer inputs, one recomputed layer (eager count, an upper bound under compile) and the head.
    `micro_batch` overrides the recipe's (the automatic micro batch asks what each candidate needs).
    Not counted: CUDA context, allocator fragmentation, communication buffers
    (AUTO_MICRO_BATCH_MEMORY_FRACTION leaves room for them). Measured against max_memory_allocated of
    every H200 bench row: tests/planning/test_memory_measured.py. `model.activation_checkpointing`
    is none, full or selective (runner.training.checkpointing): each mode's activations are counted.
    A mixture of experts (OLMoE) counts every expert in model state (all of them live in memory
    whichever a token uses); its activations (the runner's MoE layer) are calibrated by the probe
    like the dense model's, in each checkpointing mode.
    """
    cfg = as_schema(cfg)
    train, hw = cfg.train, cfg.hardware
    counts = params_of_config(cfg)
    n_params = counts.all
    precision = hw.precision
    shard = devices(cfg) if hw.distributed == "fsdp" else 1
    state = {
        "weights (fp32 master)": 4 * n_params / shard,
        "grads (fp32)": 4 * n_params / shard,
        "adamw moments (2 x fp32)": 8 * n_params / shard,
    }
    if precision == "bf16":
        state["bf16 autocast weight copies"] = 2 * autocast_weight_copy_params(cfg) / shard

    b = micro_batch if micro_batch is not None else train.micro_batch_sequences
    mode = checkpointing_mode(cfg.model.activation_checkpointing)
    checkpointing = mode != "none"
    held = grads_held_at_peak(cfg, b) if grads_held is None else grads_held
    transient = head_transient_bytes(cfg, b)
    saved = {m: saved_activation_bytes(cfg, b, checkpointing=m) for m in AC_MODES}
    compiled = compile_saved_fraction(cfg)
    fraction = compiled["fraction"] if compiled else 1.0
    by_mode = {m: saved[m]["total"] + saved[m]["recompute_layer"] + transient for m in AC_MODES}
    # compile's measured saving applies to what eager autograd keeps of the decoder layers in the
    # model's mode (no checkpointing; a mixture of experts' selective mode too)
    by_mode[mode] -= (1.0 - fraction) * saved[mode]["layers"]
    full, checkpointed = by_mode["none"], by_mode["full"]
    activations = by_mode[mode]
    state_total = sum(state.values())
    held_state = state_total - (0 if held else state["grads (fp32)"])
    backward = held_state + activations
    step = sum(state[k] for k in ("weights (fp32 master)", "grads (fp32)", "adamw moments (2 x fp32)"))
    total = max(backward, step)
    capacity = hw.memory_gib * GIB
    return {
        "precision": precision,
        "sharded_over_devices": shard,
        "params": n_params,
        "model_state_bytes": state,
        "model_state_total_bytes": state_total,
        "grads_held_at_peak": held,
        "backward_peak_bytes": backward,
        "optimizer_step_peak_bytes": step,
        "activation_bytes_saved": saved[mode]["total"],
        "head_transient_bytes": transient,
        "activation_bytes_full": full,
        "activation_bytes_checkpointed": checkpointed,
        "activation_bytes_selective": by_mode["selective"],
        "activation_checkpointing": checkpointing,
        "activation_checkpointing_mode": mode,
        "activation_bytes": activations,
        "compile_saved_fraction": compiled,
        "micro_batch_sequences": b,
        "seq_len": train.seq_len,
        "cross_entropy": cfg.model.cross_entropy,
        "total_bytes": total,
        "capacity_bytes": capacity,
        "fits": bool(capacity) and total <= capacity,
        "fits_with_checkpointing": bool(capacity) and max(held_state + checkpointed, step) <= capacity,
        "assumptions": MEMORY_ASSUMPTIONS[precision],
    }


def compile_saved_fraction(cfg: ExperimentSchema) -> dict[str, Any] | None:
    """The measured fraction of the eager decoder layers' saved bytes torch.compile leaves, with its
    source, for this model's compile scope and kernels (None: not compiled, or checkpointed; a mixture
    of experts: by scope and checkpointing mode, assumptions.COMPILE_SAVED_FRACTION_MOE, `none` as the
    dense model's)."""
    model = cfg.model
    mode = checkpointing_mode(model.activation_checkpointing)
    if not model.compile:
        return None
    kernels = "liger" if model.kernels == "liger" else "none"
    if model.moe is not None and (str(model.compile_scope), mode) in assumptions.COMPILE_SAVED_FRACTION_MOE:
        fraction, source = assumptions.COMPILE_SAVED_FRACTION_MOE[(str(model.compile_scope), mode)]
        return {
            "scope": str(model.compile_scope),
            "kernels": kernels,
            "mode": mode,
            "fraction": fraction,
            "source": source,
        }
    if mode != "none":
        return None
    key = (str(model.compile_scope), kernels)
    fraction, source = assumptions.COMPILE_SAVED_FRACTION.get(key, (1.0, "not measured: the eager count"))
    return {"scope": key[0], "kernels": key[1], "mode": mode, "fraction": fraction, "source": source}


def choose_micro_batch(
    cfg: ExperimentSchema | Mapping[str, Any], world: int, device_bytes: int | None = None
) -> tuple[int, str]:
    """`train.micro_batch_policy: auto`: the largest micro batch <= train.micro_batch_sequences that
    divides the per-device batch and whose planned memory fits AUTO_MICRO_BATCH_MEMORY_FRACTION of the
    device (the hardware recipe's memory_gib, or what the device really holds when smaller).
    Returns it and one line saying why; none fitting is a RunnerError (the global batch never changes)."""
    cfg = as_schema(cfg)
    per_device = cfg.train.global_batch_sequences // world
    cap = cfg.train.micro_batch_sequences
    capacity = (cfg.hardware.memory_gib or 0) * GIB
    if device_bytes:
        capacity = min(capacity, float(device_bytes)) if capacity else float(device_bytes)
    budget = capacity * AUTO_MICRO_BATCH_MEMORY_FRACTION
    candidates = [m for m in range(min(cap, per_device), 0, -1) if per_device % m == 0]
    sharing = cfg.hardware.distributed != "none"
    for m in candidates:
        need = memory_per_device(cfg, m, grads_held=sharing or per_device > m)["total_bytes"]
        if need <= budget:
            return m, (
                f"auto: micro batch {m} of <= {cap} (per-device batch {per_device}): planned "
                f"{need / GIB:,.1f} GiB of {budget / GIB:,.1f} GiB ({AUTO_MICRO_BATCH_MEMORY_FRACTION:.0%} "
                f"of {capacity / GIB:,.1f} GiB)"
            )
    smallest = memory_per_device(cfg, 1, grads_held=sharing or per_device > 1)["total_bytes"]
    raise RunnerError(
        f"micro_batch_policy auto: even micro batch 1 plans {smallest / GIB:,.1f} GiB, over "
        f"{budget / GIB:,.1f} GiB ({AUTO_MICRO_BATCH_MEMORY_FRACTION:.0%} of {capacity / GIB:,.1f} GiB): turn on "
        "model.activation_checkpointing, shard with hardware.distributed: fsdp, or use a larger device",
        key="train.micro_batch_sequences",
    )
