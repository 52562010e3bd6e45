"""Mixture claims: a published table of what a model trained on, audited for its own consistency.

Owns: what a claim's `mixture:` may state (per source: tokens or bytes in it, sampling weight,
stated epochs, stated tokens seen), the implied epochs (weight x total / source) and tokens seen
(weight x total), and the flags: stated epochs or tokens seen that disagree with the implied ones
by more than 10% relative (INCONSISTENT, naming the input that would reconcile them), weights that
do not sum to 1 within what their printed digits allow (half a unit of the last digit per weight),
tokens seen above what a source holds at its stated epochs (IMPOSSIBLE), a total whose kind cannot
be compared (INCOMPARABLE) and repetition worth less than 0.9 of its tokens by Muennighoff et al.
(2023), the planner's effective-data model (WARNING, not an error).
Bytes: a source given in bytes is converted with the claim's `bytes_per_token` (a stated or cited
ratio, its source required) or `bytes_per_token: from_table` (total bytes over the unique tokens
the table's own weights and epochs imply); a table in bytes throughout needs no ratio.
Never: reads runs (`against.py` compares a claim with one), or fills a missing figure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from runner.errors import RunnerError
from runner.planning.plan import REPETITION_R_STAR, effective_tokens

DISAGREE_REL = 0.10
REPETITION_VALUE_WARN = 0.9  #: D'/D below this is a WARNING
REPETITION_SOURCE = (
    f"Muennighoff et al. 2023 eq. 5: D' = U + U * R* * (1 - exp(-R / R*)), R = epochs - 1, R* = {REPETITION_R_STAR:g}"
)
SOURCE_KEYS = ("source", "tokens", "bytes", "bytes_per_token", "weight", "epochs", "tokens_seen", "notes")
BYTE_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
BYTE_UNITS |= {"TIB": 2**40, "PB": 1e15}
TOKEN_UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_LIMIT = 1e18  #: no published table counts a quintillion tokens or bytes in one source: larger is a typo
#: No published figure is below a billionth of its unit (tokens, epochs, a weight, days): smaller is a typo,
#: and its products and quotients would underflow to 0 or overflow to infinity.
_SMALLEST = 1e-9


@dataclass
class Figure:
    """A stated number and half a unit of its last printed digit (the rounding its digits allow)."""

    value: float
    half_unit: float


@dataclass
class SourceRow:
    source: str
    weight: float
    size: float  # in the mixture's unit
    stated_as: str  # "tokens" or "bytes"
    implied_epochs: float | None = None
    stated_epochs: float | None = None
    implied_seen: float | None = None
    stated_seen: float | None = None
    repeated_value: float | None = None  # D'/D at the implied epochs
    verdict: str = "ok"
    weight_half_unit: float = 0.0  # the rounding the weight's printed digits allow
    epochs_half_unit: float = 0.0


@dataclass
class MixtureResult:
    unit: str  # "tokens", or "bytes" when every figure is in bytes
    total: float
    bytes_per_token: float | None
    bytes_per_token_source: str
    weight_sum: float
    weight_tolerance: float
    rows: list[SourceRow] = field(default_factory=list)


def _decimals(text: str) -> int:
    mantissa = text.lower().split("e")[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


def _half_unit(value: Any, scale: float = 1.0) -> float:
    """Half a unit of the last digit `value` was written with (a float: its shortest repr)."""
    text = str(value).strip().rstrip("%").strip()
    if "e" in text.lower():
        exponent = int(text.lower().split("e")[1])
        return 0.5 * 10.0 ** (exponent - _decimals(text)) * scale
    return 0.5 * 10.0 ** -_decimals(text) * scale


def in_range(x: float, where: str, key: str) -> float:
    """`x` if it is a figure a claim can state: finite, from a billionth to a quintillion."""
    if not math.isfinite(x) or not _SMALLEST <= x <= _LIMIT:
        raise RunnerError(
            f"must be a positive finite number from {_SMALLEST:.0e} to {_LIMIT:.0e}, got {x!r}", file=where, key=key
        )
    return x


def parse_quantity(value: Any, units: dict[str, float], where: str, key: str) -> float:
    """A positive number, or a string like `3.3 TB`, `227.12 GiB`, `1.4T` in the given units."""
    if isinstance(value, bool) or value is None:
        raise RunnerError(f"must be a number, got {value!r}", file=where, key=key)
    if isinstance(value, int) and abs(value) > _LIMIT:
        raise RunnerError(
            f"must be a positive finite number from {_SMALLEST:.0e} to {_LIMIT:.0e}, got {len(str(value))} digits",
            file=where,
            key=key,
        )
    if isinstance(value, int | float):
        return in_range(float(value), where, key)
    match = _QUANTITY.match(str(value))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in units:
        raise RunnerError(
            f"must be a number or a number with a unit ({', '.join(u for u in units if u)}), got {value!r}",
            file=where,
            key=key,
        )
    return in_range(float(match.group(1)) * units[unit], where, key)


def parse_fraction(value: Any, where: str, key: str) -> Figure:
    """A weight or share: 0.045, or `4.5%`; with the rounding its printed digits allow."""
    if isinstance(value, bool) or value is None:
        raise RunnerError(f"must be a fraction (0.045) or a percent ('4.5%'), got {value!r}", file=where, key=key)
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        x = float(text.rstrip("%")) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise RunnerError(
            f"must be a fraction (0.045) or a percent ('4.5%'), got {value!r}", file=where, key=key
        ) from None
    x = x / 100 if percent else x
    if not math.isfinite(x) or not _SMALLEST <= x <= 1:
        raise RunnerError(f"must be in [{_SMALLEST:.0e}, 1] (or up to 100%), got {value!r}", file=where, key=key)
    return Figure(x, _half_unit(text, 0.01 if percent else 1.0))


def _epochs(value: Any, where: str, key: str) -> Figure | None:
    if value is None:
        return None
    x = parse_quantity(value, {"": 1}, where, key)
    return Figure(x, _half_unit(value))


def _pct(x: float) -> str:
    return f"{x * 100:.4g}%"


def _fmt(x: float, unit: str) -> str:
    for factor, suffix in ((1e12, "T"), (1e9, "B" if unit == "tokens" else "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= factor:
            return f"{x / factor:.4g}{suffix}"
    return f"{x:.4g}"


@dataclass
class _Parsed:
    name: str
    weight: Figure
    size: float
    stated_as: str
    bytes_per_token: float | None
    epochs: Figure | None
    seen: float | None


def _parse_source(entry: Any, where: str) -> _Parsed:
    if not isinstance(entry, dict):
        raise RunnerError(f"must be a mapping of {', '.join(SOURCE_KEYS)}, got {type(entry).__name__}", file=where)
    unknown = sorted(set(map(str, entry)) - set(SOURCE_KEYS))
    if unknown:
        raise RunnerError(f"unknown keys {unknown} (known: {', '.join(SOURCE_KEYS)})", file=where)
    name = entry.get("source")
    if not isinstance(name, str) or not name.strip():
        raise RunnerError("missing (the source's name as the table prints it)", file=where, key="source")
    if "weight" not in entry:
        raise RunnerError("missing (the sampling weight: 0.045 or '4.5%')", file=where, key="weight")
    if ("tokens" in entry) == ("bytes" in entry):
        raise RunnerError("give one of tokens (in the source) or bytes (its size on disk)", file=where, key="tokens")
    stated_as = "tokens" if "tokens" in entry else "bytes"
    size = parse_quantity(entry[stated_as], TOKEN_UNITS if stated_as == "tokens" else BYTE_UNITS, where, stated_as)
    bpt = entry.get("bytes_per_token")
    seen = entry.get("tokens_seen")
    return _Parsed(
        name.strip(),
        parse_fraction(entry["weight"], where, "weight"),
        size,
        stated_as,
        None if bpt is None else parse_quantity(bpt, {"": 1}, where, "bytes_per_token"),
        _epochs(entry.get("epochs"), where, "epochs"),
        None if seen is None else parse_quantity(seen, TOKEN_UNITS, where, "tokens_seen"),
    )


def _total(claim: dict, where: str) -> tuple[float, str]:
    has_tokens, has_bytes = claim.get("tokens") is not None, claim.get("bytes") is not None
    if has_tokens == has_bytes:
        raise RunnerError(
            "a mixture needs the total it was sampled over: tokens (training tokens) or bytes, one of them",
            file=where,
            key="tokens",
        )
    if has_tokens:
        return parse_quantity(claim["tokens"], TOKEN_UNITS, where, "tokens"), "tokens"
    return parse_quantity(claim["bytes"], BYTE_UNITS, where, "bytes"), "bytes"


def _ratio(claim: dict, sources: list[_Parsed], total: float, where: str) -> tuple[float | None, str]:
    """The claim's bytes per token and where it comes from (`from_table`: total bytes over the unique
    tokens the weights and stated epochs imply, sum of weight x total / epochs)."""
    value, source = claim.get("bytes_per_token"), claim.get("bytes_per_token_source")
    if value is None:
        return None, ""
    if value == "from_table":
        if not all(s.stated_as == "bytes" and s.epochs for s in sources):
            raise RunnerError(
                "from_table needs every source in bytes with its stated epochs", file=where, key="bytes_per_token"
            )
        unique = sum(s.weight.value * total / s.epochs.value for s in sources if s.epochs)
        ratio = sum(s.size for s in sources) / unique
        return ratio, (
            f"from the table's own totals: {_fmt(sum(s.size for s in sources), 'bytes')} bytes over the "
            f"{_fmt(unique, 'tokens')} unique tokens its weights and epochs imply (sum of weight x total / epochs)"
        )
    ratio = parse_quantity(value, {"": 1}, where, "bytes_per_token")
    if not isinstance(source, str) or not source.strip():
        raise RunnerError(
            "a stated bytes_per_token needs its source (the paper's statement, or the one cited)",
            file=where,
            key="bytes_per_token_source",
        )
    return ratio, source.strip()


def parse_mixture(claim: dict, where: str) -> tuple[list[_Parsed], float, str, float | None, str]:
    """(sources, total, unit, bytes_per_token, its source) with bytes converted to the one unit."""
    entries = claim.get("mixture")
    if not isinstance(entries, list) or not entries:
        raise RunnerError("must be a non-empty list of sources", file=where, key="mixture")
    sources = [_parse_source(e, f"{where}: mixture[{i}]") for i, e in enumerate(entries)]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise RunnerError(f"a source named twice: {sorted({n for n in names if names.count(n) > 1})}", file=where)
    total, total_as = _total(claim, where)
    bpt, bpt_source = _ratio(claim, sources, total, where) if total_as == "tokens" else (None, "")
    if total_as == "bytes":
        if claim.get("bytes_per_token") is not None:
            bpt, bpt_source = _ratio(claim, sources, total, where)
        if any(s.stated_as == "tokens" for s in sources):
            raise RunnerError("the total is in bytes: give every source in bytes too", file=where, key="bytes")
        return sources, total, "bytes", bpt, bpt_source
    for s in sources:
        if s.stated_as == "bytes":
            ratio = s.bytes_per_token or bpt
            if ratio is None:
                raise RunnerError(
                    f"source {s.name!r} is in bytes and the total in tokens: give bytes_per_token "
                    "(a number with bytes_per_token_source, or from_table)",
                    file=where,
                    key="bytes_per_token",
                )
            s.size = s.size / ratio
    return sources, total, "tokens", bpt, bpt_source


# ---- the audit ---------------------------------------------------------------------------------------------
def _reconcile(s: _Parsed, total: float, unit: str, bpt: float | None) -> str:
    """The inputs, one at a time, that would make the stated epochs hold."""
    assert s.epochs is not None
    e = s.epochs.value
    size = s.weight.value * total / e
    options = [f"{_fmt(size, unit)} {unit} in the source"]
    if s.stated_as == "bytes" and unit == "tokens" and bpt:
        bytes_size = s.size * (s.bytes_per_token or bpt)
        options.append(f"{bytes_size / size:.3g} bytes per token for it")
    options.append(f"weight {_pct(e * s.size / total)}")
    options.append(f"a total of {_fmt(e * s.size / s.weight.value, unit)}")
    return "; or ".join(options)


def _check_source(s: _Parsed, row: SourceRow, total: float, unit: str, bpt: float | None) -> list[tuple[str, str]]:
    flags: list[tuple[str, str]] = []
    implied, e = row.implied_epochs, s.epochs
    # What the weight's printed digits allow carries into every figure derived from it: "3%" is
    # 2.5-3.5%, so the epochs and tokens seen it implies span the same relative range.
    low, high = (
        (s.weight.value - s.weight.half_unit) / s.weight.value,
        (s.weight.value + s.weight.half_unit) / s.weight.value,
    )
    if implied is not None and e is not None and abs(e.value - implied) > DISAGREE_REL * implied:
        span = f"{implied * low:.3g}-{implied * high:.3g}"
        if e.value + e.half_unit >= implied * low and e.value - e.half_unit <= implied * high:
            flags.append(
                (
                    "note",
                    f"{s.name}: stated {e.value:g} epochs is {abs(e.value - implied) / implied:.0%} from the implied "
                    f"{implied:.3g}, within the {span} that the printed digits of the weight "
                    f"({_pct(s.weight.value)} +- {_pct(s.weight.half_unit)}) and epochs allow: consistent",
                )
            )
        else:
            flags.append(
                (
                    "inconsistent",
                    f"{s.name}: stated {e.value:g} epochs, implied {implied:.3g} ({span} within the weight's printed "
                    f"digits; = weight {_pct(s.weight.value)} x total {_fmt(total, unit)} / {_fmt(s.size, unit)} "
                    f"{unit}), more than 10% apart; reconciled by " + _reconcile(s, total, unit, bpt),
                )
            )
    if s.seen is not None and row.implied_seen is not None:
        seen = s.seen if unit == "tokens" else s.seen * (bpt or math.nan)
        lo, hi = row.implied_seen * low, row.implied_seen * high
        if math.isfinite(seen) and abs(seen - row.implied_seen) > DISAGREE_REL * row.implied_seen:
            within = lo <= seen <= hi
            flags.append(
                (
                    "note" if within else "inconsistent",
                    f"{s.name}: stated {_fmt(s.seen, 'tokens')} tokens seen, implied {_fmt(row.implied_seen, unit)} "
                    f"{unit} (weight x total; {_fmt(lo, unit)}-{_fmt(hi, unit)} within the weight's printed digits), "
                    + ("more than 10% apart but within that range: consistent" if within else "more than 10% apart"),
                )
            )
        if e is not None and unit == s.stated_as == "tokens" and s.seen > s.size * (e.value + e.half_unit):
            flags.append(
                (
                    "impossible",
                    f"{s.name}: {_fmt(s.seen, 'tokens')} tokens seen exceed what the source holds at its stated "
                    f"{e.value:g} epochs ({_fmt(s.size, unit)} x {e.value:g} = {_fmt(s.size * e.value, unit)})",
                )
            )
    value = row.repeated_value
    if value is not None and value < REPETITION_VALUE_WARN and implied is not None:
        flags.append(
            (
                "warning",
                f"{s.name}: {implied:.3g} epochs: repeated tokens are worth D'/D = {value:.2f} of their count "
                f"(< {REPETITION_VALUE_WARN:g}; {REPETITION_SOURCE})",
            )
        )
    return flags


def _repeated_value(epochs: float) -> float:
    """D'/D: the effective tokens of `epochs` passes over a source, per token seen (1 up to one pass)."""
    if epochs <= 1:
        return 1.0
    return effective_tokens(1.0, epochs) / epochs


