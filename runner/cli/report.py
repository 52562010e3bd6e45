"""CLI verbs `report`, `audit`, `audit-claims`, `publish`, `audit-reports`: parsing and printing only."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from runner.errors import EXIT_DISCREPANCY, EXIT_OK, RunnerError


def _report(args) -> int:
    from runner.reports import tables as rpt

    target = Path(args.run)
    if not target.is_dir():
        if not rpt.MLFLOW_RUN_ID.match(args.run):
            raise RunnerError("no such run folder, and not an MLflow run id", file=args.run)
        fetched = rpt.fetch_mlflow_run(args.run, args.dest or tempfile.mkdtemp(prefix="runner-report-"))
        print(f"report written to {rpt.report_from_fetched(fetched)}")
        return EXIT_OK
    from runner.runs import RunLock, is_run_dir

    # Never rewrite report/ under a launch that writes it too.
    with RunLock(target, "runner report") if is_run_dir(target) else contextlib.nullcontext():
        out = rpt.write_report(target)
    print(f"report written to {out}")
    return EXIT_OK


def _audit(args) -> int:
    from runner.reports.audit import audit

    result = audit(args.run, check_mlflow=not args.no_mlflow)
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.render())
    return EXIT_OK if result.passed else EXIT_DISCREPANCY


def _audit_claims(args) -> int:
    from runner.reports.claims import audit_claims, render

    results = audit_claims(args.file)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(render(results))
    return EXIT_DISCREPANCY if any(r.impossible for r in results) else EXIT_OK


def _publish(args) -> int:
    from runner.reports.publish import publish

    dest, result = publish(args.run_dir, args.reports_dir)
    if not result.passed:
        print(result.render())
        print(f"not published: audit failed ({', '.join(result.failed())})")
        return EXIT_DISCREPANCY
    print(f"published {dest}; index {Path(args.reports_dir) / 'README.md'}")
    return EXIT_OK


DEFAULT_REPORTS_DIR = "reports"


def _reports_dir(args) -> str:
    """The folder given as the positional or as --reports-dir (either spelling; both must agree)."""
    positional, option = args.reports_dir_positional, args.reports_dir
    if positional is not None and option is not None and Path(positional) != Path(option):
        raise RunnerError(
            f"two different folders given: {positional} and --reports-dir {option}; give one", file=positional
        )
    return positional or option or DEFAULT_REPORTS_DIR


def _audit_reports(args) -> int:
    from runner.reports.publish import audit_reports

    results = audit_reports(_reports_dir(args))
    for r in results:
        print(r.render() if args.verbose or not r.passed else f"PASS {r.source}")
    failed = [r.source for r in results if not r.passed]
    print(f"{len(results) - len(failed)} of {len(results)} published reports pass")
    return EXIT_DISCREPANCY if failed else EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="(re)build a run's report/ folder from its run folder or MLflow run id")
    p.add_argument(
        "run",
        metavar="RUN_DIR|MLFLOW_RUN_ID",
        help="run folder (holds run.json and ledger.json) or a 32-hex MLflow run id",
    )
    p.add_argument("--dest", help="where to download an MLflow run's artifacts (default: a temp folder)")
    p.set_defaults(func=_report)

    p = subparsers.add_parser("audit", help="check a report: schemas, invariants, sampler replay, FLOPs, MFU, cost")
    p.add_argument("run", metavar="RUN", help="run folder, report folder, or MLflow run id")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.add_argument("--no-mlflow", action="store_true", help="do not compare against the MLflow run")
    p.set_defaults(func=_audit)

    p = subparsers.add_parser(
        "audit-claims", help="check published training claims (YAML) for implied MFU and impossible figures"
    )
    p.add_argument("file", help="YAML file of claims (model size, device, tokens per second, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.set_defaults(func=_audit_claims)

    p = subparsers.add_parser("publish", help="audit a run, then copy its report to reports/<experiment>/<run_id>/")
    p.add_argument("run_dir", help="run folder to audit and publish (its report/ is written if missing)")
    p.add_argument(
        "--reports-dir",
        default=DEFAULT_REPORTS_DIR,
        help="folder of published reports and their README.md index (default: reports)",
    )
    p.set_defaults(func=_publish)

    p = subparsers.add_parser("audit-reports", help="audit every published report (CI)")
    p.add_argument(
        "reports_dir_positional",
        nargs="?",
        metavar="REPORTS_DIR",
        help="folder of published reports (default: reports)",
    )
    p.add_argument("--reports-dir", default=None, help="the same folder, as an option (kept for old scripts)")
    p.add_argument("--verbose", action="store_true", help="print every check of every report")
    p.set_defaults(func=_audit_reports)
