"""The attention the runner records is the attention that runs: the pinned SDPA kernel (model.sdpa_kernel)
in training's forward and backward and in evaluation, and causal SDPA without a materialized mask under
either compile scope (what SDPA receives is read off the traced graph)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from trainfixtures import REPO, launch, make_project

from runner.config.load import load_experiment
from runner.config.schema import HardwareRecipe
from runner.training.model import build_model, maybe_compile


def _enabled_kernels() -> tuple[str, ...]:
    """The SDPA kernels torch may pick right now (torch.nn.attention.sdpa_kernel sets these flags)."""
    flags = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    return tuple(k for k, on in flags.items() if on)


class _BackwardProbe(torch.autograd.Function):
    """Identity whose backward notes the kernels allowed while SDPA's own backward runs next to it."""

    seen: list[tuple[str, ...]] = []

    @staticmethod
    def forward(ctx, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        _BackwardProbe.seen.append(_enabled_kernels())
        return grad


@pytest.mark.slow  # a launch: ~10 s on a loaded core
def test_pinned_sdpa_kernel_is_the_one_allowed_in_forward_backward_and_evaluation(tmp_path, monkeypatch):
    calls: list[tuple[bool, tuple[str, ...]]] = []
    real = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        if q.shape[-1] == 32 // 4:  # the model's head dim (not the backend check's own probe)
            calls.append((q.requires_grad, _enabled_kernels()))
        out = real(q, *args, **kwargs)
        return _BackwardProbe.apply(out) if out.requires_grad else out

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    _BackwardProbe.seen = []
    exp = make_project(tmp_path, steps=2, checkpoint_every=2, eval_every=2, model_extra={"sdpa_kernel": "math"})
    launch(tmp_path, exp, "--run-dir", tmp_path / "run")
    runtime = json.loads((tmp_path / "run" / "run.json").read_text())["runtime"]
    assert runtime["sdpa_kernel"] == "math"
    training = [k for grad, k in calls if grad]
    evaluation = [k for grad, k in calls if not grad]
    # 2 steps x 2 micro batches x 2 layers; an evaluation at step 2 over two domains
    assert len(training) == 8 and evaluation and len(_BackwardProbe.seen) == 8
    assert set(training) == set(evaluation) == set(_BackwardProbe.seen) == {("math",)}
    assert "math" in _enabled_kernels() and len(_enabled_kernels()) > 1  # the pin ended with the run


def _sdpa_calls(seen: list[tuple[bool, object]], monkeypatch):
    """A torch.compile backend that notes, for every SDPA in each traced graph, (mask given, is_causal);
    SDPA calls that run eagerly (a graph break: OLMoE's layers under activation checkpointing) are noted
    by a spy on torch's function."""
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if not torch.compiler.is_compiling():
            seen.append(
                (kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None, kwargs.get("is_causal"))
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        # subgraphs too: activation checkpointing traces a layer as a higher-order op's body
        for graph in (sub.graph for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)):
            for node in graph.nodes:
                if node.op == "call_function" and node.target in (real, spy):
                    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                    seen.append((mask is not None, node.kwargs.get("is_causal", False)))
        return gm.forward

    return backend


def _shrunk(exp_cfg):
    """A shipped GPU experiment at a CPU size, keeping what decides the attention path: arch, attention
    backend, compile scope, loss path, activation checkpointing (Liger, GPU-only, gives way)."""
    m = exp_cfg.model
    moe = m.moe and dataclasses.replace(m.moe, n_experts=4, experts_per_token=2, expert_intermediate_size=32)
    model = dataclasses.replace(
        m,
        hidden_size=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        intermediate_size=32 if moe else 64,
        moe=moe,
        pad_vocab_multiple=1,
        kernels="none",
        cross_entropy="chunked" if m.cross_entropy == "liger" else m.cross_entropy,
    )
    return dataclasses.replace(
        exp_cfg,
        model=model,
        tokenizer=dataclasses.replace(exp_cfg.tokenizer, vocab_size=64, eos_id=0),
        train=dataclasses.replace(exp_cfg.train, seq_len=16),
        hardware=HardwareRecipe(accelerator="cpu"),
    )


def _shipped_gpu_configs():
    """One shipped GPU experiment per distinct attention path (the 1p3b variants differ in hardware only)."""
    out = {}
    for path in sorted((REPO / "experiments").glob("*.yaml")):
        cfg = load_experiment(path, check_files=False).config
        if cfg.hardware.accelerator == "cpu":
            continue
        m = _shrunk(cfg).model
        path_key = (
            m.arch,
            m.attn_implementation,
            m.compile,
            m.compile_scope,
            m.cross_entropy,
            m.activation_checkpointing,
        )
        if path_key not in {k for k, _ in out.values()}:
            out[path.stem] = (path_key, cfg)
    return {name: cfg for name, (_, cfg) in out.items()}


@pytest.mark.slow  # dynamo traces 4 models: ~10 s on a loaded core
def test_every_shipped_gpu_recipe_runs_causal_sdpa_without_a_mask_under_its_compile(monkeypatch):
    """Whole-model compile used to trace transformers' mask builder, which then builds a [B,1,L,L] mask:
    SDPA ran with attn_mask and is_causal=False (no flash kernel). The traced graph shows what SDPA gets,
    for each shipped GPU experiment's compile (1p3b: whole model; gpu-smoke: regional; OLMoE: none)."""
    configs = _shipped_gpu_configs()
    seen: list[tuple[bool, object]] = []
    backend = _sdpa_calls(seen, monkeypatch)
    scopes = set()
    for name, shipped in configs.items():
        cfg = _shrunk(shipped)
        seen.clear()
        torch._dynamo.reset()
        scopes.add(cfg.model.compile_scope if cfg.model.compile else "eager")
        model = maybe_compile(build_model(cfg), cfg, backend=backend)
        x = torch.randint(0, 64, (2, 16))
        if cfg.model.arch == "olmoe":
            model(input_ids=x).logits.float().sum().backward()
        else:
            model(input_ids=x, loss_targets=x, loss_mask=torch.ones_like(x, dtype=torch.bool)).backward()
        assert seen and set(seen) == {(False, True)}, f"{name}: SDPA got (mask, is_causal) {sorted(set(seen))}"
    assert scopes == {"model", "regional", "eager"}
