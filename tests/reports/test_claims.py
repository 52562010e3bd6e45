"""`runner audit-claims`: implied MFU of published claims and the flags on impossible ones."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from runner.cli.report import register
from runner.errors import RunnerError
from runner.reports.claims.training import audit_claim, audit_claims

SEEDS = Path(__file__).resolve().parents[2] / "reports" / "claims" / "seeds.yaml"


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


# ---- mixture claims (issue 26) ---------------------------------------------------------------------------
CLAIMS_DIR = SEEDS.parent
CPU_TINY_REPORT = CLAIMS_DIR.parent / "cpu-tiny" / "20261201-crash-resume"


def _mix(*sources, tokens=10e9, kind="exposure", **extra):
    claim = {"name": "m", "tokens": tokens, "mixture": [dict(s) for s in sources], **extra}
    if kind is not None:
        claim["token_kind"] = kind
    return claim


SMALL = {"source": "small", "tokens": 100e6, "weight": "30%", "epochs": 30}
WEB = {"source": "web", "tokens": 20e9, "weight": "70%", "epochs": 0.35}


def _severities(r):
    return sorted(f.severity for f in r.flags)


def test_a_small_pool_at_30_percent_of_10b_is_30_epochs_and_a_repetition_warning():
    r = audit_claim(_mix(SMALL, WEB))
    small, web = r.mixture.rows
    assert small.implied_epochs == pytest.approx(0.30 * 10e9 / 100e6) == pytest.approx(30)
    assert web.implied_epochs == pytest.approx(0.70 * 10e9 / 20e9) == pytest.approx(0.35)
    # Muennighoff et al. 2023 eq. 5 by hand: U = 1, R = 29, R* = 15.4: D' = 1 + 15.4 (1 - e^(-29/15.4)) = 14.06, / 30 = 0.4686.
    assert (
        small.repeated_value
        == pytest.approx((1 + 15.4 * (1 - math.exp(-29 / 15.4))) / 30)
        == pytest.approx(0.4686, abs=1e-4)
    )
    assert web.repeated_value == 1.0 and web.verdict == "ok" and small.verdict == "WARNING"
    assert r.verdict == "WARNING" and not r.failing and _severities(r) == ["warning"]
    message = r.flags[0].message
    assert "D'/D = 0.47" in message and "Muennighoff et al. 2023 eq. 5" in message and "R* = 15.4" in message
    # 5 epochs: (1 + 15.4 (1 - e^(-4/15.4))) / 5 = 0.905, no warning; 6 epochs: 0.878, a warning.
    five = audit_claim(_mix({**SMALL, "weight": "5%", "epochs": 5}, {**WEB, "weight": "95%", "epochs": 0.475}))
    assert five.mixture.rows[0].repeated_value == pytest.approx(0.9045, abs=1e-4) and five.verdict == "ok"
    six = audit_claim(_mix({**SMALL, "weight": "6%", "epochs": 6}, {**WEB, "weight": "94%", "epochs": 0.47}))
    assert six.mixture.rows[0].repeated_value == pytest.approx(0.8782, abs=1e-4) and six.verdict == "WARNING"


def test_stated_epochs_more_than_10_percent_off_are_inconsistent_and_say_what_reconciles_them():
    r = audit_claim(_mix({**SMALL, "epochs": 3}, WEB))
    assert r.verdict == "IMPOSSIBLE" and r.failing  # 3 x 100M + 0.35 x 20B = 7.3B cannot hold 10B
    inconsistent = [f.message for f in r.flags if f.severity == "inconsistent"]
    assert inconsistent == [
        "small: stated 3 epochs, implied 30 (29.5-30.5 within the weight's printed digits; = weight 30% x total "
        "10B / 100M tokens), more than 10% apart; "
        "reconciled by 1B tokens in the source; or weight 3%; or a total of 1B"
    ]
    assert r.mixture.rows[0].verdict == "INCONSISTENT"
    capacity = next(f.message for f in r.flags if f.severity == "impossible")
    # 100M x (3 + 0.5) + 20B x (0.35 + 0.005) = 7.45B, the stated epochs' printed rounding included
    assert "exceeds what the sources hold at their stated epochs (sum of source x epochs = 7.45B)" in capacity
    # 10% is the bound: 27.5 is 8.3% off 30 (ok), 26.9 is 10.3% off (inconsistent).
    assert "inconsistent" not in _severities(audit_claim(_mix({**SMALL, "epochs": 27.5}, WEB)))
    assert "inconsistent" in _severities(audit_claim(_mix({**SMALL, "epochs": 26.9}, WEB)))


def test_weights_must_sum_to_one_within_half_a_unit_of_their_last_printed_digit():
    def sources(*weights):
        return [{"source": f"s{i}", "tokens": 1e12, "weight": w} for i, w in enumerate(weights)]

    def flagged(*weights):
        r = audit_claim(_mix(*sources(*weights)))
        return [f.message for f in r.flags if "weights sum" in f.message]

    assert not flagged("33.3%", "33.3%", "33.3%")  # 99.9%, +-0.15% allowed
    assert not flagged("33%", "33%", "33%")  # 99%, +-1.5%
    assert not flagged(0.333, 0.333, 0.333)  # numbers: their shortest repr's digits, +-0.0015
    assert flagged("33.3%", "33.3%", "33.0%") == [
        "weights sum to 99.6000%; their printed digits allow 100% +- 0.150% (half a unit of the last digit per weight)"
    ]
    assert flagged(0.5, 0.7) and not flagged(0.5, 0.6)  # 120% and 110%, +-0.1 allowed
    r = audit_claim(_mix(*sources("33.3%", "33.3%", "33.0%")))
    assert r.mixture.weight_tolerance == pytest.approx(0.0015) and r.verdict == "INCONSISTENT"


def test_tokens_seen_above_what_a_source_holds_at_its_stated_epochs_is_impossible():
    # 1B tokens at 2.0 epochs hold 2.05B at most (the printed 2.0 allows 2.05); 25% of 10B is 2.5B.
    source = {"source": "a", "tokens": 1e9, "weight": "25%", "epochs": 2.0, "tokens_seen": 2.5e9}
    rest = {"source": "b", "tokens": 7.5e12, "weight": "75%"}
    r = audit_claim(_mix(source, rest))
    assert r.verdict == "IMPOSSIBLE"
    assert any("a: 2.5B tokens seen exceed what the source holds at its stated 2 epochs" in f.message for f in r.flags)
    # The printed "2" allows 2.5 epochs: 2.5B fits, and 2.5 epochs is what 25% of 10B implies.
    fits = audit_claim(_mix({**source, "epochs": 2}, rest))
    # (and by the same printed digits the stated epochs are consistent with the implied: a note, issue 37)
    assert fits.verdict == "ok" and [f.severity for f in fits.flags] == ["note"], fits.flags
    # Stated tokens seen against weight x total: 2.0B stated where 2.5B is implied is 20% off.
    seen = audit_claim(_mix({**source, "epochs": 2.5, "tokens_seen": 2.0e9}, rest))
    assert [f.severity for f in seen.flags] == ["inconsistent"]
    assert "stated 2B tokens seen, implied 2.5B tokens (weight x total; 2.45B-2.55B within" in seen.flags[0].message


def test_a_total_of_unstated_or_unique_kind_is_incomparable():
    r = audit_claim(_mix(SMALL, WEB, kind=None))
    assert r.verdict == "INCOMPARABLE" and not r.failing
    assert any("token kind unstated" in f.message for f in r.flags)
    assert r.mixture.rows[0].implied_epochs == pytest.approx(30)  # the arithmetic is still shown
    unique = audit_claim(_mix(SMALL, WEB, kind="unique"))
    assert unique.verdict == "INCOMPARABLE" and unique.mixture.rows[0].implied_epochs is None
    assert any("epochs cannot be implied" in f.message for f in unique.flags)


def test_bytes_go_through_a_stated_bytes_per_token_with_its_source():
    disk = {"source": "web", "bytes": "4.2 GB", "weight": "100%", "epochs": 1.0}
    r = audit_claim(_mix(disk, tokens=1e9, bytes_per_token=4.2, bytes_per_token_source="the paper, section 2"))
    row = r.mixture.rows[0]
    assert row.size == pytest.approx(4.2e9 / 4.2) and row.implied_epochs == pytest.approx(1.0) and r.verdict == "ok"
    assert r.mixture.bytes_per_token_source == "the paper, section 2"
    # GiB are binary: 1 GiB at 2**30 / 1e9 bytes per token is 1e9 tokens.
    gib = audit_claim(
        _mix({**disk, "bytes": "1 GiB"}, tokens=1e9, bytes_per_token=2**30 / 1e9, bytes_per_token_source="x")
    )
    assert gib.mixture.rows[0].size == pytest.approx(1e9)
    with pytest.raises(RunnerError, match="bytes_per_token_source: a stated bytes_per_token needs its source"):
        audit_claim(_mix(disk, tokens=1e9, bytes_per_token=4.2))
    with pytest.raises(RunnerError, match="bytes_per_token: source 'web' is in bytes and the total in tokens"):
        audit_claim(_mix(disk, tokens=1e9))
    # A table in bytes throughout needs no ratio: 2 x 50 GiB of a 100 GiB source at 100% is 1 epoch.
    in_bytes = audit_claim({"name": "b", "bytes": "100 GiB", "token_kind": "exposure", "mixture": [disk]})
    assert in_bytes.mixture.unit == "bytes" and in_bytes.mixture.rows[0].implied_epochs == pytest.approx(
        100 * 2**30 / 4.2e9
    )


def test_bytes_per_token_from_the_tables_own_totals():
    # Two sources of 400 GB and 100 GB at 80% / 20% of 100B tokens, stated 1 and 2 epochs: unique tokens
    # 0.8 x 100B / 1 + 0.2 x 100B / 2 = 90B; 500 GB / 90B = 5.556 bytes per token; then a holds 72B tokens
    # (implied 1.111 epochs, 11% off the stated 1: inconsistent) and b 18B (implied 1.111, 44% off 2).
    claim = _mix(
        {"source": "a", "bytes": "400 GB", "weight": "80%", "epochs": 1},
        {"source": "b", "bytes": "100 GB", "weight": "20%", "epochs": 2},
        tokens=100e9,
        bytes_per_token="from_table",
    )
    r = audit_claim(claim)
    assert r.mixture.bytes_per_token == pytest.approx(500e9 / 90e9)
    assert [row.size for row in r.mixture.rows] == pytest.approx([72e9, 18e9])
    assert [row.implied_epochs for row in r.mixture.rows] == pytest.approx([80 / 72, 20 / 18])
    with pytest.raises(RunnerError, match="from_table needs every source in bytes with its stated epochs"):
        audit_claim({**claim, "mixture": [{**claim["mixture"][0], "epochs": None}, claim["mixture"][1]]})
    with pytest.raises(RunnerError, match="tokens: a mixture needs the total it was sampled over"):
        audit_claim({k: v for k, v in claim.items() if k != "tokens"})
    b = next(f.message for f in r.flags if f.message.startswith("b:"))
    # b's stated 2 epochs hold if b tokenizes at 100 GB / 10B = 10 bytes per token
    assert "reconciled by 10B tokens in the source; or 10 bytes per token for it" in b


def test_the_published_mixture_tables_audit_as_reports_claims_readme_says(capsys):
    by_name = {r.name: r for r in audit_claims(CLAIMS_DIR / "mixtures.yaml")}
    llama = by_name["LLaMA-65B, Table 1"]
    # 6 x 65.2e9 x (380 x 2048) / (312e12 x 2048) = 47.6%; 1.4e12 / 778,240 / 86,400 = 20.8 days
    assert llama.implied_mfu == pytest.approx(6 * 65.2e9 * 380 / 312e12) == pytest.approx(0.476, abs=5e-4)
    assert llama.implied_days == pytest.approx(20.8, abs=0.05)
    # 4,749 GB over sum(weight x 1.4T / epochs) = 1.2635T unique tokens: 3.76 bytes per token
    unique = 1.4e12 * sum(w / e for w, e in [(0.67, 1.10), (0.15, 1.06), (0.045, 0.64), (0.045, 2.45)])
    unique += 1.4e12 * sum(w / e for w, e in [(0.045, 2.23), (0.025, 1.06), (0.02, 1.03)])
    assert llama.mixture.bytes_per_token == pytest.approx(4749e9 / unique) == pytest.approx(3.759, abs=1e-3)
    off = {row.source for row in llama.mixture.rows if row.verdict == "INCONSISTENT"}
    assert off == {"Github", "Wikipedia", "Books", "ArXiv", "StackExchange"} and llama.verdict == "INCONSISTENT"
    chinchilla = by_name["Chinchilla MassiveText, Table A1"]
    wiki = next(row for row in chinchilla.mixture.rows if row.source == "Wikipedia")
    # 0.001 TB at 4.49 bytes per token is 0.223B tokens: 1% of 1.4T is 62.8 passes, not the stated 3.40
    assert wiki.implied_epochs == pytest.approx(62.8, abs=0.1) and wiki.verdict == "INCONSISTENT"
    assert chinchilla.tokens_per_param_vs_chinchilla == pytest.approx(1.0)
    pile = by_name["The Pile, Table 1"]
    assert pile.verdict == "ok" and pile.mixture.unit == "bytes" and len(pile.mixture.rows) == 22
    assert abs(pile.mixture.weight_sum - 1) <= pile.mixture.weight_tolerance
    assert by_name["100M pool at 30% of 10B"].verdict == "WARNING"
    assert by_name["100M pool at 30%, epochs misstated"].verdict == "IMPOSSIBLE"
    # CI: every published claims file, as README "Auditing others' claims" documents: exit 1, because
    # seeds.yaml and mixtures.yaml carry flawed examples on purpose.
    files = sorted(str(p) for p in CLAIMS_DIR.glob("*.yaml"))
    assert _cli(["audit-claims", *files]) == 1
    out = capsys.readouterr().out
    assert "LLaMA-65B, Table 1" in out and "bytes per token 3.76" in out and "7B at 30K tok/s" in out
    readme = (CLAIMS_DIR / "README.md").read_text()
    for name, r in by_name.items():
        assert f"| {name} | {r.verdict} |" in readme, name


def test_a_claim_against_the_published_cpu_tiny_run(tmp_path, capsys):
    claim_file = CLAIMS_DIR / "cpu-tiny-run.yaml"
    assert _cli(["audit-claims", str(claim_file), "--against", str(CPU_TINY_REPORT)]) == 0
    out = capsys.readouterr().out
    assert "13 of 13 stated figures supported by the run" in out
    # The report's accounting: code exposure 153,600 of 307,200 (ratio 0.5), pool 388,992.
    claim = yaml.safe_load(claim_file.read_text())["claims"][0]
    claim["mixture"][0]["weight"] = "45%"  # the run sampled 50%
    claim["mixture"][1]["source"] = "law"  # the run has no such domain; its legal is then unclaimed
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"claims": [claim]}))
    assert _cli(["audit-claims", str(bad), "--against", str(CPU_TINY_REPORT), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)["against"]
    failed = {c["figure"]: (c["stated"], c["run"]) for c in result["checks"] if c["verdict"] == "NOT SUPPORTED"}
    assert failed == {
        "code: weight": ("0.45", "0.5"),
        "law: in the run": ("yes", "no"),
        "legal: in the claim": ("no", "yes"),
    }
    assert result["contradicted"] is True and result["run_audit"] == "UNVERIFIED"  # no MLflow store here
    # A report that fails its own audit supports nothing: its CSV copy of the accounting rewritten.
    forged = tmp_path / "forged"
    shutil.copytree(CPU_TINY_REPORT, forged)
    csv = forged / "accounting.csv"
    csv.write_text(csv.read_text().replace("153600", "153601", 1))
    assert _cli(["audit-claims", str(claim_file), "--against", str(forged)]) == 1
    out = capsys.readouterr().out
    assert "its own audit without MLflow: FAIL" in out and "its ledger supports no figure" in out


def test_claim_files_give_one_line_and_exit_2_on_bad_shapes(tmp_path, capsys):
    from runner.cli import main

    cases = {
        "weight": {"source": "a", "tokens": 1e9, "weight": "150%"},
        "tokens": {"source": "a", "tokens": ".nan", "weight": "50%"},
        "bytes": {"source": "a", "bytes": "3 parsecs", "weight": "50%"},
        "source": {"tokens": 1e9, "weight": "50%"},
    }
    for key, source in cases.items():
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({"claims": [_mix(source)]}))
        capsys.readouterr()
        assert main(["audit-claims", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and f"{key}.yaml" in err[0] and key in err[0], err


_TABLE = (
    {"source": "a", "bytes": "400 GB", "weight": "80%", "epochs": 1},
    {"source": "b", "bytes": "100 GB", "weight": "20%", "epochs": 2},
)


@pytest.mark.parametrize(
    "claim, key",
    [
        (_mix({**SMALL, "weight": [1]}, WEB), "weight"),
        (_mix({**SMALL, "weight": {"a": 1}}, WEB), "weight"),
        (_mix({**SMALL, "weight": 1e-320}, WEB), "weight"),
        # from_table: unique tokens = weight x 1e-320 / epochs underflow to 0, bytes per token infinite
        (_mix(*_TABLE, tokens=1e-320, bytes_per_token="from_table"), "tokens"),
        (_mix(_TABLE[0], {**_TABLE[1], "epochs": 1e-320}, tokens=100e9, bytes_per_token="from_table"), "epochs"),
        # tokens / (days x 86,400) is infinite: an "MFU inf%" verdict
        ({"name": "t", "model_params": 1e9, "hardware": "H100", "tokens": "1T", "days": 1e-320}, "days"),
    ],
    ids=["weight-list", "weight-mapping", "weight-1e-320", "total-1e-320", "epochs-1e-320", "days-1e-320"],
)
def test_a_figure_no_claim_can_state_is_one_line_not_a_traceback_or_an_infinite_verdict(tmp_path, capsys, claim, key):
    """A weight of another type was float()'s TypeError; a figure of 1e-320 divided to 0 (ZeroDivisionError)
    or to an infinite MFU. A claim's figures run from a billionth to a quintillion of their unit."""
    from runner.cli import main

    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"claims": [claim]}))
    capsys.readouterr()
    assert main(["audit-claims", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: claims[0]") and f": {key}: " in err[0], err


def _claim_fuzz_strategies():
    from hypothesis import strategies as st

    scalar = st.one_of(
        st.integers(min_value=-3, max_value=10**6),
        st.sampled_from([0, 2**63, 2**70, 10**27, 10**400]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.sampled_from(["3.3 TB", "1.4T", "4.5%", "150%", "-1%", "from_table", "exposure", "unique", "H100", "nan"]),
        st.booleans(),
        st.none(),
    )
    wild = st.recursive(
        scalar,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=5,
    )
    keys = [
        "name", "tokens", "bytes", "token_kind", "model_params", "active_params", "devices", "hardware", "mfu",
        "tokens_per_second", "days", "peak_tflops", "bytes_per_token", "bytes_per_token_source", "mixture", "extra",
        "mixture.0.source", "mixture.0.tokens", "mixture.0.bytes", "mixture.0.weight", "mixture.0.epochs",
        "mixture.0.tokens_seen", "mixture.0.bytes_per_token", "mixture.1", "mixture.1.weight", "mixture.1.other",
    ]  # fmt: skip
    change = st.tuples(st.sampled_from(keys), st.one_of(wild, st.just("<delete>")))
    yaml_text = st.text(alphabet=st.sampled_from(list("ab:- &*[]{},'\"!\n#%|>?.0123456789e+")), max_size=60)
    return st.lists(change, min_size=1, max_size=3), yaml_text


def _fuzzed_claim(changes) -> dict:
    claim = {
        "name": "fuzz",
        "model_params": 1e9,
        "hardware": "H100",
        "tokens_per_second": 40000,
        "tokens": "10B",
        "token_kind": "exposure",
        "mixture": [dict(SMALL), {**WEB, "bytes": "80 GB"}],
        "bytes_per_token": 4.0,
        "bytes_per_token_source": "fuzz",
    }
    del claim["mixture"][1]["tokens"]
    for path, value in changes:
        node: object = claim
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else None
            if node is None:
                break
        if isinstance(node, dict):
            if value == "<delete>":
                node.pop(leaf, None)
            else:
                node[leaf] = value
        elif isinstance(node, list) and leaf.isdigit() and int(leaf) < len(node) and value != "<delete>":
            node[int(leaf)] = value
    return claim


@pytest.mark.slow
def test_fuzzed_claim_files_exit_0_1_or_2_with_one_line_and_no_traceback(tmp_path, capsys, monkeypatch):
    """Every shape of a claim file: a verdict (0 or 1), or one `error: FILE: ...` line and exit 2."""
    import signal

    from hypothesis import HealthCheck, given, settings

    import runner.cli
    from runner.cli import main

    parser = runner.cli.build_parser()  # the real main, its parser built once (most of a call's time)
    monkeypatch.setattr(runner.cli, "build_parser", lambda: parser)

    path = tmp_path / "fuzz-claims.yaml"
    changes, yaml_text = _claim_fuzz_strategies()

    def expired(signum, frame):
        raise TimeoutError("audit-claims still running after 10 s: a hang")

    def check(text: str) -> None:
        path.write_text(text)
        capsys.readouterr()
        old = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, 10)
        try:
            code = main(["audit-claims", str(path), "--json"])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        err = capsys.readouterr().err.strip().splitlines()
        assert code in (0, 1, 2), (text, code)
        if code == 2:  # one line; YAML's own parse errors continue on lines of their own, as for recipes
            assert err and all(line.startswith("error: ") for line in err) and "fuzz-claims.yaml" in err[0], (text, err)
            assert len(err) == 1 or "not valid YAML" in err[0], (text, err)

    examples = int(os.environ.get("RUNNER_FUZZ_EXAMPLES", "60"))

    @settings(max_examples=2 * examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(changes)
    def values(change_list):
        check(yaml.safe_dump({"claims": [_fuzzed_claim(change_list)]}, allow_unicode=True))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(yaml_text)
    def shapes(text):
        check("claims:\n  - name: fuzz\n    tokens: 1e9\n    mixture:\n" + text)

    values()
    shapes()


def test_the_readme_example_output_is_what_audit_claims_prints(capsys):
    readme = (CLAIMS_DIR.parents[1] / "README.md").read_text()
    section = readme[readme.index("**Auditing others' claims.**") :]
    example = section[section.index("```text\n") + len("```text\n") : section.index("\n```", section.index("```text"))]
    assert _cli(["audit-claims", str(CLAIMS_DIR / "mixtures.yaml")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(example.splitlines()) >= 10 and all(line in out for line in example.splitlines())


@pytest.mark.parametrize("body", ["claims: []\n", "[]\n", "claims:\n", ""])
def test_an_empty_claims_file_is_one_line_and_a_non_zero_exit(tmp_path, capsys, body):
    """Issue 37 item 8: `claims: []` audited nothing and exited 0."""
    from runner.cli import main

    path = tmp_path / "empty.yaml"
    path.write_text(body)
    code = main(["audit-claims", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and len(err) == 1
        and err[0].endswith("empty.yaml: holds no claims: nothing to audit (state at least one under `claims:`)")
    ), (code, err)


def test_a_structured_source_is_checked_and_printed_with_the_verdict(tmp_path, capsys):
    """Issue 37 item 9: a claim's source names a title, a year and a URL, DOI or arXiv id, printed
    with the verdict; today's free text still reads, with one warning naming it."""
    from runner.cli import main

    base = "{name: a, model_params: 1.45e+9, tokens_per_second: 42000, token_kind: exposure, hardware: H200, "
    path = tmp_path / "c.yaml"
    path.write_text(
        "claims:\n"
        f"  - {base}source: {{title: 'LLaMA: Open and Efficient Foundation Language Models', year: 2023,"
        " arxiv: '2302.13971', section: Table 1}}\n"
        f"  - {base}source: {{title: T, year: 2020, doi: 10.18653/v1/2020.acl-main.1}}}}\n"
    )
    assert main(["audit-claims", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    rows = out.splitlines()
    at = next(i for i, line in enumerate(rows) if line.startswith("a ") and line.endswith("ok"))
    assert rows[at + 1] == (
        "    source: LLaMA: Open and Efficient Foundation Language Models (2023), Table 1; arXiv:2302.13971 "
        "(recorded, not fetched)"
    )
    assert "    source: T (2020); doi:10.18653/v1/2020.acl-main.1 (recorded, not fetched)" in rows
    assert audit_claims(path)[0].to_dict()["source"]["arxiv"] == "2302.13971"
    # today's format: free text, read with one warning naming it
    path.write_text(f"claims:\n  - {base}source: Touvron et al. 2023}}\n  - {base[:-2]}}}\n")
    assert main(["audit-claims", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == (
        f"warning: {path}: 2 of 2 claims state no structured source (claims[0] 'Touvron et al. 2023', "
        "claims[1] (none)): state source: {title, year, url or doi or arxiv} so a reader can find it"
    )
    assert "    source: 'Touvron et al. 2023' (free text: not checked)" in out.splitlines()
    # a structured source that a reader could not find, or malformed: one line naming the field
    for source, message in (
        ("{title: T, year: 2020}", "c.yaml: claims[0]: source: names no url, doi or arxiv id"),
        ("{title: T, year: twenty, arxiv: '2302.13971'}", "claims[0]: source.year: must be a year"),
        ("{title: T, year: 2020, arxiv: 'see the paper'}", "claims[0]: source.arxiv: must be an arXiv id"),
        ("{title: T, year: 2020, doi: 'doi.org'}", "claims[0]: source.doi: must be a DOI"),
        ("{title: T, year: 2020, url: 'ftp://x'}", "claims[0]: source.url: must be an http(s) URL"),
        ("{title: '', year: 2020, url: 'https://x.org'}", "claims[0]: source.title: must be a non-empty"),
        ("{title: T, year: 2020, url: 'https://x.org', page: 3}", "claims[0]: source: unknown keys ['page']"),
        ("[1]", "claims[0]: source: must be {title, year, and url, doi or arxiv}"),
    ):
        path.write_text(f"claims:\n  - {base}source: {source}}}\n")
        with pytest.raises(RunnerError, match=re.escape(message)):
            audit_claims(path)


def test_epochs_derived_from_a_rounded_weight_carry_its_printed_digits():
    """Issue 37 item 10: GPT-3's Wikipedia (Brown et al. 2020, Table 2.2: 3B tokens, weight "3%",
    3.4 epochs in 300B): "3%" covers 2.5-3.5%, which admits 3.4 epochs; the audit says so."""
    claim = {
        "name": "GPT-3 Wikipedia",
        "tokens": 300e9,
        "token_kind": "exposure",
        "mixture": [
            {"source": "Wikipedia", "tokens": 3e9, "weight": "3%", "epochs": 3.4},
            {"source": "rest", "tokens": 291e9, "weight": "97%", "epochs": 1.0},
        ],
    }
    r = audit_claim(claim)
    assert r.verdict == "ok" and not r.failing, r.flags
    assert [f.message for f in r.flags if f.severity == "note"] == [
        "Wikipedia: stated 3.4 epochs is 13% from the implied 3, within the 2.5-3.5 that the printed digits of the "
        "weight (3% +- 0.5%) and epochs allow: consistent"
    ]
    assert r.mixture.rows[0].verdict == "ok (printed digits)"
    claim["mixture"][0]["epochs"] = 3.6  # beyond 3.5 + 0.05
    r = audit_claim(claim)
    messages = [f.message for f in r.flags if f.severity == "inconsistent"]
    assert len(messages) == 1 and "implied 3 (2.5-3.5 within the weight's printed digits; " in messages[0], r.flags
    # the same for tokens seen: 9.8B stated, 9B implied (8.9% off: fine), 10.4B (15.6% off, within 7.5-10.5B)
    claim["mixture"][0].update(epochs=3.4, tokens_seen=10.4e9)
    notes = [f.message for f in audit_claim(claim).flags if f.severity == "note"]
    assert any("tokens seen" in m and "within that range: consistent" in m for m in notes), notes
