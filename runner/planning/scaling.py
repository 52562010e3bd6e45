"""Scaling-law fits from finished pilot runs, and what they predict.

Owns: fitting (the points are read from run folders by runner.reports.planning_inputs) L(N, D) = E + A/N^alpha + B/D^beta as
Hoffmann et al. 2022 (Huber loss, delta 1e-3, on log residuals, log-sum-exp parametrization,
L-BFGS-B from a grid of starts), held-out error, the compute-optimal N, D for C = 6ND (closed
form), the inference-aware optimum (Sardana et al. 2023), extrapolation warnings, the plot, and the
forecast to a quality target: the tokens a model size needs, by inverting a fit of the target's own
quantity (a domain's loss or bits per byte, or their mean weighted by validation tokens).
Never: trains, or edits run folders; N is the non-embedding parameter count, D exposure tokens.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import minimize, minimize_scalar

from runner.config.eval_recipe import MEAN_DOMAIN
from runner.errors import RunnerError

HUBER_DELTA = 1e-3
MIN_POINTS = 5  # five free parameters
EXTRAPOLATION_WARN_FACTOR = 100.0  # two orders of magnitude in compute
# Hoffmann et al. 2022 appendix D.2 grid of initialisations (a = log A, b = log B, e = log E).
START_GRID = {
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
}
BEST_STARTS = 24  # L-BFGS-B runs from the best grid points only: the rest land in the same basins
EXTRAPOLATION_ASSUMPTIONS = (
    "the data mixture, tokenizer and data quality stay those of the pilots",
    "no data repetition beyond what the pilots saw (D counts unique tokens at the target scale)",
    "hyperparameters (lr, schedule, batch size) stay near-optimal as N and D grow",
    "the model shape (depth/width ratio, GQA, vocab) scales the way the pilots did",
    "the power law holds with no new regime (instability, loss spikes, saturation near E)",
)


@dataclass(frozen=True)
class Point:
    """One finished run: non-embedding params, exposure tokens, final mean validation loss."""

    run: str
    params: float
    tokens: float
    loss: float
    domain_losses: dict = field(default_factory=dict)
    experiment: str = ""  # the experiment's name, when the run folder records it
    domain_bpb: dict = field(default_factory=dict)  # final bits per byte per domain
    validation_tokens: dict = field(default_factory=dict)  # per domain: the weights of the mean target

    @property
    def label(self) -> str:
        """What a user recognises: run ids are timestamps, so name the experiment too."""
        return f"{self.run} ({self.experiment})" if self.experiment and self.experiment != self.run else self.run

    @property
    def flops(self) -> float:
        return 6.0 * self.params * self.tokens


def check_point(point: Point, file: str | None, key: str = "", lead: str = "") -> Point:
    """A run the fit may take: positive finite params and tokens, finite losses and bits per byte,
    positive validation token counts; else one line naming the key. A run whose ledger said -5 tokens,
    or a scaling_fit.json point with params 0, was fitted (a forecast of 22.6G tokens where the runs
    said 494K), and a string there was a traceback."""

    def number(value: Any, name: str, positive: bool) -> None:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (positive and value <= 0):
            rule = "a positive finite number" if positive else "a finite number"
            raise RunnerError(f"{lead}must be {rule}, got {value!r}", key=f"{key}{name}", file=file)

    number(point.params, "params", True)
    number(point.tokens, "tokens", True)
    number(point.loss, "loss", False)
    for table, positive in (("domain_losses", False), ("domain_bpb", False), ("validation_tokens", True)):
        values = getattr(point, table)
        if not isinstance(values, dict):
            raise RunnerError(f"{lead}must be a mapping", key=f"{key}{table}", file=file)
        for domain, value in values.items():
            number(value, f"{table}.{domain}", positive)
    return point


@dataclass(frozen=True)
class Fit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float
    points: int

    def loss(self, params: Any, tokens: Any) -> Any:
        return self.E + self.A / np.power(params, self.alpha) + self.B / np.power(tokens, self.beta)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- fitting
def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    a = np.abs(r)
    value = np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))
    grad = np.where(a <= delta, r, delta * np.sign(r))
    return value, grad


def _objective(
    theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float
) -> tuple[float, np.ndarray]:
    """Sum of Huber(LSE(a - alpha log N, b - beta log D, e) - log L) and its gradient."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    w = np.exp(terms - top)
    lse = top + np.log(w.sum(axis=0))
    soft = w / w.sum(axis=0)
    value, g = _huber(lse - log_l, delta)
    grad = np.array(
        [
            (g * soft[0]).sum(),
            (g * soft[1]).sum(),
            (g * soft[2]).sum(),
            -(g * soft[0] * log_n).sum(),
            -(g * soft[1] * log_d).sum(),
        ]
    )
    return float(value.sum()), grad


