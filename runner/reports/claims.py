"""Audit published training claims (a YAML list) against the SPEC's arithmetic.

Owns: what a claim file may state, the implied figures (MFU from tokens/s under the 6N convention,
days from MFU or tokens/s, tokens per parameter against Chinchilla's 20) and the flags: figures
that cannot be true (MFU above 100%, a sparse peak as denominator, a stated MFU or duration that
disagrees with the implied one by more than 10% relative, a mixture of experts' MFU that counted
every parameter instead of the active ones) and figures that cannot be compared (token kind
unstated, device unknown).
A mixture-of-experts claim states both `model_params` (total) and `active_params` (what one token
passes through, SPEC "Mixture-of-experts"): its compute, MFU and days use the active count;
tokens per parameter stays over the total.
Never: reads runs or reports, or fills a missing figure from another device's peak.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.fsio import read_yaml
from runner.planning.hardware import PEAKS, canonical_device

TOKEN_KINDS = ("exposure", "unique", "useful", "processed")
CHINCHILLA_TOKENS_PER_PARAM = 20.0
DISAGREE_REL = 0.10
CONVENTION = (
    "6N (Kaplan/Chinchilla): flops_per_token = 6 * params as claimed (a mixture of experts: active_params); "
    "dense bf16 peak per device"
)
SECONDS_PER_DAY = 86400.0
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
)


@dataclass
class Flag:
    severity: str  # "impossible" or "unstated"
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

    @property
    def impossible(self) -> bool:
        return any(f.severity == "impossible" for f in self.flags)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["impossible"] = self.impossible
        return d


def _number(claim: dict, key: str, where: str, *, positive: bool = True) -> float | None:
    value = claim.get(key)
    if value is None:
        return None
    if isinstance(value, bool):
        raise RunnerError(f"must be a number, got {value!r}", file=where, key=key)
    try:
        x = float(value)  # YAML 1.1 reads `68e3` as a string; accept it as the number it says
    except (TypeError, ValueError):
        raise RunnerError(f"must be a number, got {value!r}", file=where, key=key) from None
    if not math.isfinite(x) or (positive and x <= 0):
        raise RunnerError(f"must be a positive number, got {value!r}", file=where, key=key)
    return x


def audit_claim(claim: dict, where: str = "claim") -> ClaimResult:
    """Implied figures and flags of one claim (see the module docstring)."""
    unknown = set(claim) - set(KEYS)
    if unknown:
        raise RunnerError(f"unknown keys {sorted(unknown)} (known: {', '.join(KEYS)})", file=where)
    name = str(claim.get("name") or "").strip()
    if not name:
        raise RunnerError("missing", file=where, key="name")
    n_params = _number(claim, "model_params", where)
    if n_params is None:
        raise RunnerError(
            "missing (a mixture of experts states its total here and active_params)", file=where, key="model_params"
        )
    active = _number(claim, "active_params", where)
    if active is not None and active > n_params:
        raise RunnerError(
            f"{active:,.0f} active exceed the {n_params:,.0f} model_params (the total, every expert)",
            file=where,
            key="active_params",
        )
    n_compute = active if active is not None else n_params  # parameters a token passes through
    tokens = _number(claim, "tokens", where)
    tps = _number(claim, "tokens_per_second", where)
    days = _number(claim, "days", where)
    stated_mfu = _number(claim, "mfu", where)
    stated_peak = _number(claim, "peak_tflops", where)
    devices = claim.get("devices", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices <= 0:
        raise RunnerError(f"must be a positive integer, got {devices!r}", file=where, key="devices")
    res = ClaimResult(name, dict(claim), "active" if active is not None else "all")

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

    if tps is None and tokens is not None and days is not None:
        tps = tokens / (days * SECONDS_PER_DAY)
    peak_flops = res.peak_tflops * 1e12 * devices if res.peak_tflops else None
    if tps is not None and peak_flops:
        res.implied_mfu = 6 * n_compute * tps / peak_flops
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
        all_params_mfu = 6 * n_params * tps / peak_flops if active is not None and tps and peak_flops else None
        if all_params_mfu is not None and abs(stated_mfu - all_params_mfu) <= DISAGREE_REL * all_params_mfu:
            res.flags.append(
                Flag(
                    "impossible",
                    f"stated MFU {stated_mfu:.1%} counts all {n_params:,.0f} parameters of a mixture of "
                    f"experts (6 x model_params); over the {active:,.0f} active it is {res.implied_mfu:.1%}",
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

    if tokens is not None:
        if claim.get("tokens_per_second") is not None:
            res.implied_days = tokens / tps / SECONDS_PER_DAY
        elif stated_mfu is not None and peak_flops:
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
    return res


def load_claims(path: str | Path) -> list[dict]:
    path = Path(path)
    data = read_yaml(path)
    claims = data.get("claims") if isinstance(data, dict) else data
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        raise RunnerError("expected a list of claims (mappings), or a mapping with key 'claims'", file=str(path))
    return claims


def audit_claims(path: str | Path) -> list[ClaimResult]:
    return [audit_claim(c, f"{path}: claims[{i}]") for i, c in enumerate(load_claims(path))]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def render(results: list[ClaimResult]) -> str:
    lines = [
        f"Implied MFU convention: {CONVENTION}.",
        f"{'claim':<32} {'N counted':>12} {'peak TF/s':>9} {'implied MFU':>11} {'stated MFU':>10} {'days':>8} "
        f"{'tok/param':>9} {'x Chinchilla':>12}  verdict",
    ]
    for r in results:
        days = "-" if r.implied_days is None else f"{r.implied_days:.3g}"
        tpp = "-" if r.tokens_per_param is None else f"{r.tokens_per_param:.3g}"
        vs = "-" if r.tokens_per_param_vs_chinchilla is None else f"{r.tokens_per_param_vs_chinchilla:.3g}"
        peak = "-" if r.peak_tflops is None else f"{r.peak_tflops:g}"
        stated = r.claim.get("mfu")
        verdict = "IMPOSSIBLE" if r.impossible else ("FLAGGED" if r.flags else "ok")
        n = r.claim.get("active_params") if r.params_counted == "active" else r.claim.get("model_params")
        counted = f"{float(n):.3g} {r.params_counted}"
        lines.append(
            f"{r.name[:32]:<32} {counted:>12} {peak:>9} {_pct(r.implied_mfu):>11} "
            f"{_pct(None if stated is None else float(stated)):>10} {days:>8} {tpp:>9} {vs:>12}  {verdict}"
        )
        lines += [f"    - {f.severity}: {f.message}" for f in r.flags]
    return "\n".join(lines)
