"""The checkpoint's copy to host memory in reusable buffers (runner.training.staging.PinnedStaging)
and the files written and hashed in one pass; on the CPU here, the pinned GPU path in
tests/training/test_gpu.py::test_pinned_checkpoint_staging_on_the_gpu (same scenario code)."""

from __future__ import annotations

import hashlib

import torch
from gpufixtures import staging_scenario
from safetensors.torch import save_file

from runner.training.staging import PinnedStaging, save_safetensors_hashed


def test_staging_copies_the_checkpoint_state_reuses_its_buffers_and_never_changes_training():
    out = staging_scenario(torch.device("cpu"), b=1, s=32)  # the GPU test's code at a CPU's size
    assert out["staged_equal"] and out["second_equal"] and out["reused"]
    assert out["fresh"][1] == 0  # the second checkpoint allocated nothing
    for name, ref in out["reference_params"].items():  # training with staging = training without
        assert torch.equal(out["staged_params"][name], ref), name


def test_a_storage_under_two_names_is_staged_once_and_a_cpu_staging_copies_synchronously():
    w = torch.randn(4, 3)
    staging = PinnedStaging(torch.device("cpu"))
    staged = staging.stage({"a": w, "b": w}, {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 1}]})
    staged.ready()
    assert staged.model_state["a"] is staged.model_state["b"] and torch.equal(staged.model_state["a"], w)
    assert staged.model_state["a"].data_ptr() != w.data_ptr() and staging.pending is None
    assert staged.optimizer_state["param_groups"] == [{"lr": 1}]
    assert PinnedStaging.for_device(torch.device("cpu")) is None  # the loop stages only on a GPU


def test_the_one_pass_writer_is_byte_identical_to_safetensors_and_hashes_what_it_wrote(tmp_path):
    dtypes = [torch.float64, torch.int64, torch.float32, torch.int32, torch.bfloat16, torch.float16, torch.bool]
    tensors = {f"t.{i}": torch.ones(3, dtype=d) for i, d in enumerate(dtypes)}
    tensors |= {"big": torch.randn(3_000_000), "scalar": torch.tensor(2.0), "empty": torch.zeros(0)}
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    digest = save_safetensors_hashed(tensors, tmp_path / "mine.safetensors")
    ref, mine = (tmp_path / "ref.safetensors").read_bytes(), (tmp_path / "mine.safetensors").read_bytes()
    assert mine == ref and digest == hashlib.sha256(ref).hexdigest()
