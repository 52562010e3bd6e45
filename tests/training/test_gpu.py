"""What only a GPU can show: bf16 autocast steps, SDPA's flash kernel, fused AdamW, Liger's fused
linear cross-entropy and the runner's chunked loss against the plain one, regional compile, the memory
plan against the saved-tensor probe under CUDA autocast, and NVML's readings.

Marked `gpu` and skipped without a CUDA/ROCm device; bench/device_check.sh runs them first on a lent
machine (`pytest -m gpu tests/training/test_gpu.py`). Tiny shapes: each test takes seconds (compile: tens)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpufixtures import (
    batch,
    checkpoint_copy_scenario,
    loss_grads,
    plan_and_probe,
    regional_model,
    staging_scenario,
    tiny_model,
)

from runner.training.accelerator import check_attention_backend, device_identity
from runner.training.loss import chunked_loss_sum, liger_loss_sum, plain_loss_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]
DEV = torch.device("cuda")
BF16 = torch.bfloat16


# The setup is tests/gpufixtures.py: the same code runs on CPU in tests/training/test_gpu_setup.py.
def _batch():
    return batch(DEV)


def _model(**model):
    return tiny_model(DEV, "cuda", **model)


def _loss_grads(model, b):
    return loss_grads(model, b, BF16)


def _close(a: dict, b: dict, rel: float) -> None:
    for name, g in a.items():
        err = float((b[name] - g).norm() / g.norm().clamp_min(1e-12))
        assert err < rel, f"{name}: relative error {err:.2e}"


def test_bf16_autocast_step_keeps_fp32_master_weights_and_moves_them():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, grads = _loss_grads(model, _batch())
    assert torch.isfinite(loss) and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(g).all() for g in grads.values())
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_sdpa_flash_kernel_pinned_runs_and_matches_math():
    backend = check_attention_backend("sdpa", device_identity(), sdpa_kernel="flash")
    q, k, v = (torch.randn(2, 8, 256, 64, device=DEV, dtype=BF16) for _ in range(3))
    with backend.context():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_fused_adamw_matches_the_foreach_implementation():
    steps = {}
    for fused in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4096, 256, device=DEV))
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=fused, foreach=None if fused else True)
        for i in range(3):
            p.grad = torch.randn(4096, 256, device=DEV, generator=torch.Generator(DEV).manual_seed(i))
            opt.step()
        steps[fused] = p.detach()
    torch.testing.assert_close(steps[True], steps[False], rtol=1e-5, atol=1e-6)


def test_chunked_loss_equals_plain_under_bf16_autocast():
    plain = _loss_grads(_model(), _batch())
    chunked = _loss_grads(_model(cross_entropy="chunked"), _batch())
    torch.testing.assert_close(chunked[0], plain[0], rtol=2e-3, atol=0)
    _close(plain[1], chunked[1], 2e-2)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed")
def test_liger_fused_linear_cross_entropy_equals_plain_ce():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1024, 256, generator=g).to(DEV).requires_grad_()
    weight = (0.02 * torch.randn(4096, 256, generator=g)).to(DEV).requires_grad_()
    targets = torch.randint(0, 4096, (1024,), generator=g).to(DEV)
    mask = torch.rand(1024, generator=g).to(DEV) > 0.1
    out = {}
    for name, fn in (
        ("plain", lambda: plain_loss_sum(hidden @ weight.t(), targets, mask)),
        ("chunked", lambda: chunked_loss_sum(hidden, weight, targets, mask)),
        ("liger", lambda: liger_loss_sum(hidden, weight, targets, mask)),
    ):
        with torch.autocast("cuda", dtype=BF16):
            loss = fn()
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        out[name] = (loss.float(), gh.float(), gw.float())
    for name in ("liger", "chunked"):
        torch.testing.assert_close(out[name][0], out["plain"][0], rtol=5e-3, atol=0)
        for i in (1, 2):
            err = float((out[name][i] - out["plain"][i]).norm() / out["plain"][i].norm())
            assert err < 2e-2, (name, i, err)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed")
def test_liger_kernels_model_matches_transformers_own():
    plain = _loss_grads(_model(), _batch())
    liger = _loss_grads(_model(kernels="liger", cross_entropy="liger"), _batch())
    _model()  # building with kernels none puts transformers' RoPE back for the tests after this one
    torch.testing.assert_close(liger[0], plain[0], rtol=5e-3, atol=0)
    _close(plain[1], liger[1], 5e-2)


def test_regional_compile_matches_eager():
    eager = _loss_grads(_model(), _batch())
    compiled = _loss_grads(regional_model(DEV, "cuda"), _batch())
    torch.testing.assert_close(compiled[0], eager[0], rtol=5e-3, atol=0)
    _close(eager[1], compiled[1], 5e-2)
    torch._dynamo.reset()


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_memory_plan_matches_the_saved_tensor_probe_under_cuda_autocast(loss):
    planned, probe = plan_and_probe(DEV, loss, "cuda", BF16)
    assert abs(planned / probe.activations - 1) < 0.05, (planned, probe.to_dict())
    assert probe.peak_allocated is not None and probe.peak_allocated > probe.activations


def test_pinned_checkpoint_staging_on_the_gpu():
    """The loop's checkpoint copy on CUDA: pinned host buffers filled on a side stream, the next
    optimizer step ordered after them on the device, the buffers reused; training unchanged by it."""
    out = staging_scenario(DEV)
    assert out["pinned"] and out["on_host"] == {"cpu"}
    assert out["staged_equal"] and out["second_equal"] and out["reused"] and out["fresh"][1] == 0
    for name, ref in out["reference_params"].items():
        torch.testing.assert_close(out["staged_params"][name], ref, rtol=0, atol=0)


def test_pinned_buffers_only_where_the_host_can_spare_them():
    """The loop's choice on the GPU: a host with room gets pinned buffers (prefilled, every byte); one
    that cannot spare half its available memory for them gets none, and the line that says so."""
    roomy = checkpoint_copy_scenario(DEV, DEV, available_bytes=1 << 40)
    assert roomy["copy"].pinned and roomy["staging"] is not None
    assert roomy["staging"].allocated_bytes == roomy["need"]
    assert all(b.is_pinned() for bufs in roomy["staging"].pool.values() for b in bufs)
    tight = checkpoint_copy_scenario(DEV, DEV, available_bytes=roomy["need"])
    assert tight["staging"] is None and tight["copy"].refused
    assert tight["copy"].record()["checkpoint_copy"] == "pageable"


def test_nvml_reads_this_gpu():
    from runner.training.sysmetrics import SystemMonitor

    said = []
    mon = SystemMonitor(1.0, "rocm" if torch.version.hip else "cuda", report=said.append)
    x = torch.randn(4096, 4096, device=DEV)
    for _ in range(50):
        x = x @ x / 64
    torch.cuda.synchronize()
    row = mon.sample()
    assert not said, said
    assert 0 <= row["device_busy_percent"] <= 100
    assert 0 < row["device_memory_used_gib"] <= row["device_memory_total_gib"]
