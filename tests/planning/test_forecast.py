"""Forecast to a quality target: `runner plan --fit` inverts L(N, D) fitted to the target's quantity."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import yaml

from runner.config.load import load_experiment
from runner.planning.plan_text import format_plan
from runner.planning.scaling import Fit, Point, forecast_target, target_quantity, tokens_to_reach
from runner.reports.targets import declared_targets

# Two domains with known laws (Chinchilla's for web, 0.6 nats above it for prose), bits per byte at
# 0.5 x nats, validation tokens 3:1. The experiment forecast is 1p3b, whose mixture is `web`.
WEB = Fit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, objective=0.0, points=0)
PROSE_OFFSET = 0.6
WEIGHTS = {"web": 3000, "prose": 1000}


def pilots() -> list[Point]:
    out = []
    for n in np.geomspace(1e7, 1e9, 5):
        for d in np.geomspace(1e9, 1e11, 5):
            web = float(WEB.loss(n, d))
            losses = {"web": web, "prose": web + PROSE_OFFSET}
            out.append(
                Point(
                    f"n{n:.0e}-d{d:.0e}",
                    float(n),
                    float(d),
                    float(np.mean(list(losses.values()))),
                    losses,
                    "pilot",
                    {k: v * 0.5 for k, v in losses.items()},
                    dict(WEIGHTS),
                )
            )
    return out


def test_target_quantities_match_the_spec():
    p = pilots()[0]
    assert target_quantity(p, "web", "loss_nats") == p.domain_losses["web"]
    assert target_quantity(p, "prose", "bpb") == p.domain_bpb["prose"]
    want = (3000 * p.domain_losses["web"] + 1000 * p.domain_losses["prose"]) / 4000
    assert target_quantity(p, "mean", "loss_nats") == pytest.approx(want)
    old = Point("old", 1e8, 1e10, 3.0, {"web": 3.0})  # read by an older runner: no weights, no bpb
    assert target_quantity(old, "mean", "loss_nats") is None and target_quantity(old, "web", "bpb") is None


def test_each_target_is_forecast_from_a_fit_of_its_own_quantity(monkeypatch):
    import runner.planning.scaling as scaling

    fitted = []

    def fake_fit(points, *, losses=None, delta=None):
        fitted.append(list(losses))
        return WEB

    monkeypatch.setattr(scaling, "fit_loss", fake_fit)
    pts, fits = pilots(), {}
    for domain, metric in (("prose", "bpb"), ("mean", "loss_nats"), ("prose", "bpb")):
        assert forecast_target(pts, domain, metric, 2.3, 5e8, fits)["status"] == "reachable"
    assert len(fitted) == 2  # the second prose-bpb target reuses its fit
    assert fitted[0] == [p.domain_bpb["prose"] for p in pts]
    assert fitted[1] == pytest.approx([(3 * p.domain_losses["web"] + p.domain_losses["prose"]) / 4 for p in pts])


def test_tokens_to_reach_inverts_the_law():
    n = 5e8
    d = tokens_to_reach(WEB, n, 2.3)
    assert float(WEB.loss(n, d)) == pytest.approx(2.3, rel=1e-12)
    assert math.isinf(tokens_to_reach(WEB, n, WEB.E + WEB.A / n**WEB.alpha))


def test_forecast_reports_tokens_flops_and_flags():
    pts, n = pilots(), 5e8
    known = {("web", "loss_nats"): WEB}  # a fit already made: only the inversion is exercised here
    ok = forecast_target(pts, "web", "loss_nats", 2.3, n, known)
    assert ok["status"] == "reachable" and ok["flags"] == []
    assert ok["tokens"] == pytest.approx(tokens_to_reach(WEB, n, 2.3)) and ok["flops"] == pytest.approx(
        6 * n * ok["tokens"]
    )
    below = forecast_target(pts, "web", "loss_nats", 1.5, n, known)
    assert below["status"] == "below floor" and below["detail"].startswith(
        "1.5 is at or below the fitted floor E = 1.69"
    )
    small = forecast_target(pts, "web", "loss_nats", 2.0, 1e7, known)
    assert small["status"] == "unreachable at this size"
    assert WEB.E + WEB.A / small["min_params"] ** WEB.alpha == pytest.approx(2.0)
    far = forecast_target(pts, "web", "loss_nats", 1.8, 1e11, known)
    assert far["status"] == "reachable"
    assert any(f.startswith("beyond the fit's trusted range: extrapolating") for f in far["flags"])
    assert any("outside the fitted sizes [1e+07, 1e+09]" in f for f in far["flags"])
    old = [Point(p.run, p.params, p.tokens, p.loss, p.domain_losses) for p in pts]
    assert forecast_target(old, "mean", "loss_nats", 2.5, n)["status"] == "no data"


def _project_with_targets(project: Path, targets: dict) -> Path:
    path = project / "recipes/eval/standard.yaml"
    data = yaml.safe_load(path.read_text())
    data["targets"] = targets
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return project / "experiments/1p3b.yaml"


@pytest.mark.slow
def test_plan_with_a_fit_gives_tokens_days_and_dollars_per_target(project, tmp_path, capsys):
    from runner.cli import main

    fit_file = tmp_path / "scaling_fit.json"
    fit_file.write_text(json.dumps({"points": [asdict(p) for p in pilots()]}))
    targets = {"web-2p6": {"domain": "web", "loss_nats": 2.6}, "floor": {"domain": "web", "loss_nats": 1.0}}
    exp_path = _project_with_targets(project, targets)
    assert main(["plan", str(exp_path), "--fit", str(fit_file), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    web, floor = sorted(plan["forecast"], key=lambda f: f["target"], reverse=True)
    assert (web["target"], floor["target"]) == ("web-2p6", "floor") and floor["status"] == "below floor"
    exp = load_experiment(exp_path, check_files=False)
    n = plan["params"]["non_embedding"]
    assert web["tokens"] == pytest.approx(tokens_to_reach(Fit(**web["fit"]), n, 2.6))
    block = web["time"]["assumed"]
    assert block["pure_hours"] * 3600 == pytest.approx(web["tokens"] / plan["time"]["assumed"]["tokens_per_second"])
    price = exp.config.hardware.price_per_device_hour_usd
    assert block["cost_usd"] == pytest.approx(block["device_hours"] * price)
    text = format_plan(plan)  # what `runner plan` prints without --json
    assert "forecast to quality targets" in text
    assert "floor (web loss_nats <= 1): BELOW FLOOR: 1 is at or below the fitted floor" in text
    assert f"web-2p6 (web loss_nats <= 2.6): {_si(web['tokens'])} tokens" in text
    assert [t.name for t in declared_targets(exp.config)] == ["floor", "web-2p6"]


def _si(x: float) -> str:
    from runner.planning.plan_text import _si as si

    return si(x)


def test_a_fit_file_that_is_not_a_fit_result_is_one_line(project, tmp_path, capsys, monkeypatch):
    from runner.cli import main

    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"fit": {}}))
    exp_path = _project_with_targets(project, {"t": {"domain": "web", "loss_nats": 2.6}})
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(exp_path), "--fit", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == "error: x.json: not a `runner fit` result (scaling_fit.json): KeyError: 'points'\n"


def test_a_fit_whose_points_are_not_numbers_is_one_line(project, tmp_path, capsys, monkeypatch):
    """A scaling_fit.json whose run had tokens -5 or params 0 (or a NaN domain loss) was fitted: a forecast
    of 22.6G tokens where the runs said 494K; a string there was a traceback. One line naming the key."""
    from runner.cli import main

    exp_path = _project_with_targets(project, {"t": {"domain": "web", "loss_nats": 2.6}})
    monkeypatch.chdir(tmp_path)
    good = [asdict(p) for p in pilots()]
    cases = [
        ({"tokens": -5}, "points[0].tokens: not a `runner fit` result: must be a positive finite number, got -5"),
        ({"params": 0}, "points[0].params: not a `runner fit` result: must be a positive finite number, got 0"),
        ({"tokens": "x"}, "points[0].tokens: not a `runner fit` result: must be a positive finite number, got 'x'"),
        ({"loss": float("nan")}, "points[0].loss: not a `runner fit` result: must be a finite number, got nan"),
        ({"domain_losses": {"web": float("inf")}}, "points[0].domain_losses.web: not a `runner fit` result: must be"),
        ({"domain_bpb": [1]}, "points[0].domain_bpb: not a `runner fit` result: must be a mapping"),
    ]
    for change, message in cases:
        (tmp_path / "f.json").write_text(json.dumps({"points": [{**good[0], **change}, *good[1:]]}))
        assert main(["plan", str(exp_path), "--fit", "f.json"]) == 2
        assert capsys.readouterr().err.startswith(f"error: f.json: {message}")
