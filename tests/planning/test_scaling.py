"""Scaling fits recover known laws; the optimum formulas match hand computation."""

import json
import math

import numpy as np
import pytest
import yaml
from runfixtures import config

from runner.errors import RunnerError
from runner.planning.scaling import (
    Fit,
    Point,
    compute_optimal,
    extrapolation_warning,
    fit_loss,
    fit_report,
    holdout_errors,
    inference_optimal,
    plot_fit,
)
from runner.reports.planning_inputs import read_point

TRUE = Fit(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, objective=0.0, points=0)  # Chinchilla


def synthetic(noise=0.003, seed=0):
    rng = np.random.default_rng(seed)
    pts = []
    for n in np.geomspace(1e7, 1e9, 5):
        for d in np.geomspace(1e9, 1e11, 5):
            loss = float(TRUE.loss(n, d)) * math.exp(rng.normal(0, noise))
            pts.append(Point(f"n{n:.0e}-d{d:.0e}", float(n), float(d), loss))
    return pts


@pytest.mark.slow
def test_recovers_known_parameters_from_noisy_losses():
    fit = fit_loss(synthetic())
    assert fit.alpha == pytest.approx(TRUE.alpha, abs=0.05)
    assert fit.beta == pytest.approx(TRUE.beta, abs=0.05)
    assert pytest.approx(TRUE.E, abs=0.1) == fit.E
    # and predicts a held-out point 10x beyond the grid within 2%
    far = Point("far", 1e10, 1e12, float(TRUE.loss(1e10, 1e12)))
    assert abs(holdout_errors(fit, [far])[0]["relative_error"]) < 0.02


def test_compute_optimal_closed_form_by_hand():
    fit = Fit(E=1.0, A=100.0, B=200.0, alpha=0.5, beta=0.5, objective=0.0, points=0)
    # G = (0.5*100 / (0.5*200))^(1/1) = 0.5; N = 0.5 * (C/6)^0.5; D = 2 * (C/6)^0.5
    opt = compute_optimal(fit, 6e20)
    assert opt["params"] == pytest.approx(0.5 * 1e10)
    assert opt["tokens"] == pytest.approx(2 * 1e10)
    assert 6 * opt["params"] * opt["tokens"] == pytest.approx(6e20)
    # it is the minimum along the C = 6ND curve
    for k in (0.8, 1.25):
        n = opt["params"] * k
        assert fit.loss(n, 6e20 / 6 / n) > opt["loss"]


def test_inference_demand_shrinks_the_model_at_equal_loss():
    opt = compute_optimal(TRUE, 1e23)
    served = inference_optimal(TRUE, opt["loss"], 1e13)
    assert served["loss"] == pytest.approx(opt["loss"], rel=1e-6)
    assert served["params"] < opt["params"] and served["tokens"] > opt["tokens"]
    # with no inference it returns the compute-optimal point
    alone = inference_optimal(TRUE, opt["loss"], 0.0)
    assert alone["params"] == pytest.approx(opt["params"], rel=1e-3)
    assert served["total_flops"] <= 6 * opt["params"] * opt["tokens"] + 2 * opt["params"] * 1e13


def test_extrapolation_warning_past_two_orders_of_magnitude():
    pts = synthetic()
    largest = max(p.flops for p in pts)
    assert extrapolation_warning(pts, largest * 50) is None
    w = extrapolation_warning(pts, largest * 1e3)
    assert "3.0 orders of magnitude" in w and "hyperparameters" in w


def test_too_few_points_is_an_error():
    with pytest.raises(RunnerError, match="at least 5 runs"):
        fit_loss(synthetic()[:4])


