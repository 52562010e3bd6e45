"""CLI verbs `report`, `audit`, `audit-claims`, `publish`, `audit-reports`: parsing and printing only."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from runner.errors import EXIT_DISCREPANCY, EXIT_IN_PROGRESS, EXIT_OK, EXIT_UNVERIFIED, EXIT_USAGE, RunnerError

AUDIT_EXITS = f"""verdicts and exit codes:
  PASS        {EXIT_OK}  every check ran and held, the MLflow run's record included
  FAIL        {EXIT_DISCREPANCY}  a discrepancy: the report disagrees with what it was recounted from
  UNVERIFIED  {EXIT_UNVERIFIED}  nothing disagrees, but the checks named in the last line could not run
              (MLflow run unreachable, run.json missing, a peak that is not a datasheet figure, ...);
              with --require-verified it exits {EXIT_DISCREPANCY} like FAIL
  IN PROGRESS {EXIT_IN_PROGRESS}  `runner audit RUN_DIR` only: a launch, sync or report holds the run folder and is
              writing it; nothing was audited (audit it when that process ends)
  unusable input (not a report, unreadable tables): {EXIT_USAGE}"""


def _report(args) -> int:
    from runner.reports import tables as rpt

    target = Path(args.run)
    if target.is_dir() and args.dest:
        raise RunnerError(
            f"is for an MLflow run id: a run folder's report is written to {target / 'report'}",
            key="--dest",
        )
    if not target.is_dir():
        if not rpt.MLFLOW_RUN_ID.match(args.run):
            raise RunnerError("no such run folder, and not an MLflow run id", file=args.run)
        from runner.fsio import new_or_empty_folder

        dest = Path(args.dest) if args.dest else None
        if dest is not None and not new_or_empty_folder(dest):
            raise RunnerError(
                "exists and is not an empty folder: the run's artifacts are downloaded over what is there "
                "(a run folder's run.json, ledger.json); give a new or empty folder",
                file=args.dest,
                key="--dest",
            )
        fetched = rpt.fetch_mlflow_run(args.run, dest or tempfile.mkdtemp(prefix="runner-report-"))
        print(f"report written to {rpt.report_from_fetched(fetched)}")
        return EXIT_OK
    from runner.reports.audit.evidence import write_report_with_evidence
    from runner.runs.folder import is_report_copy, is_run_dir
    from runner.runs.lock import RunLock

    if is_report_copy(target):  # it was rewritten from nothing ("ledger.json: missing"), a lock file left in it
        raise RunnerError(
            "a report folder: `runner report` rebuilds a report from its run folder (runs/<experiment>/<run_id>); "
            f"`runner audit {args.run}` checks this one",
            file=args.run,
        )
    if not (target / "run.json").exists():  # a run folder's other files missing are named by the report
        raise RunnerError("not a run folder (no run.json): give runs/NAME/RUN_ID or an MLflow run id", file=args.run)

    # Never rewrite report/ under a launch that writes it too.
    with RunLock(target, "runner report") if is_run_dir(target) else contextlib.nullcontext():
        # evidence.json: what this report states; the copy logged to MLflow at the run's end is the proof
        out, _ = write_report_with_evidence(target)
    print(f"report written to {out}")
    return EXIT_OK


def _writer_of(target: str) -> tuple[Path, dict] | None:
    """(run folder, lock record) when `target` is a run folder, or its report/, that a process holds now."""
    from runner.reports.tables import REPORT_DIR
    from runner.runs.folder import is_run_dir
    from runner.runs.lock import lock_holder

    path = Path(target)
    for folder in (path, path.parent) if path.name == REPORT_DIR else (path,):
        held = lock_holder(folder) if folder.is_dir() and is_run_dir(folder) else None
        if held is not None:
            return folder, held
    return None


def _audit(args) -> int:
    from runner.reports.audit.run import audit
    from runner.runs.lock import holder_text

    writer = _writer_of(args.run)
    if writer is not None:  # its report/ and raw files change under the audit: any verdict would be noise
        folder, held = writer
        why = f"in use by {holder_text(held)}: the run is being written; audit it when that process ends"
        if args.json:
            print(json.dumps({"source": str(args.run), "verdict": "IN PROGRESS", "why": why, "holder": held}, indent=1))
        else:
            print(f"IN PROGRESS {args.run}: {why}")
        return EXIT_IN_PROGRESS
    if Path(args.run).is_dir() and (Path(args.run) / "comparison.json").is_file():  # a `compare --out` folder
        from runner.reports.compare.verify import check_comparison

        for flag, given in (("--recompute-eval", args.recompute_eval), ("--checkpoint", args.checkpoint)):
            if given:
                raise RunnerError(
                    f"{flag} rescores one run's checkpoint: give a run folder (runs/EXP/RUN), not a comparison",
                    file=str(args.run),
                )
        result = check_comparison(Path(args.run), args.tracking_uri, check_mlflow=not args.no_mlflow)
        print(json.dumps(result.to_dict(), indent=1) if args.json else result.render())
        return result.exit_code(args.require_verified)
    result = audit(
        args.run,
        check_mlflow=not args.no_mlflow,
        tracking_uri=args.tracking_uri,
        recompute_eval=args.recompute_eval,
        checkpoint=args.checkpoint,
        progress=lambda message: print(message, file=sys.stderr),
    )
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.render())
    return result.exit_code(args.require_verified)


def _audit_claims(args) -> int:
    from runner.errors import display_path
    from runner.reports.claims.source import free_text_warning
    from runner.reports.claims.training import PLAUSIBLE_MFU, audit_claims, render

    bound = PLAUSIBLE_MFU if args.plausible_mfu is None else args.plausible_mfu
    results = []
    for file in args.file:
        found = audit_claims(file, plausible_mfu=bound)
        warning = free_text_warning(display_path(file), [r.source for r in found])
        if warning:
            print(warning, file=sys.stderr)
        results += found
    against = None
    if args.against:
        from runner.reports.claims.against import compare_claims

        against = compare_claims(results, args.against)
    if args.json:
        out: dict | list = [r.to_dict() for r in results]
        print(json.dumps({"claims": out, "against": against.to_dict()} if against else out, indent=1))
    else:
        print(render(results, bound))
        if against:
            print(against.render())
    failing = any(r.failing for r in results) or bool(against and against.contradicted)
    return EXIT_DISCREPANCY if failing else EXIT_OK


CLAIMS_EXITS = f"""verdicts (a claim takes its worst flag's) and exit codes:
  IMPOSSIBLE    cannot be true: MFU > 100%, a sparse peak, more tokens seen than the sources hold
  INCONSISTENT  stated figures contradict the claim's own arithmetic: epochs or tokens seen more than
                10% from weight x total / source, weights off 100% beyond their printed digits
  IMPLAUSIBLE   MFU above the plausibility bound (--plausible-mfu)
  INCOMPARABLE  a token kind or device unstated: the figure cannot be compared
  WARNING       repetition worth less than 0.9 of its tokens (Muennighoff et al. 2023)
  exit {EXIT_DISCREPANCY} when any claim is IMPOSSIBLE, INCONSISTENT or IMPLAUSIBLE, or (--against) the run
  contradicts a stated figure; else {EXIT_OK}; unusable input (a claim file's missing key, wrong type,
  NaN): {EXIT_USAGE}, one line naming the file and key"""


def _publish(args) -> int:
    from runner.reports.publish import card_problem, check_card_destination, exported_card, publish, publish_card

    card = Path(args.card) if args.card else exported_card(Path(args.run_dir))
    why = card_problem(Path(args.run_dir), card) if card is not None else None
    if why:  # before anything is published: --card names a folder that is not this run's final export
        raise RunnerError(why, file=str(card), key="--card")
    if card is not None:  # a card whose files or figures are not the run's is never published
        from runner.export.verify_export import FAIL, verify_export

        failed = [c for c in verify_export(card, Path(args.run_dir)) if c.status == FAIL]
        if failed:
            raise RunnerError(
                "does not verify against the run (runner verify-export): "
                + "; ".join(f"{c.name}: {c.detail}" for c in failed),
                file=str(card),
                key="--card",
            )
        check_card_destination(Path(args.run_dir), Path(args.reports_dir))
    dest, result = publish(args.run_dir, args.reports_dir, require_verified=args.require_verified)
    if dest is None:
        print(result.render())
        why = "audit failed" if result.failed() else "not verified (--require-verified)"
        print(f"not published: {why} ({', '.join(result.failed() or result.unverified())})")
        return EXIT_DISCREPANCY
    if not result.passed:
        print(f"published UNVERIFIED: not verified: {', '.join(result.unverified())}", file=sys.stderr)
    print(f"published {dest}; index {Path(args.reports_dir) / 'README.md'}")
    if card is not None:
        print(f"model card: {publish_card(Path(args.run_dir), card, args.reports_dir)} (from {card})")
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
    from runner.reports.publish import audit_reports, rewrite_index

    if args.write_index:  # before the audit, which then finds it in step
        print(f"index written: {rewrite_index(_reports_dir(args))}")
    reports = audit_reports(_reports_dir(args), tracking_uri=args.tracking_uri)
    cards = _published_cards(Path(_reports_dir(args)))
    from runner.reports.compare.verify import published_comparisons

    comparisons = published_comparisons(Path(_reports_dir(args)), args.tracking_uri)
    results = reports + cards + comparisons
    for r in results:
        if args.verbose or r.verdict == "FAIL":
            print(r.render())
        else:
            print(f"{r.verdict} {r.source}" + (f": {r.summary_line()}" if r.verdict != "PASS" else ""))
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "UNVERIFIED", "FAIL")}
    # each kind counted as what it is: the published comparison was the fifth of "5 published reports"
    kinds = [f"{len(reports)} published reports"] + [
        f"{n} {what if n == 1 else what + 's'}"
        for n, what in ((len(comparisons), "comparison"), (len(cards), "model card"))
        if n
    ]
    print(f"{', '.join(kinds)}: {counts['PASS']} PASS, {counts['UNVERIFIED']} UNVERIFIED, {counts['FAIL']} FAIL")
    if counts["FAIL"]:
        return EXIT_DISCREPANCY
    if counts["UNVERIFIED"]:
        return EXIT_DISCREPANCY if args.require_verified else EXIT_UNVERIFIED
    return EXIT_OK


def _published_cards(reports_dir: Path) -> list:
    """Each published model card (reports/models/<name>/) against the published report of its run:
    its figures recomputed (runner.export.verify_export), one result per card. Where nothing is
    published under models/ (a clone's reports), the checker (torch and transformers, about half the
    verb's time) is not imported."""
    folders = sorted((reports_dir / "models").glob("*/")) if (reports_dir / "models").is_dir() else []
    if not folders:
        return []
    from runner.export.verify_export import check_published_card
    from runner.reports.audit.result import AuditResult, Check

    out = []
    for folder in folders:
        if (folder / "accounting.json").is_file():
            result = AuditResult(str(folder))
            result.checks = [Check(c.name, c.status, c.detail) for c in check_published_card(folder, reports_dir)]
            out.append(result)
    return out


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1], got {text}")
    return value


def register(subparsers) -> None:
    """The five verbs' argparse declarations, in the order `runner --help` lists them."""
    _register_report(subparsers)
    _register_audit(subparsers)
    _register_audit_claims(subparsers)
    _register_publish(subparsers)
    _register_audit_reports(subparsers)


def _register_report(subparsers) -> None:
    """`runner report`."""
    p = subparsers.add_parser("report", help="(re)build a run's report/ folder from its run folder or MLflow run id")
    p.add_argument(
        "run",
        metavar="RUN_DIR|MLFLOW_RUN_ID",
        help="run folder (holds run.json and ledger.json) or a 32-hex MLflow run id",
    )
    p.add_argument(
        "--dest", help="a new or empty folder to download an MLflow run's artifacts to (default: a temp folder)"
    )
    p.set_defaults(func=_report)


def _register_audit(subparsers) -> None:
    """`runner audit`."""
    p = subparsers.add_parser(
        "audit",
        help="check a report against what it cannot rewrite: PASS, FAIL or UNVERIFIED",
        description="Check a report: schemas and invariants, the sampler replayed from experiment.yaml and the "
        "manifests, the fingerprint recomputed, FLOPs, peak, MFU and cost recomputed, and the run's MLflow "
        "record (params, tags, every logged metric, the evidence logged at its end).",
        epilog=AUDIT_EXITS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", metavar="RUN", help="run folder, report folder, or MLflow run id")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.add_argument("--no-mlflow", action="store_true", help="do not read the MLflow run (its checks are UNVERIFIED)")
    p.add_argument(
        "--tracking-uri",
        default=None,
        metavar="URI",
        help="the MLflow store that holds the run (default: run.json's, then $MLFLOW_TRACKING_URI)",
    )
    p.add_argument(
        "--recompute-eval",
        action="store_true",
        help="load the final checkpoint and recompute each domain's validation loss on the pinned samples",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="the checkpoint folder for --recompute-eval when the report is not inside its run folder",
    )
    p.add_argument(
        "--require-verified",
        action="store_true",
        help=f"UNVERIFIED exits {EXIT_DISCREPANCY} (CI), not {EXIT_UNVERIFIED}",
    )
    p.set_defaults(func=_audit)


def _register_audit_claims(subparsers) -> None:
    """`runner audit-claims`."""
    p = subparsers.add_parser(
        "audit-claims",
        help="check published training claims (YAML): implied MFU, mixture tables' epochs, impossible figures",
        epilog=CLAIMS_EXITS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", nargs="+", help="YAML files of claims (model size, device, tokens per second, mixture)")
    p.add_argument("--json", action="store_true", help="machine-readable result")
    p.add_argument(
        "--plausible-mfu",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="MFU above which a claim is IMPLAUSIBLE (default 0.65: above the best published dense BF16 runs)",
    )
    p.add_argument(
        "--against",
        default=None,
        metavar="RUN_OR_REPORT",
        help="a run folder, report folder or MLflow run id: which of each claim's stated figures its ledger supports",
    )
    p.set_defaults(func=_audit_claims)


def _register_publish(subparsers) -> None:
    """`runner publish`."""
    p = subparsers.add_parser("publish", help="audit a run, then copy its report to reports/<experiment>/<run_id>/")
    p.add_argument("run_dir", help="run folder to audit and publish (its report/ is written if missing)")
    p.add_argument(
        "--reports-dir",
        default=DEFAULT_REPORTS_DIR,
        help="folder of published reports and their README.md index (default: reports)",
    )
    p.add_argument(
        "--require-verified", action="store_true", help="publish only a PASS (default: PASS or UNVERIFIED, never FAIL)"
    )
    p.add_argument(
        "--card",
        default=None,
        metavar="EXPORT_DIR",
        help="a `runner export` folder of the run's final checkpoint: its model card goes to "
        "reports/models/<experiment>-<run_id>/ (default: the run's own export.at_end export, when there)",
    )
    p.set_defaults(func=_publish)


def _register_audit_reports(subparsers) -> None:
    """`runner audit-reports`."""
    p = subparsers.add_parser(
        "audit-reports",
        help="audit every published report (CI)",
        description="Audit every published report. Without its MLflow run (CI has none) a published report is at "
        "best UNVERIFIED: every file in its folder can be rewritten together. Give --tracking-uri, the store that "
        "holds the runs, to verify them.",
        epilog=AUDIT_EXITS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "reports_dir_positional",
        nargs="?",
        metavar="REPORTS_DIR",
        help="folder of published reports (default: reports)",
    )
    p.add_argument("--reports-dir", default=None, help="the same folder, as an option (kept for old scripts)")
    p.add_argument("--verbose", action="store_true", help="print every check of every report")
    p.add_argument("--tracking-uri", default=None, metavar="URI", help="the MLflow store that holds the published runs")
    p.add_argument(
        "--require-verified", action="store_true", help=f"UNVERIFIED exits {EXIT_DISCREPANCY}, not {EXIT_UNVERIFIED}"
    )
    p.add_argument(
        "--write-index",
        action="store_true",
        help="first write the index README.md from the published reports (after a hand merge of two publishes)",
    )
    p.set_defaults(func=_audit_reports)
