"""Audit published training claims (a YAML list) against the SPEC's arithmetic.

Owns: what a claim file may state, the implied figures (MFU from tokens/s under the 6N convention,
days from MFU or tokens/s, tokens per parameter against Chinchilla's 20) and the flags: figures
that cannot be true (IMPOSSIBLE: MFU above 100%, a sparse peak as denominator, a stated MFU or
duration that disagrees with the implied one by more than 10% relative, a mixture of experts' MFU
that counted every parameter instead of the active ones), figures no published training run has
reached (IMPLAUSIBLE: MFU above the plausibility bound, below) and figures that cannot be compared
(token kind unstated, device unknown).
A mixture-of-experts claim states both `model_params` (total) and `active_params` (what one token
passes through, SPEC "Mixture-of-experts"): its compute, MFU and days use the active count;
tokens per parameter stays over the total.
A claim may also state what the model trained on, as a mixture table (`mixture:`; its audit is
runner.reports.claims.mixture): then `model_params` is optional and the verdict takes the worst of
both: IMPOSSIBLE, INCONSISTENT (stated figures that contradict the table's own arithmetic),
IMPLAUSIBLE, INCOMPARABLE (a kind or device unstated), WARNING (repetition worth less), ok.
Never: reads runs or reports, or fills a missing figure from another device's peak.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.fsio import read_yaml
from runner.planning.hardware import PEAKS, canonical_device, mfu
from runner.planning.plan import CHINCHILLA_TOKENS_PER_PARAM, SECONDS_PER_DAY
from runner.reports.claims.mixture import (
    TOKEN_UNITS,
    MixtureResult,
    audit_mixture,
    in_range,
    parse_quantity,
    render_mixture,
)
from runner.reports.claims.source import Source, parse_source, source_line

TOKEN_KINDS = ("exposure", "unique", "useful", "processed")
#: Dense BF16 training MFU above which a claim is IMPLAUSIBLE (not impossible: the device could, no
#: published run has). The best published figures: PaLM 540B 46.2% on TPU v4 (Chowdhery et al.
#: 2022, table 3); MosaicML llm-foundry's MPT benchmarks (scripts/train/benchmarking/README.md)
#: at most 46.4% on H100 80GB and 64.2% on A100 80GB (MPT-7B, 8 GPUs, seq 2048, counting attention
#: FLOPs, which the 6N implied here leaves out, so a claim's implied MFU is, if anything, lower
#: than its own convention's); Megatron-LM's 52% of A100 peak for a 1T model (Narayanan et al. 2021)
#: counts activation recomputation, so its MFU is lower. 65% sits just above the best of these.
PLAUSIBLE_MFU = 0.65
PLAUSIBLE_MFU_SOURCE = (
    "the best published: llm-foundry MPT-7B on 8x A100 64.2%, on H100 46.4%; PaLM 540B 46.2% on TPU v4"
)
DISAGREE_REL = 0.10
MAX_DEVICES = 10**7  #: no published run held ten million accelerators: more is a typo
CONVENTION = (
    "6N (Kaplan/Chinchilla): flops_per_token = 6 * params as claimed (a mixture of experts: active_params); "
    "dense bf16 peak per device"
)
KEYS = (
    "name",
    "source",
    "model_params",
    "active_params",
    "tokens",
    "token_kind",
    "hardware",
    "devices",
    "tokens_per_second",
    "days",
    "mfu",
    "peak_tflops",
    "notes",
    "mixture",
    "bytes",
    "bytes_per_token",
    "bytes_per_token_source",
)
#: flag severity -> verdict, worst first; a claim's verdict is its worst flag's
VERDICTS = (
    ("impossible", "IMPOSSIBLE"),
    ("inconsistent", "INCONSISTENT"),
    ("implausible", "IMPLAUSIBLE"),
    ("unstated", "INCOMPARABLE"),
    ("warning", "WARNING"),
)
FAILING = ("impossible", "inconsistent", "implausible")  #: severities that make `audit-claims` exit 1


@dataclass
class Flag:
    #: a key of VERDICTS: "impossible", "inconsistent", "implausible", "unstated", "warning"; or "note",
    #: which never changes a verdict (a figure admitted by its printed digits, said so)
    severity: str
    message: str


@dataclass
class ClaimResult:
    name: str
    claim: dict
    params_counted: str = "all"  # "active" for a mixture of experts (active_params stated)
    peak_tflops: float | None = None
    peak_source: str = ""
    implied_mfu: float | None = None
    implied_days: float | None = None
    tokens_per_param: float | None = None
    tokens_per_param_vs_chinchilla: float | None = None
    flags: list[Flag] = field(default_factory=list)
    mixture: MixtureResult | None = None
    #: where it was published (runner.reports.claims.source): structured, free text, or None
    source: Source | str | None = None

    @property
    def impossible(self) -> bool:
        return any(f.severity == "impossible" for f in self.flags)

    @property
    def implausible(self) -> bool:
        return any(f.severity == "implausible" for f in self.flags)

    @property
    def failing(self) -> bool:
        """A flag that makes `audit-claims` exit 1 (impossible, inconsistent or implausible)."""
        return any(f.severity in FAILING for f in self.flags)

    @property
    def verdict(self) -> str:
        severities = {f.severity for f in self.flags}
        return next((v for s, v in VERDICTS if s in severities), "ok")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["impossible"] = self.impossible
        d["implausible"] = self.implausible
        d["failing"] = self.failing
        d["verdict"] = self.verdict
        return d


def _number(claim: dict, key: str, where: str) -> float | None:
    value = claim.get(key)
    if value is None:
        return None
    if isinstance(value, bool):
        raise RunnerError(f"must be a number, got {value!r}", file=where, key=key)
    try:
        x = float(value)  # YAML 1.1 reads `68e3` as a string; accept it as the number it says
    except (TypeError, ValueError, OverflowError):
        raise RunnerError(f"must be a number, got {value!r}", file=where, key=key) from None
    return in_range(x, where, key)  # `days: 1e-320` would imply an infinite MFU


def _plausibility(res: ClaimResult, stated_mfu: float | None, bound: float) -> None:
    """IMPLAUSIBLE: an implied or stated MFU above `bound` that is not already impossible (> 100%)."""
    for what, value in (("implied", res.implied_mfu), ("stated", stated_mfu)):
        if value is not None and bound < value <= 1.0:
            res.flags.append(
                Flag(
                    "implausible",
                    f"{what} MFU {value:.1%} is above the plausibility bound {bound:.0%} for dense BF16 training "
                    f"({PLAUSIBLE_MFU_SOURCE})",
                )
            )


def _check_token_kind(claim: dict, where: str, res: ClaimResult) -> None:
    kind = claim.get("token_kind")
    if kind is None:
        res.flags.append(
            Flag(
                "unstated",
                "token kind unstated: exposure, unique, useful and processed "
                "tokens differ; the figure cannot be compared",
            )
        )
    elif kind not in TOKEN_KINDS:
        raise RunnerError(f"must be one of {TOKEN_KINDS}, got {kind!r}", file=where, key="token_kind")


def _resolve_peak(claim: dict, stated_peak: float | None, res: ClaimResult) -> None:
    """The dense peak the implied MFU divides by: the table's for a known device, else the stated one."""
    key = canonical_device(claim.get("hardware"))
    dense = PEAKS[key].dense_bf16_tflops if key else None
    if stated_peak is not None and dense is not None and math.isclose(stated_peak, 2 * dense, rel_tol=0.01):
        res.flags.append(
            Flag(
                "impossible",
                f"sparse peak as denominator: {stated_peak:g} TFLOP/s is the sparse figure of {key} (dense {dense:g})",
            )
        )
    if dense is not None:
        res.peak_tflops, res.peak_source = dense, f"{key} dense bf16 (peak table)"
    elif stated_peak is not None:
        res.peak_tflops, res.peak_source = stated_peak, "stated in the claim (device not in the peak table)"
    else:
        res.flags.append(
            Flag(
                "unstated",
                f"device {claim.get('hardware')!r} not in the peak table and no peak stated: MFU cannot be implied",
            )
        )


