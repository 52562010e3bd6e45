"""CLI verbs of planning: `runner plan`, `runner fit`, `runner pilot-grid`. Parsing and printing only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runner.errors import EXIT_OK, EXIT_USAGE, RunnerError


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise RunnerError(f"{flag}: expected a number, got {text!r}") from None


def _ratio(x: float) -> str:
    """Tokens per parameter: one decimal where readable, 3 significant digits far from 1-1e6."""
    return f"{x:.1f}" if 1 <= x < 1e6 else f"{x:.3g}"


def cmd_plan(args) -> int:
    from runner.planning.plan import build_plan
    from runner.planning.plan_text import format_plan
    from runner.planning.resources import load_experiment
    from runner.reports.planning_inputs import read_calibration

    exp = load_experiment(args.experiment, check_files=False)
    cfg = exp.config
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise RunnerError(f"--mfu: must be in (0, 1], got {args.mfu}")
    calibration = read_calibration(args.calibrate, cfg) if args.calibrate else None
    plan = build_plan(cfg, mfu=args.mfu, calibration=calibration, root=exp.project_root)
    plan["experiment"]["fingerprint"] = exp.fingerprint
    _plan_downstream(plan, exp)
    if args.fit:
        from runner.fsio import read_json
        from runner.planning.plan import forecast_targets
        from runner.reports.targets import declared_targets

        plan["fit_file"] = args.fit
        plan["forecast"] = forecast_targets(plan, read_json(args.fit), declared_targets(exp.config))
    if args.json:
        print(json.dumps(plan, indent=2, default=str))
    else:
        print(format_plan(plan))
    if plan["mixture"].get("status") == "infeasible":
        print(f"error: {exp.path}: {plan['mixture']['line']}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def _plan_downstream(plan: dict, exp) -> None:
    """plan["downstream"]: the eval recipe's tasks read and counted here (runner.training.downstream.cost),
    priced by runner.planning.downstream_cost at the plan's assumed throughput."""
    from runner.planning.downstream_cost import downstream_cost
    from runner.training.downstream.cost import safe_task_positions

    cfg = exp.config
    tasks, why = safe_task_positions(exp)
    plan["downstream_not_planned"] = why
    assumed = plan["time"]["assumed"]
    plan["downstream"] = (
        downstream_cost(
            tasks,
            training_flops_per_token=plan["compute"]["flops_per_token"],
            tokens_per_second=assumed["tokens_per_second"],
            total_steps=cfg.train.exposure_tokens // (cfg.train.global_batch_sequences * cfg.train.seq_len),
            interval_steps=cfg.eval.downstream_interval_steps,
            wall_seconds=assumed["wall_hours"] * 3600,
        )
        if tasks
        else None
    )