def _check_totals(sources: list[_Parsed], total: float, unit: str, result: MixtureResult) -> list[tuple[str, str]]:
    flags = []
    if abs(result.weight_sum - 1.0) > result.weight_tolerance + 1e-12:
        flags.append(
            (
                "inconsistent",
                f"weights sum to {result.weight_sum:.4%}; their printed digits allow 100% +- "
                f"{result.weight_tolerance:.3%} (half a unit of the last digit per weight)",
            )
        )
    # What the sources hold at their stated epochs, only where their sizes are as stated (a size converted
    # from bytes is as good as the ratio, and its epochs are checked above).
    if all(s.epochs and s.stated_as == unit for s in sources):
        held = sum(s.size * (s.epochs.value + s.epochs.half_unit) for s in sources if s.epochs)
        if total > held * (1 + 1e-9):
            flags.append(
                (
                    "impossible",
                    f"the total {_fmt(total, unit)} {unit} exceeds what the sources hold at their stated epochs "
                    f"(sum of source x epochs = {_fmt(held, unit)})",
                )
            )
    return flags


def audit_mixture(claim: dict, where: str) -> tuple[MixtureResult, list[tuple[str, str]]]:
    """The per-source table and the flags (severity, message) of a claim's `mixture:`."""
    sources, total, unit, bpt, bpt_source = parse_mixture(claim, where)
    result = MixtureResult(
        unit,
        total,
        bpt,
        bpt_source,
        weight_sum=sum(s.weight.value for s in sources),
        weight_tolerance=sum(s.weight.half_unit for s in sources),
    )
    flags: list[tuple[str, str]] = []
    epochs_meaningful = claim.get("token_kind") != "unique"
    if not epochs_meaningful:
        flags.append(
            (
                "unstated",
                "the total counts unique tokens: weight x total is not what was seen, so epochs cannot be implied",
            )
        )
    for s in sources:
        row = SourceRow(s.name, s.weight.value, s.size, s.stated_as, stated_epochs=s.epochs.value if s.epochs else None)
        row.stated_seen = s.seen
        row.weight_half_unit, row.epochs_half_unit = s.weight.half_unit, s.epochs.half_unit if s.epochs else 0.0
        if epochs_meaningful:
            row.implied_seen = s.weight.value * total
            row.implied_epochs = row.implied_seen / s.size
            row.repeated_value = _repeated_value(row.implied_epochs)
        own = _check_source(s, row, total, unit, bpt)
        severities = {sev for sev, _ in own}
        row.verdict = next(
            (v for sev, v in _ROW_VERDICTS if sev in severities),
            "ok (printed digits)" if "note" in severities else "ok",
        )
        flags += own
        result.rows.append(row)
    flags += _check_totals(sources, total, unit, result)
    return result, flags