def _check_mfu(
    res: ClaimResult,
    n_params: float,
    n_compute: float,
    tps: float | None,
    devices: int,
    stated_mfu: float | None,
) -> None:
    """The MFU 6N x tokens/s implies on the devices' dense peak (N: the parameters a token passes
    through), against 100% and the stated MFU; a mixture of experts' stated MFU over every parameter
    is named as such."""
    if tps is not None and res.peak_tflops:
        res.implied_mfu = mfu(6 * n_compute, tps, 1.0, res.peak_tflops, devices)
        if res.implied_mfu > 1.0:
            res.flags.append(
                Flag(
                    "impossible",
                    f"implied MFU {res.implied_mfu:.1%} > 100%: {tps:,.0f} tokens/s exceeds the devices' peak",
                )
            )
    if stated_mfu is not None:
        if stated_mfu > 1.0:
            res.flags.append(Flag("impossible", f"stated MFU {stated_mfu:.1%} > 100%"))
        all_params_mfu = (
            mfu(6 * n_params, tps, 1.0, res.peak_tflops, devices)
            if n_compute < n_params and tps is not None and res.peak_tflops
            else None
        )
        if all_params_mfu is not None and abs(stated_mfu - all_params_mfu) <= DISAGREE_REL * all_params_mfu:
            res.flags.append(
                Flag(
                    "impossible",
                    f"stated MFU {stated_mfu:.1%} counts all {n_params:,.0f} parameters of a mixture of "
                    f"experts (6 x model_params); over the {n_compute:,.0f} active it is {res.implied_mfu:.1%}",
                )
            )
        elif res.implied_mfu is not None and abs(stated_mfu - res.implied_mfu) > DISAGREE_REL * res.implied_mfu:
            res.flags.append(
                Flag(
                    "impossible",
                    f"stated MFU {stated_mfu:.1%} disagrees with implied "
                    f"{res.implied_mfu:.1%} by more than 10% relative",
                )
            )


