"""The chunked (fused head + loss) cross-entropy: the plain loss and gradients, less memory.

Memory is measured two honest ways: what autograd saves for the backward (saved-tensor hooks,
distinct storages), and the peak resident memory of a process that runs one forward and backward
(`ru_maxrss` growth in a fresh subprocess; CPU tensors come from malloc, whose large blocks are
mmapped and returned, so the high-water mark is the peak of live tensors plus a fixed baseline).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from timeouts import SUBPROCESS_TIMEOUT_S
from trainfixtures import env, launch, make_project

from runner.fsio import read_jsonl
from runner.training.loss import chunked_loss_sum, plain_loss_sum
from runner.training.memprobe import saved_bytes

REPO = Path(__file__).resolve().parents[2]


def _inputs(n=3, s=10, h=8, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, s, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n, s), generator=g)
    mask = torch.rand(n, s, generator=g) > 0.3
    return hidden, weight, targets, mask


def _plain(hidden, weight, targets, mask):
    return plain_loss_sum(hidden @ weight.t(), targets, mask)


@pytest.mark.parametrize("chunk", [1, 7, 30, 1000])
def test_chunked_equals_plain_loss_and_gradients_for_any_chunk(chunk):
    hidden, weight, targets, mask = _inputs()
    plain = _plain(hidden, weight, targets, mask)
    gh, gw = torch.autograd.grad(plain * 0.37, (hidden, weight))  # the trainer scales by world / useful
    fused = chunked_loss_sum(hidden, weight, targets, mask, chunk_tokens=chunk)
    fh, fw = torch.autograd.grad(fused * 0.37, (hidden, weight))
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(fh, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fw, gw, rtol=1e-5, atol=1e-6)


def test_masked_out_targets_contribute_nothing():
    hidden, weight, targets, mask = _inputs()
    none = torch.zeros_like(mask)
    loss = chunked_loss_sum(hidden, weight, targets, none, chunk_tokens=4)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert float(loss.detach()) == 0.0 and not gh.any() and not gw.any()


def test_without_gradients_it_only_computes_the_loss():
    hidden, weight, targets, mask = _inputs()
    with torch.no_grad():
        loss = chunked_loss_sum(hidden, weight, targets, mask, chunk_tokens=4)
    torch.testing.assert_close(loss, _plain(hidden, weight, targets, mask).detach(), rtol=1e-6, atol=1e-5)


def test_chunked_saves_no_logits_for_the_backward():
    n, s, h, v = 4, 64, 16, 2048
    hidden, weight, targets, mask = _inputs(n, s, h, v)
    module = torch.nn.Linear(1, 1)  # saved_bytes excludes the parameters of the module it is given
    plain = saved_bytes(module, lambda: _plain(hidden, weight, targets, mask))
    fused = saved_bytes(module, lambda: chunked_loss_sum(hidden, weight, targets, mask, chunk_tokens=32))
    logits_fp32 = n * s * v * 4
    assert plain.activations >= logits_fp32  # the log-softmax of every token's logits
    # d/dhidden [tokens, h] and d/dweight [v, h] in fp32, nothing per (token, vocab)
    assert fused.activations == n * s * h * 4 + v * h * 4


_PEAK = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    try:  # no transparent huge pages: a 2 MiB page per touched heap region would count memory no tensor holds
        ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    except (OSError, AttributeError):
        pass
    import torch
    from runner.training.loss import chunked_loss_sum, plain_loss_sum
    torch.set_num_threads(1)
    n, h, v = 1024, 64, 16384
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    warm = torch.randn(64, 64) @ torch.randn(64, 64)  # kernels and thread pools, before the baseline

    def status_kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    try:  # reset the peak resident set (Linux >= 4.0): a transient peak of the imports must not hide this one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        peak = lambda: status_kib("VmHWM")
        before = status_kib("VmRSS")
    except OSError:
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        before = peak()
    if sys.argv[1] == "plain":
        loss = plain_loss_sum(hidden @ weight.t(), targets, mask)
    else:
        loss = chunked_loss_sum(hidden, weight, targets, mask, chunk_tokens=128)
    loss.backward()
    after = peak()
    print(json.dumps({"growth_kib": after - before, "loss": float(loss), "grad": float(weight.grad.abs().sum())}))
    """
)


@pytest.mark.slow
def test_chunked_peak_memory_is_a_fraction_of_plain_in_a_fresh_process():
    runs = {}
    # glibc's fixed thresholds: every tensor over 128 KiB is its own mapping, returned when freed, so the
    # resident set follows the live tensors instead of how the heap's dynamic thresholds happened to move
    malloc_env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "MALLOC_TRIM_THRESHOLD_": "131072",
        "MALLOC_ARENA_MAX": "1",
    }
    for kind in ("plain", "chunked"):
        proc = subprocess.run(
            [sys.executable, "-c", _PEAK, kind],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=malloc_env,
            timeout=SUBPROCESS_TIMEOUT_S,
            check=True,
        )
        runs[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["chunked"]["loss"] == pytest.approx(runs["plain"]["loss"], rel=1e-5)
    assert runs["chunked"]["grad"] == pytest.approx(runs["plain"]["grad"], rel=1e-4)
    logits_kib = 1024 * 16384 * 4 // 1024  # one fp32 [tokens, vocab] tensor: 64 MiB
    assert runs["plain"]["growth_kib"] >= 2 * logits_kib  # logits, log-softmax, their gradients
    # measured here: plain 199 MiB, chunked 37 MiB (one chunk of logits, d/dW, allocator slack)
    assert runs["chunked"]["growth_kib"] < runs["plain"]["growth_kib"] / 3


@pytest.mark.slow
@pytest.mark.parametrize("distributed", ["none", "fsdp"])
def test_chunked_loss_over_two_processes_trains_what_one_process_with_the_plain_loss_trains(tmp_path, distributed):
    """The loss runs inside the model's forward, so DDP's gradient hooks and FSDP2's unsharding of the
    head see it as they see transformers' own; 2 ranks x 2 micro steps against 1 process."""
    runs = {}
    for name, loss in (("one", "plain"), ("two", "chunked")):
        root = tmp_path / name
        exp = make_project(root, steps=4, micro=2, checkpoint_every=4, eval_every=4)
        for kind, changes in (("model", {"cross_entropy": loss}), ("hardware", {"distributed": distributed})):
            path = next((root / "recipes" / kind).glob("*.yaml"))
            path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **changes}))
        runs[name] = root / "runs" / "r"
        if name == "one":
            launch(root, exp, "--run-dir", runs[name], "--no-tracking")
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
            + ["-m", "runner", "launch", str(exp), "--run-dir", str(runs[name]), "--no-tracking"],
            cwd=root,
            env=env(root),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((runs["two"] / "run.json").read_text())
    assert info["runtime"]["cross_entropy"] == "chunked" and info["devices"] == 2
    a, b = (read_jsonl(r / "metrics" / "train.jsonl") for r in (runs["one"], runs["two"]))
    assert len(a) == len(b) == 4 and all(x["loss"] == pytest.approx(y["loss"], rel=1e-5) for x, y in zip(a, b))
    wa, wb = (load_file(str(r / "checkpoints" / "step-0000004" / "model.safetensors")) for r in runs.values())
    assert set(wa) == set(wb) and max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
