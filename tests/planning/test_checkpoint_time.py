"""`runner plan`'s t_checkpoint: the checkpoint's bytes over the sourced copy, disk and hashing rates; under
background writes the loop stops for the copy (and for the previous write when checkpoints come faster
than one is written), under foreground writes for the write too."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import REPO

from runner.config.load import load_experiment
from runner.planning import assumptions
from runner.planning.flops import params_of_config
from runner.planning.plan import SECONDS_PER_HOUR, build_plan
from runner.planning.plan_text import format_plan


def _with_checkpoint(cfg, **changes):
    ck = dataclasses.replace(cfg.train.checkpoint, **changes)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint=ck))


def test_t_checkpoint_of_1p3b_by_hand_in_both_write_modes(tmp_path):
    cfg = load_experiment(REPO / "experiments" / "1p3b.yaml", check_files=False).config
    size = 12 * params_of_config(cfg).all  # fp32 weights + AdamW's two moments: 15.6 GB
    copy = size / 55.2e9  # measured: device to pinned host buffers on a side stream (H200)
    write = size / 1.28e9  # measured: write + fsync 1.31 GB/s, sha256 1.28 GB/s, hashed beside the write
    assert (copy, write) == pytest.approx((0.309, 13.32), abs=0.01)  # 17.0 GB: the loop stalls < 1 s
    plan = build_plan(cfg, root=tmp_path)
    ck = plan["checkpoint_time"]
    pure = plan["time"]["assumed"]["pure_hours"] * SECONDS_PER_HOUR
    assert ck["write"] == "background" and ck["seconds_between"] > write  # hourly checkpoints: no wait
    assert ck["copy_seconds"] == pytest.approx(copy) and ck["write_seconds"] == pytest.approx(write)
    assert ck["stop_seconds"] == pytest.approx(copy)
    assert ck["t_checkpoint_hours"] == pytest.approx(ck["count"] * copy / SECONDS_PER_HOUR)
    assert ck["fraction_of_pure"] == pytest.approx(ck["count"] * copy / pure)
    text = format_plan(plan)
    assert "t_checkpoint (about" in text and "for the copy to pinned host memory (an upper bound" in text
    assert "pinned.json" in text and "commit 6b9382b" in text  # the rates' source
    # written in the loop, each checkpoint stops it for the write as well
    fg = build_plan(_with_checkpoint(cfg, write="foreground"), root=tmp_path)["checkpoint_time"]
    assert fg["stop_seconds"] == pytest.approx(copy + write) and fg["count"] == ck["count"]
    # behind the loop but every step of 32 devices: each checkpoint waits for the rest of the previous write
    nodes = load_experiment(REPO / "experiments" / "1p3b-4x8-fsdp.yaml", check_files=False).config
    every = build_plan(_with_checkpoint(nodes, interval_steps=1, interval_minutes=0), root=tmp_path)
    tight = every["checkpoint_time"]
    fsdp_copy = size / 1.59e9  # FSDP's gather copies into pageable memory (measured 9.80 s for 15.6 GB)
    assert tight["seconds_between"] < write
    assert tight["stop_seconds"] == pytest.approx(fsdp_copy + write - tight["seconds_between"])
    assert "and the previous write" in format_plan(every)


def test_a_cpu_run_copies_at_memcpy_speed():
    cfg = load_experiment(REPO / "experiments" / "cpu-tiny.yaml", check_files=False).config
    ck = build_plan(cfg)["checkpoint_time"]
    size = 12 * params_of_config(cfg).all
    assert ck["copy_seconds"] == pytest.approx(size / assumptions.HOST_MEMCPY_BYTES_PER_S)
    assert ck["count"] == 3  # 150 steps, one every 50


def _with_host(cfg, gib):
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, host_memory_gib=gib))


def test_the_plan_states_the_pinned_host_bytes_and_whether_the_stated_host_would_pin_them(tmp_path):
    cfg = load_experiment(REPO / "experiments" / "olmoe-1b-7b.yaml", check_files=False).config
    size = 12 * params_of_config(cfg).all  # 6.9B parameters: 83 GB of pinned buffers, held all run
    unknown = build_plan(cfg, root=tmp_path)["checkpoint_time"]
    assert unknown["pinned_host"] == {"bytes": size, "host_memory_bytes": None, "pinned": None, "fraction": 0.5}
    assert unknown["copy"] == "pinned"  # unstated host: the plan assumes the pinned path, and says so
    assert "held all run; pinned when at most 50%" in format_plan(build_plan(cfg, root=tmp_path))
    # the H200 device host (128 GiB): 83 GB is over half of it, so the loop copies into pageable memory
    small = build_plan(_with_host(cfg, 128), root=tmp_path)
    ck = small["checkpoint_time"]
    assert ck["pinned_host"]["pinned"] is False and ck["copy"] == "host"
    assert ck["copy_seconds"] == pytest.approx(size / assumptions.PAGEABLE_COPY_BYTES_PER_S)
    assert "NOT on 128.00 GiB (hardware.host_memory_gib): pageable copies" in format_plan(small)
    big = build_plan(_with_host(cfg, 512), root=tmp_path)["checkpoint_time"]
    assert big["pinned_host"]["pinned"] is True and big["copy"] == "pinned"
    # FSDP and CPU runs make no pinned copy: no row
    fsdp = load_experiment(REPO / "experiments" / "1p3b-4x8-fsdp.yaml", check_files=False).config
    cpu = load_experiment(REPO / "experiments" / "cpu-tiny.yaml", check_files=False).config
    for other in (fsdp, cpu):
        plan = build_plan(other, root=tmp_path)
        assert plan["checkpoint_time"]["pinned_host"] is None and "pinned host buffers" not in format_plan(plan)