def fit_loss(points: Sequence[Point], *, delta: float = HUBER_DELTA, losses: Sequence[float] | None = None) -> Fit:
    """Hoffmann et al. 2022 fit. `losses` replaces the points' mean loss (per-domain fits)."""
    if len(points) < MIN_POINTS:
        raise RunnerError(f"a fit of E, A, B, alpha, beta needs at least {MIN_POINTS} runs, got {len(points)}")
    log_n = np.log([p.params for p in points])
    log_d = np.log([p.tokens for p in points])
    log_l = np.log(np.asarray(losses if losses is not None else [p.loss for p in points], dtype=float))
    grid = np.array(
        list(
            itertools.product(
                START_GRID["a"], START_GRID["b"], START_GRID["e"], START_GRID["alpha"], START_GRID["beta"]
            )
        )
    )
    # Evaluate every grid start at once; optimise only from the best ones.
    a, b, e, al, be = (grid[:, i : i + 1] for i in range(5))
    t = np.stack(np.broadcast_arrays(a - al * log_n, b - be * log_d, e + 0 * log_n))
    lse = np.logaddexp.reduce(t, axis=0)
    start_values = _huber(lse - log_l, delta)[0].sum(axis=1)
    order = np.argsort(start_values)[:BEST_STARTS]
    bounds = [(-10, 60), (-10, 60), (-5, 5), (0.0, 3.0), (0.0, 3.0)]
    best = None
    for i in order:
        res = minimize(
            _objective, grid[i], args=(log_n, log_d, log_l, delta), jac=True, method="L-BFGS-B", bounds=bounds
        )
        if best is None or res.fun < best.fun:
            best = res
    assert best is not None  # MIN_POINTS > 0 points give a non-empty grid of starts
    a, b, e, alpha, beta = best.x
    return Fit(
        E=math.exp(e),
        A=math.exp(a),
        B=math.exp(b),
        alpha=float(alpha),
        beta=float(beta),
        objective=float(best.fun),
        points=len(points),
    )


def holdout_errors(fit: Fit, points: Iterable[Point]) -> list[dict]:
    """Predicted vs measured loss of runs the fit did not see."""
    out = []
    for p in points:
        predicted = float(fit.loss(p.params, p.tokens))
        out.append(
            {
                "run": p.run,
                "experiment": p.experiment,
                "params": p.params,
                "tokens": p.tokens,
                "loss": p.loss,
                "predicted": predicted,
                "relative_error": (predicted - p.loss) / p.loss,
            }
        )
    return out


# ---------------------------------------------------------------- predictions
def compute_optimal(fit: Fit, flops: float) -> dict:
    """Chinchilla closed form for C = 6ND: G = (alpha A / (beta B))^(1/(alpha+beta)),
    N = G (C/6)^(beta/(alpha+beta)), D = G^-1 (C/6)^(alpha/(alpha+beta))."""
    s = fit.alpha + fit.beta
    if fit.alpha <= 0 or fit.beta <= 0:
        raise RunnerError(f"no compute-optimal split with alpha={fit.alpha:.3g}, beta={fit.beta:.3g} (need > 0)")
    g = (fit.alpha * fit.A / (fit.beta * fit.B)) ** (1.0 / s)
    n = g * (flops / 6.0) ** (fit.beta / s)
    d = (flops / 6.0) ** (fit.alpha / s) / g
    return {"flops": flops, "params": n, "tokens": d, "loss": float(fit.loss(n, d)), "tokens_per_param": d / n}


def inference_optimal(fit: Fit, target_loss: float, inference_tokens: float) -> dict:
    """Sardana et al. 2023: the N, D reaching `target_loss` with least 6ND + 2N * inference_tokens."""
    gap = target_loss - fit.E
    if gap <= 0:
        raise RunnerError(f"target loss {target_loss:.4g} is not above the fitted floor E={fit.E:.4g}")
    # Smallest N that can reach the loss at all (with infinite data), then search above it.
    n_min = (fit.A / gap) ** (1.0 / fit.alpha)

    def tokens_for(n: float) -> float:
        rest = gap - fit.A / n**fit.alpha
        return (fit.B / rest) ** (1.0 / fit.beta) if rest > 0 else math.inf

    def total(log_n: float) -> float:
        n = math.exp(log_n)
        d = tokens_for(n)
        return math.log(6 * n * d + 2 * n * inference_tokens) if math.isfinite(d) else 1e300

    lo = math.log(n_min) + 1e-9
    res = minimize_scalar(total, bounds=(lo, lo + math.log(1e6)), method="bounded", options={"xatol": 1e-10})
    n = math.exp(res.x)
    d = tokens_for(n)
    return {
        "params": n,
        "tokens": d,
        "loss": float(fit.loss(n, d)),
        "train_flops": 6 * n * d,
        "inference_flops": 2 * n * inference_tokens,
        "total_flops": 6 * n * d + 2 * n * inference_tokens,
        "inference_tokens": inference_tokens,
    }