_ROW_VERDICTS = (("impossible", "IMPOSSIBLE"), ("inconsistent", "INCONSISTENT"), ("warning", "WARNING"))


def render_mixture(m: MixtureResult) -> list[str]:
    unit = m.unit
    lines = []
    if m.bytes_per_token:
        lines.append(f"    bytes per token {m.bytes_per_token:.3g}: {m.bytes_per_token_source}")
    lines.append(
        f"    {'source':<22} {'weight':>8} {unit:>10} {'implied ep':>10} {'stated ep':>9} {'D/D':>5}  verdict".replace(
            "D/D", "D'/D"
        )
    )
    for r in m.rows:
        implied = "-" if r.implied_epochs is None else f"{r.implied_epochs:.3g}"
        stated = "-" if r.stated_epochs is None else f"{r.stated_epochs:g}"
        value = "-" if r.repeated_value is None else f"{r.repeated_value:.2f}"
        lines.append(
            f"    {r.source[:22]:<22} {r.weight:>8.2%} {_fmt(r.size, unit):>10} {implied:>10} {stated:>9} "
            f"{value:>5}  {r.verdict}"
        )
    lines.append(
        f"    total {_fmt(m.total, unit)} {unit}; weights sum {m.weight_sum:.4%} (+- {m.weight_tolerance:.3%} allowed)"
    )
    return lines
