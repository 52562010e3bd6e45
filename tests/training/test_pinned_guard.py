"""Rank 0's pinned checkpoint buffers are taken only where the host can spare them: at most
runner.planning.resources.PINNED_HOST_FRACTION of its available memory at the attempt's start; else
the pageable copy, and run.json `runtime` says which and why (runner.training.staging.checkpoint_copy)."""

from __future__ import annotations

import pytest
import torch

from runner.planning.resources import PINNED_HOST_FRACTION, pinned_fit
from runner.training.staging import CheckpointCopy, checkpoint_copy, host_available_bytes, staging_bytes

GB = 10**9
CUDA = torch.device("cuda")  # a device by name: the choice touches none


def test_pinned_buffers_fit_under_half_of_the_available_memory_and_not_over_it():
    assert PINNED_HOST_FRACTION == 0.5
    # gpu-smoke's 15.6 GB on the measured H200 host (128 GiB, ~125 GB available): pinned
    smoke = pinned_fit(15.6 * GB, 125 * GB)
    assert (
        smoke.pinned and smoke.note == "pinned: 15.6 GB of buffers, 12% of the host's 125.0 GB available (at most 50%)"
    )
    # OLMoE-1B-7B's 6.9B parameters x 12 B = 83 GB on the same host: pageable
    olmoe = pinned_fit(83 * GB, 125 * GB)
    assert not olmoe.pinned and "83.0 GB would take 66% of the host's 125.0 GB available, over the 50%" in olmoe.note
    assert pinned_fit(50 * GB, 100 * GB).pinned and not pinned_fit(50 * GB + 1, 100 * GB).pinned  # the bound itself
    unknown = pinned_fit(1 * GB, None)
    assert not unknown.pinned and "available memory is unknown" in unknown.note


def test_the_choice_by_device_sharding_and_host():
    params = [torch.zeros(1000, 250), torch.zeros(250)]  # 250,250 fp32 parameters
    need = staging_bytes(params)
    assert need == 12 * 250_250  # the parameter and AdamW's two moments, 4 B each
    assert checkpoint_copy(CUDA, "none", params, 2 * need) == CheckpointCopy(True, pinned_fit(need, 2 * need).note)
    tight = checkpoint_copy(CUDA, "none", params, 2 * need - 1)
    assert not tight.pinned and tight.refused
    assert tight.record() == {"checkpoint_copy": "pageable", "checkpoint_copy_note": tight.note}
    fsdp = checkpoint_copy(CUDA, "fsdp", params, 10**15)  # FSDP's gather is the pageable copy already
    cpu = checkpoint_copy(torch.device("cpu"), "none", params, 10**15)
    for copy in (fsdp, cpu):
        assert not copy.pinned and not copy.refused  # nothing refused: no line said at the start
    assert "FSDP" in fsdp.note and "the device is the host" in cpu.note


def test_the_host_reports_its_available_memory():
    available = host_available_bytes()
    assert available is not None and available > 0


@pytest.mark.parametrize("available", [None, 0])
def test_an_unknown_host_pins_nothing(available):
    copy = checkpoint_copy(CUDA, "none", [torch.zeros(4)], available)
    assert not copy.pinned and copy.refused
