"""A claim against a run: which of a mixture claim's stated figures an audited run's ledger supports.

Owns: matching a claim's sources to the run's domains (by name, case-insensitive) and the verdict of
each stated figure against the run's accounting table (SPEC "Token counters"): the total (of the
claim's token kind) against the run's total of that counter, each weight against the realized
ratio (within the rounding the weight's printed digits allow), the tokens in a source against its
pool, stated epochs against exposure / pool and stated tokens seen against exposure (within 1%, or
the printed digits' rounding when larger). A source the run lacks, or a domain the claim leaves
out, is a figure the run does not support.
The run is audited first (`runner audit --no-mlflow`: schemas, invariants, the sampler replayed):
a run that FAILs its audit supports nothing, and the comparison says so.
Never: changes the run or its report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from runner.reports.claims.mixture import SourceRow
from runner.reports.claims.training import ClaimResult

AGAINST_REL = 0.01  #: a run's counters are exact; a claim's figures are rounded to a few digits
COUNTER_OF_KIND = {"exposure": "exposure_tokens", "unique": "unique_tokens", "useful": "useful_tokens"}
COUNTER_OF_KIND["processed"] = "processed_tokens"


@dataclass
class Check:
    claim: str
    figure: str
    stated: str
    run: str
    verdict: str  # "supported", "NOT SUPPORTED" or "incomparable"


@dataclass
class AgainstResult:
    target: str
    run_audit: str  # the run's own audit verdict without MLflow: PASS, UNVERIFIED or FAIL
    run_audit_failed: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def contradicted(self) -> bool:
        return self.run_audit == "FAIL" or any(c.verdict == "NOT SUPPORTED" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "run_audit": self.run_audit,
            "run_audit_failed": self.run_audit_failed,
            "contradicted": self.contradicted,
            "checks": [asdict(c) for c in self.checks],
        }

    def render(self) -> str:
        audit_line = f"its own audit without MLflow: {self.run_audit}"
        if self.run_audit == "FAIL":
            audit_line += f" ({', '.join(self.run_audit_failed)}): its ledger supports no figure"
        lines = [f"against {self.target} ({audit_line}):"]
        lines.append(f"  {'claim':<28} {'figure':<30} {'stated':>12} {'run':>12}  verdict")
        for c in self.checks:
            lines.append(f"  {c.claim[:28]:<28} {c.figure[:30]:<30} {c.stated:>12} {c.run:>12}  {c.verdict}")
        supported = sum(c.verdict == "supported" for c in self.checks)
        lines.append(f"  {supported} of {len(self.checks)} stated figures supported by the run")
        return "\n".join(lines)


def _close(stated: float, run: float, half_unit: float = 0.0) -> bool:
    return abs(stated - run) <= max(AGAINST_REL * abs(run), half_unit) + 1e-12


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _verdict(ok: bool) -> str:
    return "supported" if ok else "NOT SUPPORTED"


def _source_checks(name: str, row: SourceRow, unit: str, dom: dict[str, float]) -> list[Check]:
    pool, exposure = dom["pool_tokens"], dom["exposure_tokens"]
    ratio, epochs = dom["realized_ratio"], dom["epochs"]
    checks = [
        Check(
            name,
            f"{row.source}: weight",
            f"{row.weight:.4g}",
            f"{ratio:.4g}",
            _verdict(_close(row.weight, ratio, row.weight_half_unit)),
        )
    ]
    if row.stated_as == "tokens" and unit == "tokens":
        checks.append(
            Check(
                name,
                f"{row.source}: tokens in source",
                _num(row.size),
                _num(pool),
                _verdict(_close(row.size, pool)),
            )
        )
    if row.stated_epochs is not None:
        ok = _close(row.stated_epochs, epochs, row.epochs_half_unit)
        checks.append(Check(name, f"{row.source}: epochs", f"{row.stated_epochs:g}", f"{epochs:.4g}", _verdict(ok)))
    if row.stated_seen is not None:
        ok = _close(row.stated_seen, exposure)
        checks.append(Check(name, f"{row.source}: tokens seen", _num(row.stated_seen), _num(exposure), _verdict(ok)))
    return checks


def claim_against(result: ClaimResult, domains: dict[str, dict[str, float]]) -> list[Check]:
    """The checks of one claim's mixture against the run's per-domain accounting rows."""
    m = result.mixture
    if m is None:
        return [Check(result.name, "mixture", "-", "-", "incomparable")]
    checks = []
    kind = result.claim.get("token_kind")
    if m.unit == "tokens":
        counter = COUNTER_OF_KIND.get(str(kind), "exposure_tokens")
        run_total = sum(d[counter] for d in domains.values())
        verdict = _verdict(_close(m.total, run_total)) if kind in COUNTER_OF_KIND else "incomparable"
        label = f"total ({kind} tokens)" if kind in COUNTER_OF_KIND else "total (kind unstated; vs exposure)"
        checks.append(Check(result.name, label, _num(m.total), _num(run_total), verdict))
    by_name = {d.lower(): d for d in domains}
    claimed = set()
    for row in m.rows:
        domain = by_name.get(row.source.lower())
        if domain is None:
            checks.append(Check(result.name, f"{row.source}: in the run", "yes", "no", "NOT SUPPORTED"))
            continue
        claimed.add(domain)
        checks += _source_checks(result.name, row, m.unit, domains[domain])
    for domain in sorted(set(domains) - claimed):
        checks.append(Check(result.name, f"{domain}: in the claim", "no", "yes", "NOT SUPPORTED"))
    return checks


def compare_claims(results: list[ClaimResult], target: str) -> AgainstResult:
    """Every mixture claim of `results` against the run or report `target` (folder or MLflow run id)."""
    from runner.reports.audit.run import audit  # noqa: PLC0415 - pandas and the report tables, only with --against
    from runner.reports.compare.runs import load_source  # noqa: PLC0415 - the same

    source = load_source(target)
    audited = audit(target, check_mlflow=False)
    accounting = source.tables["accounting"]
    domains = {str(r["domain"]): {k: float(r[k]) for k in _COLUMNS} for _, r in accounting.iterrows()}
    out = AgainstResult(str(target), audited.verdict, audited.failed())
    for r in results:
        if r.mixture is not None:
            out.checks += claim_against(r, domains)
    return out


_COLUMNS: tuple[str, ...] = ("pool_tokens", "exposure_tokens", "unique_tokens", "useful_tokens", "processed_tokens")
_COLUMNS += ("realized_ratio", "epochs")