def _check_days(
    claim: dict,
    res: ClaimResult,
    n_params: float,
    n_compute: float,
    tokens: float,
    tps: float | None,
    days: float | None,
    stated_mfu: float | None,
    devices: int,
) -> None:
    """Days the tokens take at the claimed tokens/s (or at the stated MFU), against the stated days."""
    if claim.get("tokens_per_second") is not None and tps is not None:
        res.implied_days = tokens / tps / SECONDS_PER_DAY
    elif stated_mfu is not None and res.peak_tflops:
        peak_flops = res.peak_tflops * 1e12 * devices
        res.implied_days = 6 * n_compute * tokens / (stated_mfu * peak_flops) / SECONDS_PER_DAY
    if (
        days is not None
        and res.implied_days is not None
        and claim.get("tokens_per_second") is not None
        and abs(days - res.implied_days) > DISAGREE_REL * res.implied_days
    ):
        res.flags.append(
            Flag(
                "impossible",
                f"stated {days:g} days disagrees with tokens / tokens_per_second = {res.implied_days:.3g} days",
            )
        )
    res.tokens_per_param = tokens / n_params
    res.tokens_per_param_vs_chinchilla = res.tokens_per_param / CHINCHILLA_TOKENS_PER_PARAM


def audit_claim(claim: dict, where: str = "claim", *, plausible_mfu: float = PLAUSIBLE_MFU) -> ClaimResult:
    """Implied figures and flags of one claim (see the module docstring)."""
    unknown = set(map(str, claim)) - set(KEYS)
    if unknown:
        raise RunnerError(f"unknown keys {sorted(unknown)} (known: {', '.join(KEYS)})", file=where)
    name = str(claim.get("name") or "").strip()
    if not name:
        raise RunnerError("missing", file=where, key="name")
    n_params = _number(claim, "model_params", where)
    if n_params is None and claim.get("mixture") is None:
        raise RunnerError(
            "missing (a mixture of experts states its total here and active_params; a mixture claim may "
            "leave it out and state mixture:)",
            file=where,
            key="model_params",
        )
    active = _number(claim, "active_params", where)
    res = ClaimResult(name, dict(claim), "active" if active is not None else "all")
    res.source = parse_source(claim.get("source"), where)
    _check_token_kind(claim, where, res)
    if n_params is not None:
        _audit_throughput(claim, where, res, n_params, active, plausible_mfu)
    if claim.get("mixture") is not None:
        res.mixture, flags = audit_mixture(claim, where)
        res.flags += [Flag(severity, message) for severity, message in flags]
    return res


