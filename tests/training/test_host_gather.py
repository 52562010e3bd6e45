"""A checkpoint is gathered whole in rank 0's host memory: validate refuses a node that cannot hold it,
the plan says whether it fits, and the host memory is operational (not part of the fingerprint)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conftest import REPO

from runner.config.fingerprint import fingerprint
from runner.config.load import load_experiment
from runner.errors import Problems
from runner.planning.plan import build_plan
from runner.planning.plan_text import format_plan
from runner.planning.resources import check_host_gather

OLMOE = REPO / "experiments" / "olmoe-1b-7b.yaml"  # 6.9B parameters: 77.33 GiB gathered


def _with_host(cfg, gib):
    return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, host_memory_gib=gib))


def test_host_memory_that_cannot_hold_the_gathered_checkpoint_is_refused_naming_the_key(tmp_path):
    cfg = load_experiment(OLMOE, check_files=False).config
    problems = Problems()
    assert check_host_gather(_with_host(cfg, 64), Path("x.yaml"), problems) == []
    assert len(problems.lines) == 1 and "hardware.host_memory_gib" in problems.lines[0]
    assert "77.33 GiB" in problems.lines[0] and "64 GiB" in problems.lines[0]
    fits = Problems()
    assert check_host_gather(_with_host(cfg, 128), Path("x.yaml"), fits) == [] and not fits.lines
    unknown = Problems()
    notes = check_host_gather(cfg, Path("x.yaml"), unknown)
    assert not unknown.lines and len(notes) == 1 and "host_memory_gib: unknown" in notes[0]
    assert fingerprint(_with_host(cfg, 64)) == fingerprint(cfg)  # operational
    assert "does NOT fit in 64" in format_plan(build_plan(_with_host(cfg, 64), root=tmp_path))
    assert "fits in 128" in format_plan(build_plan(_with_host(cfg, 128), root=tmp_path))