def cmd_fit(args) -> int:
    from runner.fsio import check_output_folder
    from runner.planning.scaling import Fit, fit_report, plot_fit
    from runner.reports.planning_inputs import read_fit_points

    out = check_output_folder(args.out, "--out")
    points, holdout = read_fit_points(args.runs, args.holdout or [])
    flops = _float(args.flops, "--flops") if args.flops is not None else None
    inference = _float(args.inference_tokens, "--inference-tokens") if args.inference_tokens else 0.0
    report = fit_report(points, holdout, flops=flops, inference_tokens=inference)
    out.mkdir(parents=True, exist_ok=True)
    fit = Fit(**report["fit"])
    report["plot"] = str(plot_fit(fit, points, out / "scaling_fit.png", report.get("compute_optimal"), holdout))
    (out / "scaling_fit.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    f = report["fit"]
    print(
        f"fit of {len(points)} runs: L(N, D) = {f['E']:.4g} + {f['A']:.4g} / N^{f['alpha']:.4g} "
        f"+ {f['B']:.4g} / D^{f['beta']:.4g}   (N non-embedding params, D exposure tokens)"
    )
    for d, df in report["domains"].items():
        print(f"  {d}: E={df['E']:.4g} A={df['A']:.4g} alpha={df['alpha']:.4g} B={df['B']:.4g} beta={df['beta']:.4g}")
    for h in report["holdout"]:
        label = f"{h['run']} ({h['experiment']})" if h["experiment"] and h["experiment"] != h["run"] else h["run"]
        print(
            f"held out {label}, N {h['params']:.3g}, D {h['tokens']:.3g}: loss {h['loss']:.4f}, predicted {h['predicted']:.4f} "
            f"({h['relative_error']:+.2%})"
        )
    if "compute_optimal" in report:
        o = report["compute_optimal"]
        print(
            f"compute-optimal at C = {o['flops']:.3g} FLOPs: N = {o['params']:.4g}, D = {o['tokens']:.4g} "
            f"({_ratio(o['tokens_per_param'])} tokens/param), loss {o['loss']:.4f}"
        )
    if "inference_optimal" in report:
        i = report["inference_optimal"]
        print(
            f"with {i['inference_tokens']:.3g} inference tokens (same loss): N = {i['params']:.4g}, "
            f"D = {i['tokens']:.4g}, train {i['train_flops']:.3g} + serve {i['inference_flops']:.3g} FLOPs"
        )
    for w in report["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {out / 'scaling_fit.json'} and {report['plot']}")
    return EXIT_OK


def cmd_pilot_grid(args) -> int:
    from runner.planning.pilot_grid import write_pilot_grid

    sizes = [s for s in args.sizes.split(",") if s.strip()]
    budgets = [b for b in args.budgets.split(",") if b.strip()]
    files = write_pilot_grid(args.experiment, sizes, budgets, args.out)
    for f in files:
        print(f)
    print(f"{len(files) - 1} pilot experiments; see {files[-1]} for what is fixed and how budgets were rounded")
    # The next two steps, spelled out: runs land in runs/<pilot name>/<run_id>/, not beside the YAML.
    folder = Path(files[0]).parent
    prefix = Path(files[0]).stem.split("-pilot-")[0] + "-pilot-"
    print(f'next: for f in {folder}/*.yaml; do runner launch "$f"; done\n      runner fit runs/{prefix}*/ --flops C')
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="compute, time, cost, memory, storage and mixture of an experiment")
    p.add_argument("experiment", help="experiments/NAME.yaml")
    p.add_argument("--json", action="store_true", help="print the full plan as JSON")
    p.add_argument("--mfu", type=float, default=None, help="assumed MFU (default: hardware.default_mfu)")
    p.add_argument(
        "--calibrate",
        metavar="RUN_OR_REPORT",
        default=None,
        help="a run folder, or a report folder (a published run's), whose measured throughput and overheads "
        "fill the measured column (a run on the same kind of device: CPU or GPU)",
    )
    p.add_argument(
        "--fit",
        metavar="SCALING_FIT_JSON",
        default=None,
        help="a `runner fit` result: forecast the tokens, days and dollars to each of the experiment's quality targets",
    )
    p.set_defaults(func=cmd_plan)

    f = subparsers.add_parser("fit", help="fit L(N, D) = E + A/N^alpha + B/D^beta to finished pilot runs")
    f.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run folders (runs/EXPERIMENT/RUN_ID), or runs/EXPERIMENT for every finished run in it",
    )
    f.add_argument("--holdout", nargs="*", default=[], metavar="RUN", help="runs to predict, not fit")
    f.add_argument("--flops", default=None, help="a training budget C in FLOPs: the compute-optimal N, D")
    f.add_argument("--inference-tokens", default=None, help="tokens to serve: the inference-aware optimum")
    f.add_argument("--out", default="reports/scaling", help="folder for scaling_fit.json and the PNG")
    f.add_argument("--json", action="store_true", help="print the full result as JSON")
    f.set_defaults(func=cmd_fit)

    g = subparsers.add_parser("pilot-grid", help="write size x budget pilot experiments for a scaling fit")
    g.add_argument("experiment", help="the experiment to derive pilots from")
    g.add_argument(
        "--sizes",
        required=True,
        help="comma list of model recipes (llama-tiny@1) or shapes (hidden_size=128+n_layers=4)",
    )
    g.add_argument("--budgets", required=True, help="comma list of exposure tokens (300K, 2.5M, 1e9)")
    g.add_argument("--out", default="experiments/pilots", help="folder for the YAML files and README.md")
    g.set_defaults(func=cmd_pilot_grid)