def extrapolation_warning(points: Sequence[Point], flops: float) -> str | None:
    """A warning when `flops` is more than 100x the largest pilot's compute."""
    largest = max(p.flops for p in points)
    factor = flops / largest
    if factor <= EXTRAPOLATION_WARN_FACTOR:
        return None
    return (
        f"extrapolating {factor:.3g}x ({math.log10(factor):.1f} orders of magnitude) beyond the largest "
        f"pilot ({largest:.3g} FLOPs); assumptions most likely to break: " + "; ".join(EXTRAPOLATION_ASSUMPTIONS)
    )


def plot_fit(
    fit: Fit, points: Sequence[Point], path: Path, optimum: dict | None = None, holdout: Sequence[Point] = ()
) -> Path:
    """Loss against compute: the pilots, the fitted curve of each pilot size, the optimum."""
    import matplotlib  # noqa: PLC0415  (heavy, and its backend must be chosen before pyplot loads)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    with np.errstate(all="ignore"), warnings.catch_warnings():  # a far optimum overflows the curves: inf is not drawn
        warnings.simplefilter("ignore", RuntimeWarning)
        _draw_fit(plt, fit, points, path, optimum, holdout)
    return path


def _draw_fit(
    plt, fit: Fit, points: Sequence[Point], path: Path, optimum: dict | None, holdout: Sequence[Point]
) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted({p.params for p in points})
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(sizes)))
    c_all = [p.flops for p in list(points) + list(holdout)] + ([optimum["flops"]] if optimum else [])
    for n, color in zip(sizes, colors):
        d = np.geomspace(min(c_all) / 6 / n / 3, max(c_all) / 6 / n * 3, 100)
        ax.plot(6 * n * d, fit.loss(n, d), color=color, lw=1, label=f"N={n:.3g}")
        pts = [p for p in points if p.params == n]
        ax.scatter([p.flops for p in pts], [p.loss for p in pts], color=color, zorder=3)
    if holdout:
        ax.scatter(
            [p.flops for p in holdout], [p.loss for p in holdout], marker="x", color="red", zorder=4, label="held out"
        )
    if optimum:
        ax.scatter(
            [optimum["flops"]],
            [optimum["loss"]],
            marker="*",
            s=150,
            color="black",
            zorder=5,
            label=f"optimum N={optimum['params']:.3g} D={optimum['tokens']:.3g}",
        )
    ax.set_xscale("log")
    ax.set_xlabel("training compute 6ND (FLOPs)")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(f"L = {fit.E:.3g} + {fit.A:.3g}/N^{fit.alpha:.3g} + {fit.B:.3g}/D^{fit.beta:.3g}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fit_report(
    points: Sequence[Point], holdout: Sequence[Point] = (), *, flops: float | None = None, inference_tokens: float = 0.0
) -> dict:
    """The whole `runner fit` result: the fit, per-domain fits, held-out error, predictions, warnings."""
    if flops is not None and not (math.isfinite(flops) and flops > 0):
        raise RunnerError(f"--flops: must be a positive number of FLOPs, got {flops:g}")
    if inference_tokens and flops is None:
        raise RunnerError(
            "--inference-tokens: needs --flops (the inference-aware optimum reaches the loss "
            "of the compute-optimal model at that budget)"
        )
    if inference_tokens < 0 or not math.isfinite(inference_tokens):
        raise RunnerError(f"--inference-tokens: must be a non-negative number of tokens, got {inference_tokens:g}")
    fit = fit_loss(points)
    report: dict[str, Any] = {
        "fit": fit.to_dict(),
        "points": [asdict(p) for p in points],
        "holdout": holdout_errors(fit, holdout),
        "warnings": [],
        "domains": {},
    }
    # Five parameters fit any five points; an exponent is only measured across 3+ distinct values.
    for what, symbol, values in (
        ("model sizes", "alpha", {p.params for p in points}),
        ("budgets", "beta", {p.tokens for p in points}),
    ):
        if len(values) < 3:
            report["warnings"].append(
                f"only {len(values)} distinct {what} among the fitted runs: {symbol} is "
                f"not determined by the data (use 3 or more)"
            )
    domains = set.intersection(*(set(p.domain_losses) for p in points)) if points else set()
    for d in sorted(domains):
        if len(domains) > 1:
            report["domains"][d] = fit_loss(points, losses=[p.domain_losses[d] for p in points]).to_dict()
    if flops is not None:
        opt = _finite(lambda: compute_optimal(fit, flops), "--flops", f"{flops:g} FLOPs")
        report["compute_optimal"] = opt
        warning = extrapolation_warning(points, flops)
        if warning:
            report["warnings"].append(warning)
        if inference_tokens:
            report["inference_optimal"] = _finite(
                lambda: inference_optimal(fit, opt["loss"], inference_tokens),
                "--inference-tokens",
                f"{inference_tokens:g} tokens to serve",
            )
    return report