def _audit_throughput(
    claim: dict, where: str, res: ClaimResult, n_params: float, active: float | None, plausible_mfu: float
) -> None:
    """Implied MFU, days and tokens per parameter of a claim that states its model size."""
    if active is not None and active > n_params:
        raise RunnerError(
            f"{active:,.0f} active exceed the {n_params:,.0f} model_params (the total, every expert)",
            file=where,
            key="active_params",
        )
    n_compute = active if active is not None else n_params  # parameters a token passes through
    tokens = None if claim.get("tokens") is None else parse_quantity(claim["tokens"], TOKEN_UNITS, where, "tokens")
    tps = _number(claim, "tokens_per_second", where)
    days = _number(claim, "days", where)
    stated_mfu = _number(claim, "mfu", where)
    stated_peak = _number(claim, "peak_tflops", where)
    devices = claim.get("devices", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or not 0 < devices <= MAX_DEVICES:
        raise RunnerError(
            f"must be a positive integer up to {MAX_DEVICES:,}, got {str(devices)[:20]}", file=where, key="devices"
        )
    if any(claim.get(k) is not None for k in ("hardware", "tokens_per_second", "days", "mfu", "peak_tflops")):
        _resolve_peak(claim, stated_peak, res)  # a model size and tokens alone imply tokens per parameter only
    if tps is None and tokens is not None and days is not None:
        tps = tokens / (days * SECONDS_PER_DAY)
    _check_mfu(res, n_params, n_compute, tps, devices, stated_mfu)
    _plausibility(res, stated_mfu, plausible_mfu)
    if tokens is not None:
        _check_days(claim, res, n_params, n_compute, tokens, tps, days, stated_mfu, devices)


def load_claims(path: str | Path) -> list[dict]:
    path = Path(path)
    data = read_yaml(path)
    claims = data.get("claims") if isinstance(data, dict) else data
    if claims is None or claims == []:
        raise RunnerError("holds no claims: nothing to audit (state at least one under `claims:`)", file=str(path))
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        raise RunnerError("expected a list of claims (mappings), or a mapping with key 'claims'", file=str(path))
    return claims


def audit_claims(path: str | Path, *, plausible_mfu: float = PLAUSIBLE_MFU) -> list[ClaimResult]:
    if not (0.0 < plausible_mfu <= 1.0):
        raise RunnerError(f"must be in (0, 1], got {plausible_mfu!r}", key="--plausible-mfu")
    return [
        audit_claim(c, f"{path}: claims[{i}]", plausible_mfu=plausible_mfu) for i, c in enumerate(load_claims(path))
    ]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _throughput_row(r: ClaimResult) -> str:
    days = "-" if r.implied_days is None else f"{r.implied_days:.3g}"
    tpp = "-" if r.tokens_per_param is None else f"{r.tokens_per_param:.3g}"
    vs = "-" if r.tokens_per_param_vs_chinchilla is None else f"{r.tokens_per_param_vs_chinchilla:.3g}"
    peak = "-" if r.peak_tflops is None else f"{r.peak_tflops:g}"
    stated = r.claim.get("mfu")
    if r.claim.get("model_params") is None:
        counted = "-"
    else:
        n = r.claim["active_params"] if r.params_counted == "active" else r.claim["model_params"]
        counted = f"{float(n):.3g} {r.params_counted}"
    return (
        f"{r.name[:32]:<32} {counted:>12} {peak:>9} {_pct(r.implied_mfu):>11} "
        f"{_pct(None if stated is None else float(stated)):>10} {days:>8} {tpp:>9} {vs:>12}  {r.verdict}"
    )


def render(results: list[ClaimResult], plausible_mfu: float = PLAUSIBLE_MFU) -> str:
    lines = [
        f"Implied MFU convention: {CONVENTION}.",
        f"IMPOSSIBLE: cannot be true (MFU > 100%, sparse peak, figures that contradict each other); "
        f"IMPLAUSIBLE: MFU above {plausible_mfu:.0%}, beyond any published dense BF16 training run ({PLAUSIBLE_MFU_SOURCE}).",
        "Mixtures: implied epochs = weight x total / source; INCONSISTENT: stated epochs or tokens seen more than 10% "
        "from the implied, or weights off 100% by more than their printed digits allow; INCOMPARABLE: a kind or "
        "device unstated; WARNING: repetition worth less (D'/D < 0.9).",
        f"{'claim':<32} {'N counted':>12} {'peak TF/s':>9} {'implied MFU':>11} {'stated MFU':>10} {'days':>8} "
        f"{'tok/param':>9} {'x Chinchilla':>12}  verdict",
    ]
    for r in results:
        lines.append(_throughput_row(r))
        lines.append(f"    {source_line(r.source)}")
        if r.mixture is not None:
            lines += render_mixture(r.mixture)
        lines += [f"    - {f.severity}: {f.message}" for f in r.flags]
    return "\n".join(lines)
