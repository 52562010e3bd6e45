"""The attention the runner records is the attention that runs: the pinned SDPA kernel (model.sdpa_kernel)
in training's forward and backward and in evaluation, and causal SDPA without a materialized mask under
either compile scope (what SDPA receives is read off the traced graph)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from trainfixtures import launch, make_project


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
