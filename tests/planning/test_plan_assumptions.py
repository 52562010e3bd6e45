"""The MFU `runner plan` assumes per architecture, its source in the plan, and its precedence against
the hardware recipe's default_mfu, --mfu and --calibrate (runner.planning.assumptions, issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cli import main
from runner.config.load import load_experiment
from runner.config.schema import ExperimentSchema
from runner.config.section import from_plain
from runner.planning import assumptions
from runner.planning.assumptions import MOE_TO_DENSE, assumed_mfu, carried_mfu, reference_mfu
from runner.planning.plan import Calibration, build_plan
from runner.planning.plan_text import format_plan

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


def test_the_plan_records_its_assumed_mfu_and_source(configs, monkeypatch):
    monkeypatch.setattr(assumptions, "MEASURED_MFU", ())  # no measured figure: the assumed path
    dense_cfg, moe_cfg = configs
    dense = build_plan(dense_cfg, root=REPO)
    assert dense["time"]["assumed"]["mfu"] == dense_cfg.hardware.default_mfu == 0.4
    assert dense["assumptions"]["mfu"]["architecture"] == "dense"
    moe = build_plan(moe_cfg, root=REPO)
    assert moe["time"]["assumed"]["mfu"] == pytest.approx(0.4 * RATIO)
    assert moe["assumptions"]["mfu"]["rule"] == moe["time"]["assumed"]["mfu_rule"]
    text = format_plan(moe)
    assert "MFU assumed: hardware.default_mfu 40% (h200@1, dense) x 0.453 for a mixture of experts" in text
    assert build_plan(moe_cfg, root=REPO, mfu=0.25)["time"]["assumed"]["mfu"] == 0.25


def test_a_calibration_fills_the_measured_column_and_a_dense_runs_mfu_is_scaled_for_a_moe_plan(configs, monkeypatch):
    monkeypatch.setattr(assumptions, "MEASURED_MFU", ())
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


def test_runner_plan_prints_the_mfu_it_used_and_its_source(capsys):
    assert main(["plan", str(REPO / "experiments/olmoe-1b-7b.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["assumptions"]["mfu"]["value"] == 0.144 and plan["assumptions"]["mfu"]["basis"] == "measured"
    assert main(["plan", str(REPO / "experiments/1p3b.yaml")]) == 0
    text = capsys.readouterr().out
    assert "MFU measured: measured 56.8%: the 1p3b recipe (whole-model compile, plain loss) on one H200" in text
    assert "commit 6b9382b" in text and "(4.9 d)" in text  # the 26B-token run: 117.1 h of pure training
    assert main(["plan", str(REPO / "experiments/1p3b-1x8-ddp.yaml")]) == 0
    assert "MFU assumed: hardware.default_mfu" in capsys.readouterr().out


def test_the_measured_h200_figures_are_used_for_their_own_configuration_only(configs):
    dense_cfg, moe_cfg = configs
    dense = build_plan(dense_cfg, root=REPO)
    a = dense["assumptions"]["mfu"]
    assert (a["value"], a["basis"]) == (0.568, "measured") and "commit 6b9382b" in a["source"] and "H200" in a["source"]
    # 26.0B tokens at 56.8% of 989.4 TFLOP/s, 9.112e9 FLOPs per token: 4.9 days of pure training
    days = 26_000_490_496 * 9_112_203_264 / (0.568 * 989.4e12) / 86_400
    assert dense["time"]["assumed"]["pure_hours"] / 24 == pytest.approx(days, rel=1e-9) == pytest.approx(4.88, abs=0.01)
    assert "MFU measured: measured 56.8%: the 1p3b recipe" in format_plan(dense)
    moe = build_plan(moe_cfg, root=REPO)["assumptions"]["mfu"]
    assert (moe["value"], moe["basis"]) == (0.144, "measured") and "bench-moe.json" in moe["source"]
    # the fast settings the bench measured (regional compile, selective checkpointing, micro batch 8): 31.2%
    fast = load_experiment(REPO / "experiments" / "olmoe-1b-7b.yaml", check_files=False).to_container()
    fast["model"].update(compile=True, compile_scope="regional", activation_checkpointing="selective")
    fast["train"]["micro_batch_sequences"] = 8
    m = build_plan(from_plain(ExperimentSchema, fast), root=REPO)["assumptions"]["mfu"]
    assert (m["value"], m["basis"]) == (0.312, "measured") and "regional compile, selective" in m["rule"]
    fast["train"]["micro_batch_sequences"] = 16  # not measured: assumed
    assert build_plan(from_plain(ExperimentSchema, fast), root=REPO)["assumptions"]["mfu"]["basis"] != "measured"
    # another hardware recipe, another speed setting, another model: assumed, as before
    plain = load_experiment(REPO / "experiments" / "1p3b.yaml", check_files=False).to_container()
    for key, value in (("hardware", "h200-1x8-ddp@1"), ("model", "llama-tiny@1")):
        other = {**plain, "recipes": {**plain["recipes"], key: value}}
        assert build_plan(other, root=REPO)["assumptions"]["mfu"]["basis"] == "assumed"
    regional = {**plain, "model": {**plain["model"], "compile_scope": "regional"}}
    assert build_plan(regional, root=REPO)["assumptions"]["mfu"]["basis"] == "assumed"
    assert build_plan(dense_cfg, root=REPO, mfu=0.3)["assumptions"]["mfu"]["basis"] == "--mfu"


def test_measured_figures_live_outside_the_recipes_so_no_default_mfu_moved():
    for name in ("h200.yaml", "h200-1x8-ddp.yaml", "h200-1x8-fsdp.yaml", "h200-4x8-fsdp.yaml"):
        text = (REPO / "recipes" / "hardware" / name).read_text()
        assert "default_mfu: 0.568" not in text and "default_mfu: 0.13" not in text