def _finite(predict: Callable[[], dict], flag: str, given: str) -> dict:
    """A prediction whose every figure is a finite number, or one line naming the flag: --flops 5e-324
    divided by zero, --inference-tokens 1e308 made 2 N x tokens infinite (scaling_fit.json's Infinity)."""
    try:
        with np.errstate(all="ignore"):  # numpy's overflow is an inf checked below, not a warning's lines
            result = predict()
    except (ZeroDivisionError, OverflowError):
        result = {}
    if not result or not all(math.isfinite(v) and v >= 0 for v in result.values()):
        raise RunnerError(f"{flag}: {given} is beyond what the fit can predict (a figure would not be a finite number)")
    if result["params"] < 1 or result["tokens"] < 1:  # --flops 1e-300: N = 8e-246 parameters
        raise RunnerError(
            f"{flag}: {given} predicts N = {result['params']:.3g} parameters and D = {result['tokens']:.3g} tokens:"
            " less than one of either is no model"
        )
    return result


# ---------------------------------------------------------------- forecast to a quality target
def target_quantity(point: Point, domain: str, metric: str) -> float | None:
    """A point's final value of what a target judges (SPEC "Quality targets"): a domain's loss
    (nats) or bits per byte, or for `mean` their mean weighted by validation tokens. None when the
    point does not record it (points read by an older runner hold no bpb or validation tokens)."""
    values = point.domain_losses if metric == "loss_nats" else point.domain_bpb
    if domain != MEAN_DOMAIN:
        return values.get(domain)
    weights = point.validation_tokens
    if not values or any(d not in weights for d in values):
        return None
    return sum(values[d] * weights[d] for d in values) / sum(weights[d] for d in values)


def tokens_to_reach(fit: Fit, params: float, loss: float) -> float:
    """D such that L(N, D) = loss: (B / (loss - E - A / N^alpha))^(1/beta); inf when the model
    size cannot reach the loss with any amount of data."""
    rest = loss - fit.E - fit.A / params**fit.alpha
    return (fit.B / rest) ** (1.0 / fit.beta) if rest > 0 else math.inf


def forecast_target(
    points: Sequence[Point], domain: str, metric: str, threshold: float, params: float, fits: dict | None = None
) -> dict:
    """Tokens that a model of `params` non-embedding parameters needs to reach `threshold`, from a
    fit of the target's own quantity over `points` (kept in `fits` by (domain, metric) for the next
    target), with why it cannot (`status`) and whether the answer leaves the fit's trusted range."""
    values = [target_quantity(p, domain, metric) for p in points]
    missing = [p.label for p, v in zip(points, values) if v is None]
    if missing:
        return {
            "status": "no data",
            "detail": f"{len(missing)} fitted runs do not record {domain} {metric} (re-run `runner fit` "
            f"with this runner): {', '.join(missing[:3])}",
        }
    fits = {} if fits is None else fits
    if (domain, metric) not in fits:
        fits[(domain, metric)] = fit_loss(points, losses=[v for v in values if v is not None])
    fit = fits[(domain, metric)]
    out: dict[str, Any] = {"fit": fit.to_dict(), "params": params, "flags": []}
    if threshold <= fit.E:
        return {
            **out,
            "status": "below floor",
            "detail": f"{threshold:g} is at or below the fitted floor E = {fit.E:.4g}: no model size reaches it",
        }
    tokens = tokens_to_reach(fit, params, threshold)
    if not math.isfinite(tokens):
        smallest = (fit.A / (threshold - fit.E)) ** (1.0 / fit.alpha)
        return {
            **out,
            "status": "unreachable at this size",
            "min_params": smallest,
            "detail": f"N = {params:.3g} cannot reach {threshold:g} with any amount of data "
            f"(its loss floor is {fit.E + fit.A / params**fit.alpha:.4g}); needs N > {smallest:.3g}",
        }
    out.update(status="reachable", tokens=tokens, flops=6.0 * params * tokens)
    warning = extrapolation_warning(points, out["flops"])
    if warning:
        out["flags"].append("beyond the fit's trusted range: " + warning.split(";")[0])
    sizes = [p.params for p in points]
    if not min(sizes) <= params <= max(sizes):
        out["flags"].append(f"N = {params:.3g} is outside the fitted sizes [{min(sizes):.3g}, {max(sizes):.3g}]")
    return out
