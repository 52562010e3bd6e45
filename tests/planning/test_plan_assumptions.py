"""The MFU `runner plan` assumes per architecture, its source in the plan, and its precedence against
the hardware recipe's default_mfu, --mfu and --calibrate (runner.planning.assumptions, issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cli import main
from runner.config.load import load_experiment
from runner.planning.assumptions import MOE_TO_DENSE, assumed_mfu, carried_mfu, reference_mfu
from runner.planning.plan import Calibration, build_plan, format_plan

REPO = Path(__file__).resolve().parents[2]
# OLMoE 1.3B active x 24,400 tokens/s over OLMo-core 7B x 10,000 tokens/s, both per H100: 0.45314
RATIO = (1.3e9 * 24_400) / (7e9 * 10_000)


@pytest.fixture(scope="module")
def configs():
    load = lambda name: load_experiment(REPO / "experiments" / name, check_files=False).config  # noqa: E731
    return load("1p3b.yaml"), load("olmoe-1b-7b.yaml")


def test_the_reference_figures_by_hand():
    assert MOE_TO_DENSE == pytest.approx(RATIO) == pytest.approx(0.4531, abs=1e-4)
    assert reference_mfu("dense") == pytest.approx(6 * 7e9 * 10_000 / 989.4e12) == pytest.approx(0.4245, abs=1e-4)
    assert reference_mfu("moe") == pytest.approx(6 * 1.3e9 * 24_400 / 989.4e12) == pytest.approx(0.1924, abs=1e-4)
    assert reference_mfu("moe") / reference_mfu("dense") == pytest.approx(MOE_TO_DENSE)


def test_precedence_mfu_flag_then_the_recipes_default_mfu_scaled_by_architecture():
    dense = assumed_mfu("dense", 0.38, "h200-4x8-fsdp@1", None)
    assert dense.value == 0.38 and dense.rule == "hardware.default_mfu 38% (h200-4x8-fsdp@1, dense)"
    assert "OLMo-core 7B" in dense.source
    moe = assumed_mfu("moe", 0.38, "h200-4x8-fsdp@1", None)
    assert moe.value == pytest.approx(0.38 * RATIO) == pytest.approx(0.1722, abs=1e-4)
    assert moe.rule == "hardware.default_mfu 38% (h200-4x8-fsdp@1, dense) x 0.453 for a mixture of experts"
    assert "OLMoE-1B-7B" in moe.source and "24,400" in moe.source
    for arch in ("dense", "moe"):  # --mfu wins over both, as given
        given = assumed_mfu(arch, 0.38, "h200@1", 0.3)
        assert (given.value, given.rule, given.source) == (0.3, "--mfu 0.3", "given on the command line")


def test_the_plan_records_its_assumed_mfu_and_source(configs):
    dense_cfg, moe_cfg = configs
    dense = build_plan(dense_cfg, root=REPO)
    assert dense["time"]["assumed"]["mfu"] == dense_cfg.hardware.default_mfu == 0.4
    assert dense["assumptions"]["mfu"]["architecture"] == "dense"
    moe = build_plan(moe_cfg, root=REPO)
    assert moe["time"]["assumed"]["mfu"] == pytest.approx(0.4 * RATIO)
    assert moe["assumptions"]["mfu"]["rule"] == moe["time"]["assumed"]["mfu_rule"]
    text = format_plan(moe)
    assert "assumed MFU: hardware.default_mfu 40% (h200@1, dense) x 0.453 for a mixture of experts" in text
    assert build_plan(moe_cfg, root=REPO, mfu=0.25)["time"]["assumed"]["mfu"] == 0.25


def test_a_calibration_fills_the_measured_column_and_a_dense_runs_mfu_is_scaled_for_a_moe_plan(configs):
    _, moe_cfg = configs

    def calibration(**kw):
        base = dict(run_dir="r", steps=3, processed_tokens_per_second=40_000.0, useful_fraction=1.0)
        base |= dict(overhead_fraction=0.0, mfu=0.40, same_experiment=False, note="", architecture="dense")
        return Calibration(**(base | kw))

    plan = build_plan(moe_cfg, root=REPO, calibration=calibration())
    # the assumption is unchanged; the dense run's 40% is carried over as 40% x 0.4531 = 18.1%
    assert plan["time"]["assumed"]["mfu"] == pytest.approx(0.4 * RATIO)
    assert plan["time"]["measured"]["mfu"] == pytest.approx(0.40 * RATIO)
    assert "the calibration run is dense, this plan a mixture of experts" in format_plan(plan)
    same_arch = build_plan(moe_cfg, root=REPO, calibration=calibration(architecture="moe"))
    assert same_arch["time"]["measured"]["mfu"] == pytest.approx(0.40)
    # the same experiment: its measured tokens/s as they are, whatever the assumption
    own = build_plan(moe_cfg, root=REPO, calibration=calibration(same_experiment=True, architecture="moe"))
    assert own["time"]["measured"]["tokens_per_second"] == 40_000.0
    value, note = carried_mfu(0.2, "moe", "dense")  # a MoE run's MFU to a dense plan: as measured
    assert value == 0.2 and "a lower bound for a dense model" in note


def test_runner_plan_prints_the_assumed_mfu_and_its_source(capsys):
    assert main(["plan", str(REPO / "experiments/olmoe-1b-7b.yaml"), "--json"]) == 0

    plan = json.loads(capsys.readouterr().out)
    assert plan["assumptions"]["mfu"]["value"] == pytest.approx(0.4 * RATIO)
    assert plan["assumptions"]["mfu"]["source"].startswith("a fine-grained mixture of experts reaches 0.453")