def write_run(folder, n_layers, steps, losses):
    (folder / "metrics").mkdir(parents=True)
    cfg = config({})  # a resolved experiment.yaml, as a run folder holds
    cfg["tokenizer"]["vocab_size"] = 256
    cfg["model"].update(hidden_size=32, n_layers=n_layers, n_heads=4, n_kv_heads=4, intermediate_size=64)
    cfg["model"]["tie_embeddings"] = False
    cfg["train"].update(seq_len=16, global_batch_sequences=4, micro_batch_sequences=2)
    (folder / "experiment.yaml").write_text(yaml.safe_dump(cfg))
    (folder / "run.json").write_text(json.dumps({"committed_steps": steps}))
    rows = [{"step": 1, "domain": d, "loss_nats": 9.0} for d in losses]
    rows += [{"step": steps, "domain": d, "loss_nats": v} for d, v in losses.items()]
    (folder / "metrics" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_read_point_from_a_run_folder_and_full_report(tmp_path):
    runs = []
    for i, (layers, steps) in enumerate([(1, 100), (2, 100), (4, 100), (1, 400), (2, 400), (4, 400)]):
        n_ne = layers * (4 * 32 * 32 + 3 * 32 * 64 + 64) + 32 + 256 * 32
        d = steps * 4 * 16
        web, code = float(TRUE.loss(n_ne, d)), float(TRUE.loss(n_ne, d)) + 0.2
        write_run(tmp_path / f"r{i}", layers, steps, {"web": web, "code": code})
        runs.append(tmp_path / f"r{i}")
    p = read_point(runs[0])
    assert p.params == 1 * (4 * 32 * 32 + 3 * 32 * 64 + 64) + 32 + 256 * 32
    assert p.tokens == 100 * 4 * 16
    assert p.loss == pytest.approx(float(TRUE.loss(p.params, p.tokens)) + 0.1)
    points = [read_point(r) for r in runs]
    report = fit_report(points[:5], points[5:], flops=1e18, inference_tokens=1e9)
    assert set(report["domains"]) == {"code", "web"}
    assert len(report["holdout"]) == 1 and report["warnings"]
    assert report["inference_optimal"]["params"] <= report["compute_optimal"]["params"] * 1.001
    png = plot_fit(fit_loss(points), points, tmp_path / "out" / "fit.png", compute_optimal(fit_loss(points), 1e12))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(RunnerError, match="not a finished run folder"):
        read_point(tmp_path)


@pytest.mark.slow
def test_cli_fit_writes_json_and_png(tmp_path, capsys):
    from runner.cli import main

    runs = []
    for i, (layers, steps) in enumerate([(1, 100), (2, 100), (4, 100), (1, 400), (2, 400), (4, 400)]):
        n_ne = layers * (4 * 32 * 32 + 3 * 32 * 64 + 64) + 32 + 256 * 32
        write_run(tmp_path / f"r{i}", layers, steps, {"web": float(TRUE.loss(n_ne, steps * 64))})
        runs.append(str(tmp_path / f"r{i}"))
    out = tmp_path / "fit"
    assert (
        main(
            ["fit", *runs[:5], "--holdout", runs[5], "--flops", "1e15", "--inference-tokens", "1e9", "--out", str(out)]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "compute-optimal at C = 1e+15" in captured.out and "held out r5" in captured.out
    assert "orders of magnitude" in captured.err
    report = json.loads((out / "scaling_fit.json").read_text())
    assert report["compute_optimal"]["flops"] == 1e15
    assert (out / "scaling_fit.png").stat().st_size > 1000
    assert main(["fit", *runs[:3], "--out", str(out)]) == 2  # too few runs: one-line error, exit 2


def test_read_point_from_a_report_folder(tmp_path):
    import pandas as pd

    rep = tmp_path / "report"
    rep.mkdir()
    pd.DataFrame(
        [{"run_id": "r1", "params": 1000, "params_counted": "non_embedding", "exposure_tokens": 64000}]
    ).to_parquet(rep / "run_summary.parquet")
    pd.DataFrame(
        [
            {"step": 5, "exposure_tokens": 1, "domain": "web", "loss_nats": 9.0, "bpb": 1.0},
            {"step": 10, "exposure_tokens": 2, "domain": "web", "loss_nats": 4.0, "bpb": 1.0},
            {"step": 10, "exposure_tokens": 2, "domain": "code", "loss_nats": 3.0, "bpb": 1.0},
        ]
    ).to_parquet(rep / "validation.parquet")
    p = read_point(tmp_path)  # a run folder holding only its report/
    assert (p.run, p.params, p.tokens, p.loss) == ("r1", 1000.0, 64000.0, 3.5)
    assert p.domain_losses == {"web": 4.0, "code": 3.0}


def _grid_runs(tmp_path, shapes):
    runs = []
    for i, (layers, steps) in enumerate(shapes):
        n_ne = layers * (4 * 32 * 32 + 3 * 32 * 64 + 64) + 32 + 256 * 32
        folder = tmp_path / "runs" / f"pilot-l{layers}-s{steps}" / f"2026112{i}-000000"
        write_run(folder, layers, steps, {"web": float(TRUE.loss(n_ne, steps * 64))})
        cfg = yaml.safe_load((folder / "experiment.yaml").read_text())
        (folder / "experiment.yaml").write_text(yaml.safe_dump({**cfg, "name": f"pilot-l{layers}-s{steps}"}))
        runs.append(folder)
    return runs


GRID = [(1, 100), (2, 100), (4, 100), (1, 400), (2, 400), (4, 400)]


@pytest.mark.slow
def test_cli_fit_takes_experiment_run_folders_and_names_held_out_runs(tmp_path, capsys):
    # `runner launch` puts runs in runs/EXPERIMENT/RUN_ID: the user passes runs/pilot-*/.
    from runner.cli import main

    runs = _grid_runs(tmp_path, GRID)
    experiments = [str(r.parent) for r in runs]
    assert main(["fit", *experiments[:5], "--holdout", experiments[5], "--out", str(tmp_path / "fit")]) == 0
    out = capsys.readouterr().out
    assert "fit of 5 runs" in out
    assert f"held out {runs[5].name} (pilot-l4-s400), N " in out  # a timestamp alone says nothing
    assert main(["fit", str(tmp_path), "--out", str(tmp_path / "fit")]) == 2  # no runs directly inside
    assert "neither a finished run folder" in capsys.readouterr().err


def test_cli_fit_refuses_meaningless_budget_flags(tmp_path, capsys):
    from runner.cli import main

    runs = [str(r) for r in _grid_runs(tmp_path, GRID)]
    assert main(["fit", *runs, "--inference-tokens", "1e9", "--out", str(tmp_path / "fit")]) == 2
    assert "--inference-tokens: needs --flops" in capsys.readouterr().err
    assert main(["fit", *runs, "--flops", "0", "--out", str(tmp_path / "fit")]) == 2
    assert "--flops: must be a positive number of FLOPs, got 0" in capsys.readouterr().err
    # Finite but beyond the fit: 5e-324 divided by zero (a traceback), 1e-300 predicted 8e-246 parameters,
    # --inference-tokens 1e308 made 2 N x tokens inf (Infinity in scaling_fit.json). One line each, nothing written.
    for flags, said in (
        (["--flops", "5e-324"], "--flops: 4.94066e-324 FLOPs is beyond what the fit can predict"),
        (["--flops", "1e-300"], "less than one of either is no model"),
        (["--flops", "1e15", "--inference-tokens", "1e308"], "--inference-tokens: 1e+308 tokens to serve is beyond"),
    ):
        assert main(["fit", *runs, *flags, "--out", str(tmp_path / "far")]) == 2, flags
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1 and "Traceback" not in err, (flags, err)
        assert not (tmp_path / "far" / "scaling_fit.json").exists()


@pytest.mark.slow
def test_fit_warns_when_a_grid_has_too_few_sizes_or_budgets():
    pts = [
        Point(f"p{i}", n, d, float(TRUE.loss(n, d)))
        for i, (n, d) in enumerate([(1e7, 1e9), (1e7, 3e9), (1e7, 1e10), (1e8, 1e9), (1e8, 3e9), (1e8, 1e10)])
    ]
    warnings = fit_report(pts)["warnings"]
    assert warnings == [
        "only 2 distinct model sizes among the fitted runs: alpha is not determined by the data (use 3 or more)"
    ]
    assert fit_report(synthetic())["warnings"] == []


def test_a_fit_counts_each_run_once_and_never_fits_a_held_out_run(tmp_path):
    """`runner fit runs/EXP runs/EXP/RUN` fitted RUN twice; `runner fit runs/EXP --holdout runs/EXP/RUN`
    fitted RUN, then "predicted" it from a fit that had seen it."""
    from runner.reports.planning_inputs import read_fit_points

    runs = _grid_runs(tmp_path, GRID)
    fitted, held = read_fit_points([*runs, runs[0], runs[0].parent, *[r.parent for r in runs]], [])
    assert sorted(p.experiment for p in fitted) == sorted(r.parent.name for r in runs) and not held
    fitted, held = read_fit_points([r.parent for r in runs], [runs[5], runs[5].parent])
    assert [p.experiment for p in held] == [runs[5].parent.name]
    assert runs[5].parent.name not in {p.experiment for p in fitted} and len(fitted) == 5


def test_a_run_whose_figures_are_no_numbers_is_not_fitted(tmp_path):
    """A run folder whose ledger says -100 exposure tokens, or a report whose summary holds a NaN
    exposure or a validation row NaN tokens (int(NaN): a ValueError traceback), was fitted or crashed:
    one line naming the folder and the key."""
    import pandas as pd

    write_run(tmp_path / "r", 1, 100, {"web": 3.0})
    (tmp_path / "r" / "ledger.json").write_text(json.dumps({"counters": {"total": {"exposure": -100}}}))
    with pytest.raises(RunnerError, match=r"r: tokens: must be a positive finite number, got -100.0"):
        read_point(tmp_path / "r")
    rep = tmp_path / "report"
    rep.mkdir()
    rows = [{"step": 10, "exposure_tokens": 2, "domain": "web", "loss_nats": 4.0, "bpb": 1.0, "tokens": 64}]
    summary = {"run_id": "r1", "params": 1000, "params_counted": "non_embedding", "exposure_tokens": float("nan")}
    pd.DataFrame([summary]).to_parquet(rep / "run_summary.parquet")
    pd.DataFrame(rows).to_parquet(rep / "validation.parquet")
    with pytest.raises(RunnerError, match=r"report: tokens: must be a positive finite number, got nan"):
        read_point(rep)
    pd.DataFrame([{**summary, "exposure_tokens": 64000}]).to_parquet(rep / "run_summary.parquet")
    pd.DataFrame([{**rows[0], "tokens": float("nan")}]).to_parquet(rep / "validation.parquet")
    with pytest.raises(RunnerError, match=r"report: validation_tokens.web: must be a positive finite number, got nan"):
        read_point(rep)
    unmeasured = {"step": 10, "exposure_tokens": 2, "domain": "c", "loss_nats": float("nan"), "bpb": float("nan")}
    pd.DataFrame([*rows, {**unmeasured, "tokens": 0}]).to_parquet(rep / "validation.parquet")
    point = read_point(rep)  # a domain without validation samples (tokens 0, loss NaN) is left out
    assert (point.tokens, point.loss, point.domain_losses) == (64000.0, 4.0, {"web": 4.0})
    evals = tmp_path / "r" / "metrics" / "eval.jsonl"
    evals.write_text(evals.read_text() + json.dumps({**unmeasured, "step": 100, "tokens": 0}) + "\n")
    (tmp_path / "r" / "ledger.json").unlink()
    assert read_point(tmp_path / "r").domain_losses == {"web": 3.0}  # was: "final validation loss is nan"
