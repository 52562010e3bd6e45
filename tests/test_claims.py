"""`runner audit-claims`: implied MFU of published claims and the flags on impossible ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from runner.cli.report import register
from runner.errors import RunnerError
from runner.reports.claims import audit_claim, audit_claims

SEEDS = Path(__file__).resolve().parents[1] / "reports" / "claims" / "seeds.yaml"


def _cli(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_seed_claims_implied_mfu():
    by_name = {r.name: r for r in audit_claims(SEEDS)}
    mi300x = by_name["760M on one MI300X"]
    assert mi300x.implied_mfu == pytest.approx(6 * 0.76e9 * 68e3 / 1307.4e12) == pytest.approx(0.237, abs=5e-4)
    h200 = by_name["1.45B on one H200"]
    assert h200.implied_mfu == pytest.approx(0.369, abs=5e-4)
    assert not mi300x.flags and not h200.flags


def test_seed_flawed_claims_are_flagged_and_exit_1(capsys):
    by_name = {r.name: r for r in audit_claims(SEEDS)}
    sparse = by_name["1.45B on H200, sparse peak"]
    assert sparse.impossible and any("sparse peak" in f.message for f in sparse.flags)
    assert any("disagrees" in f.message for f in sparse.flags)
    assert by_name["7B at 30K tok/s on one H100"].impossible
    unstated = by_name["1B on 2T tokens, kind unstated"]
    assert not unstated.impossible and any("token kind unstated" in f.message for f in unstated.flags)
    assert unstated.tokens_per_param_vs_chinchilla == pytest.approx(100)
    assert _cli(["audit-claims", str(SEEDS)]) == 1
    assert "6N" in capsys.readouterr().out
    assert _cli(["audit-claims", str(SEEDS), "--json"]) == 1
    assert len(json.loads(capsys.readouterr().out)) == 5


def test_clean_claims_file_exits_0(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        "- {name: a, model_params: 1.45e+9, tokens_per_second: 42000, token_kind: exposure,\n"
        "   hardware: NVIDIA H200, devices: 1, mfu: 0.36, tokens: '29e9'}\n"
    )
    assert _cli(["audit-claims", str(path)]) == 0
    r = audit_claims(path)[0]
    assert r.tokens_per_param == pytest.approx(20)
    assert r.implied_days == pytest.approx(29e9 / 42000 / 86400)


def test_implied_days_from_stated_mfu_and_over_100_percent():
    r = audit_claim(
        {
            "name": "x",
            "model_params": 1e9,
            "tokens": 1e12,
            "token_kind": "unique",
            "hardware": "MI355X",
            "devices": 8,
            "mfu": 0.4,
        }
    )
    assert r.implied_days == pytest.approx(6e21 / (0.4 * 2516.6e12 * 8) / 86400)
    assert audit_claim(
        {"name": "y", "model_params": 1e9, "mfu": 1.2, "token_kind": "useful", "hardware": "B200"}
    ).impossible


def test_bad_claims_are_runner_errors(tmp_path):
    with pytest.raises(RunnerError, match="model_params"):
        audit_claim({"name": "x", "model_params": -1})
    with pytest.raises(RunnerError, match="token_kind"):
        audit_claim({"name": "x", "model_params": 1e9, "token_kind": "tokens"})
    with pytest.raises(RunnerError, match="unknown keys"):
        audit_claim({"name": "x", "model_params": 1e9, "flops": 3})
    path = tmp_path / "bad.yaml"
    path.write_text("claims: 3\n")
    with pytest.raises(RunnerError, match="expected a list"):
        audit_claims(path)


def test_a_claim_implying_85_percent_mfu_is_implausible_not_impossible(tmp_path, capsys):
    # 6 * 1e9 * 140,165 tok/s / 989.4e12 = 85% of one H100 SXM: possible in principle, beyond any
    # published dense BF16 run (PLAUSIBLE_MFU's sources).
    claim = {
        "name": "1B at 140K tok/s on one H100",
        "model_params": 1e9,
        "tokens_per_second": 140_165,
        "token_kind": "processed",
        "hardware": "H100 SXM",
    }
    r = audit_claim(claim)
    assert r.implied_mfu == pytest.approx(0.85, abs=5e-4)
    assert r.implausible and not r.impossible and r.verdict == "IMPLAUSIBLE"
    flag = next(f for f in r.flags if f.severity == "implausible")
    assert "implied MFU 85.0% is above the plausibility bound 65%" in flag.message and "PaLM" in flag.message
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"claims": [claim]}))
    assert _cli(["audit-claims", str(path)]) == 1
    assert "IMPLAUSIBLE" in capsys.readouterr().out
    assert _cli(["audit-claims", str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["implausible"] is True
    # Over 100% stays impossible, and is not also called implausible.
    over = audit_claim({**claim, "tokens_per_second": 200_000})
    assert over.impossible and not over.implausible and over.verdict == "IMPOSSIBLE"


def test_plausibility_bound_applies_to_stated_mfu_and_can_be_set():
    below = {"name": "x", "model_params": 1e9, "token_kind": "useful", "hardware": "A100", "mfu": 0.6}
    assert not audit_claim(below).flags
    assert audit_claim({**below, "mfu": 0.7}).implausible  # a stated MFU above the bound, no throughput given
    assert audit_claim(below, plausible_mfu=0.5).implausible
    assert not any(r.implausible for r in audit_claims(SEEDS))  # 23.7% and 36.9% are ordinary
    with pytest.raises(RunnerError, match="plausible-mfu"):
        audit_claims(SEEDS, plausible_mfu=1.5)


# An OLMoE-1B-7B-class claim: 6.92B parameters in total, 1.18B active per token, 40K tokens/s on one H200.
OLMOE = {
    "name": "OLMoE-1B-7B on one H200",
    "model_params": 6.92e9,
    "active_params": 1.18e9,
    "tokens_per_second": 40_000,
    "token_kind": "processed",
    "hardware": "H200",
    "devices": 1,
    "tokens": 20e9,
}


def test_moe_claim_counts_active_parameters_for_mfu_and_days():
    r = audit_claim(OLMOE)
    # 6 x 1.18e9 x 40e3 / 989.4e12 = 28.6%; over all 6.92e9 it would be 168%, "impossible".
    assert r.implied_mfu == pytest.approx(6 * 1.18e9 * 40e3 / 989.4e12) == pytest.approx(0.286, abs=5e-4)
    assert r.params_counted == "active" and not r.flags
    assert r.implied_days == pytest.approx(20e9 / 40e3 / 86400)
    assert r.tokens_per_param == pytest.approx(20e9 / 6.92e9)  # tokens per parameter stays over the total
    dense_reading = audit_claim({k: v for k, v in OLMOE.items() if k != "active_params"})
    assert dense_reading.impossible and dense_reading.implied_mfu == pytest.approx(1.678, abs=1e-3)


def test_moe_claim_whose_mfu_counted_every_parameter_is_flagged(tmp_path, capsys):
    r = audit_claim({**OLMOE, "mfu": 1.68})
    assert r.impossible
    assert any("counts all 6,920,000,000 parameters of a mixture of experts" in f.message for f in r.flags)
    honest = audit_claim({**OLMOE, "mfu": 0.29, "tokens_per_second": None})
    assert not honest.flags
    assert honest.implied_days == pytest.approx(6 * 1.18e9 * 20e9 / (0.29 * 989.4e12) / 86400)
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump({"claims": [OLMOE]}))
    assert _cli(["audit-claims", str(path)]) == 0
    assert "1.18e+09 active" in capsys.readouterr().out


def test_moe_claim_with_more_active_than_total_parameters_is_refused():
    with pytest.raises(RunnerError, match="active_params: 7,000,000,000 active exceed the 6,920,000,000 model_params"):
        audit_claim({**OLMOE, "active_params": 7e9})
