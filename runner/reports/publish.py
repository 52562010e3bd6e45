"""Publish audited reports into the repository's reports/ folder and keep its index.

Owns: the rule that a report the audit FAILs is never published (and, with require_verified, that
only a PASS is), the published layout `reports/<experiment>/<run_id>/` (small files only: the
tables, report.md, plots, experiment.yaml, run.json, manifests/ and evidence.json), the index
reports/README.md, the published run.json without machine paths, and auditing every published report (what CI runs).

What a published report can prove: its folder carries everything the offline checks recount from
(tables, experiment.yaml, manifests, run.json), but every one of those files can be rewritten
together, evidence.json included. Only the run's MLflow record (params, tags, metric history and the
evidence tags logged when the run ended) is out of a forger's reach, so a published report is PASS
only where its MLflow run can be read (`runner audit-reports --tracking-uri URI`); elsewhere (CI) it
is at best UNVERIFIED, naming the MLflow checks. run.json must name the MLflow run for that to work.
Never: publishes a failing report, copies checkpoints or large files, or edits a run folder
(except writing its report/ when it has none).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from runner.config.load import load_saved_experiment, repo_root
from runner.errors import RunnerError
from runner.fsio import atomic_write, check_output_folder, read_json, replace_folder, staging_folder
from runner.reports import markdown
from runner.reports import tables as rpt
from runner.reports.audit.evidence import write_report_with_evidence
from runner.reports.audit.result import first_difference
from runner.reports.audit.run import AuditResult, audit
from runner.runs.folder import RunFolder, experiment_of_run, is_reportable_run
from runner.runs.lock import holder_text, lock_holder
from runner.runs.runjson import as_record

MAX_FILE_BYTES = 2 * 1024 * 1024
INDEX = "README.md"


def _report_files(report_dir: Path) -> list[Path]:
    files = sorted(p for p in report_dir.rglob("*") if p.is_file())
    too_big = [
        f"{p.relative_to(report_dir)} ({p.stat().st_size:,} bytes)" for p in files if p.stat().st_size > MAX_FILE_BYTES
    ]
    if too_big:
        raise RunnerError(
            f"refusing to publish files over {MAX_FILE_BYTES:,} bytes: {', '.join(too_big)}", file=str(report_dir)
        )
    return files


INDEX_TITLE = "# Published runs"


def check_destination(dest: Path, run_dir: Path, reports_dir: Path, is_ours) -> None:
    """Where a publish would write, refused (one line, before anything is written) where it would lose
    something: `dest` is replaced whole, so it must be new or what `is_ours` recognises (an earlier
    publish of it), and never the run folder or inside or around it (`--reports-dir runs` replaced the
    run folder by its report, checkpoints gone); the index README.md is rewritten, so one that is not an
    index (`--reports-dir .`: the project's README) is refused."""
    check_output_folder(reports_dir, "--reports-dir")
    where, run = dest.resolve(), run_dir.resolve()
    if where.is_relative_to(run) or run.is_relative_to(where):
        raise RunnerError(
            f"{dest} is inside or around the run folder {run_dir}: give the repository's reports folder",
            key="--reports-dir",
        )
    if dest.exists() and not (dest.is_dir() and is_ours(dest)):
        raise RunnerError(
            f"{dest} exists and is not a published copy: publishing replaces it whole; give the repository's "
            "reports folder",
            key="--reports-dir",
        )
    index = reports_dir / INDEX
    if index.exists() and not index.read_text(errors="replace").startswith(INDEX_TITLE):
        raise RunnerError(
            f"{index} is not a published-runs index (publishing rewrites it): give the repository's reports folder",
            key="--reports-dir",
        )


def publish(
    run_dir: str | Path, reports_dir: str | Path = "reports", *, require_verified: bool = False
) -> tuple[Path | None, AuditResult]:
    """Audit, then copy run_dir/report/ to reports/<experiment>/<run_id>/ and rebuild the index.

    Returns (published folder, audit result). A FAIL (or, with `require_verified`, anything but a
    PASS) publishes nothing and returns None as the folder: the result says why.
    """
    run_dir, reports_dir = Path(run_dir), Path(reports_dir)
    if not is_reportable_run(run_dir):
        raise RunnerError("not a run folder (needs run.json and ledger.json)", file=str(run_dir))
    held = lock_holder(run_dir)
    if held is not None:
        raise RunnerError(f"in use by {holder_text(held)}: publish it when that process ends", file=str(run_dir))
    report_dir = run_dir / rpt.REPORT_DIR
    if not rpt.is_report_dir(report_dir):
        write_report_with_evidence(run_dir)
    result = audit(run_dir)
    if not result.consistent or (require_verified and not result.passed):
        return None, result
    summary = rpt.read_tables(report_dir)["run_summary"].iloc[0]
    files = _report_files(report_dir)
    lacks = _incomplete_report(report_dir, published=True)
    if lacks:  # audit-reports would FAIL it: a report cut short, or written without its evidence
        raise RunnerError(
            f"{rpt.REPORT_DIR}/ is incomplete ({', '.join(lacks)} missing): rebuild it with `runner report RUN_DIR`",
            file=str(run_dir),
        )
    dest = reports_dir / str(summary["experiment"]) / str(summary["run_id"])
    check_destination(dest, run_dir, reports_dir, rpt.is_report_dir)
    staged = staging_folder(dest)  # renamed into place whole: a killed publish leaves no partial report
    for f in files:
        target = staged / f.relative_to(report_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.relative_to(staged) == Path("run.json"):
            info = read_json(f)
            root = Path(as_record(info).project_root or repo_root(run_dir))
            target.write_text(json.dumps(portable(info, root), indent=1))
        else:
            shutil.copy2(f, target)
    replace_folder(staged, dest)
    write_index(reports_dir)
    return dest, result


# prefix of an absolute path -> prefix of its relative form (a relative file URI has no spelling)
_URI_PREFIXES = {"sqlite:///": "sqlite:///", "file://": "", "": ""}


def portable(value, project_root: Path):
    """`value` (run.json, or any part of it) without machine paths: an absolute path, or a SQLite or
    file URI of one, inside `project_root` becomes relative to it (`project_root` itself becomes
    "."); one outside it becomes null; the home folder inside any other text becomes `~`. Keys stay,
    so readers of published run.json files find every field they knew."""
    root = Path(project_root).resolve()
    if isinstance(value, dict):
        return {k: portable(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, root) for v in value]
    if not isinstance(value, str):
        return value
    for prefix, relative_prefix in _URI_PREFIXES.items():
        rest = value[len(prefix) :]
        if value.startswith(prefix) and rest.startswith("/"):
            path = Path(rest).resolve()
            if path == root or root in path.parents:
                return relative_prefix + path.relative_to(root).as_posix()
            return None
    home = str(Path.home())
    return value.replace(home, "~") if home not in ("/", "") else value


def published_reports(reports_dir: str | Path) -> list[Path]:
    """Every reports/<experiment>/<run_id>/ folder holding a report."""
    reports_dir = Path(reports_dir)
    return sorted(p.parent for p in reports_dir.glob("*/*/run_summary.parquet"))


def index_rows(reports_dir: str | Path) -> pd.DataFrame:
    """One row per complete published report (an incomplete one, a publish cut short or a hand copy, is
    not indexed: audit-reports FAILs it on its own)."""
    rows = []
    for folder in published_reports(reports_dir):
        if _incomplete_report(folder, published=True):
            continue
        tables = rpt.read_tables(folder)
        s = tables["run_summary"].iloc[0]
        losses = markdown.final_losses(tables["validation"])
        rows.append(
            {
                "experiment": s["experiment"],
                "version": s["version"],
                "run": f"[{s['run_id']}]({folder.relative_to(reports_dir).as_posix()}/report.md)",
                "fingerprint": str(s["fingerprint"])[:12],
                "processed tokens": f"{int(s['processed_tokens']):,}",
                "exposure tokens": f"{int(s['exposure_tokens']):,}",
                "unique tokens": f"{int(s['unique_tokens']):,}",
                "useful tokens": f"{int(s['useful_tokens']):,}",
                "lost tokens": f"{int(s['lost_tokens']):,}",
                "final loss (nats)": ", ".join(f"{d} {v:.3f}" for d, v in sorted(losses.items())) or "-",
                "MFU (convention)": f"{float(s['mfu']):.1%} ({s['flops_formula']}, {s['params_counted']}, "
                f"{float(s['peak_tflops']):g} TF/s {s['peak_dtype']}, {s['time_basis']} time)",
                "$ / B useful tokens": f"{float(s['cost_per_billion_useful_tokens']):.4g}",
            }
        )
    return pd.DataFrame(rows)


def index_text(reports_dir: str | Path) -> str:
    """reports/README.md as this runner writes it from the published reports (their run_summary and
    validation tables)."""
    df = index_rows(reports_dir)
    lines = [
        INDEX_TITLE,
        "",
        "Generated by `runner publish`; every row passed `runner audit` and is re-audited in CI by "
        "`runner audit-reports`. Token kinds and the MFU convention are defined in each report.md.",
        "",
    ]
    if df.empty:
        lines.append("No published runs yet.")
    else:
        cols = list(df.columns)
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def write_index(reports_dir: str | Path) -> Path:
    """Regenerate reports/README.md from the published reports."""
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    path = reports_dir / INDEX
    atomic_write(path, index_text(reports_dir).encode())
    return path


def rewrite_index(reports_dir: str | Path) -> Path:
    """`runner audit-reports --write-index`: the index written again from the published reports, refused
    (one line, nothing written) where REPORTS_DIR holds none or its README.md is not an index (`.`: the
    project's README)."""
    reports_dir = Path(reports_dir)
    if not reports_dir.is_dir():
        raise RunnerError("no such folder of published reports", file=str(reports_dir))
    index = reports_dir / INDEX
    if index.exists() and not index.read_text(errors="replace").startswith(INDEX_TITLE):
        raise RunnerError(
            "not a published-runs index (it would be written over): give the reports folder", file=str(index)
        )
    if not index.exists() and not published_reports(reports_dir):
        raise RunnerError("no published reports (<experiment>/<run_id>/) to index", file=str(reports_dir))
    return write_index(reports_dir)


INDEX_CHECK = "index = the published reports"


def index_results(reports_dir: str | Path) -> list[AuditResult]:
    """A FAIL where reports/README.md, the page a reader opens first ("every row passed runner audit"),
    is not what the published reports it lists render: a row's MFU edited from 19.4% to 59.4%, a row of
    a report that is not there, a report it leaves out (a hand-merged index). Nothing where it is."""
    reports_dir = Path(reports_dir)
    index = reports_dir / INDEX
    fix = "`runner audit-reports --write-index` writes it from the published reports"
    if not index.is_file():
        if not published_reports(reports_dir):
            return []
        problem = f"no {INDEX} beside the published reports; {fix}"
    else:
        written = index.read_text(encoding="utf-8", errors="replace")
        try:
            ours = index_text(reports_dir)
        except RunnerError as err:  # a published report cut short: the layout check names it too
            result = AuditResult(str(index))
            result.could_not(INDEX_CHECK, f"the published reports cannot be indexed: {err}")
            return [result]
        if written == ours:
            return []
        problem = f"{first_difference(written, ours, 'the published reports give')}; {fix}"
    result = AuditResult(str(index))
    result.add(INDEX_CHECK, [problem])
    return [result]


#: What may sit under reports/ besides the index and published runs (reports/<experiment>/<run_id>/,
#: each a complete report): the documented kinds, by folder, and what each holds.
DOCUMENTED_KINDS = {
    "comparisons": "<name>/: a `runner compare --out` folder (comparison.json, comparison.md, its CSV tables and "
    "plots, runs/<label>/: complete copies of the compared reports)",
    "claims": "claims files for `runner audit-claims` (*.yaml) and README.md",
    "models": "<name>/: an exported model card (README.md, with accounting.json and experiment.yaml beside it)",
}
PUBLISHED_EXTRA_FILES = ("evidence.json",)  # a published report carries these beyond a report's own files
COMPARISON_FILES = ("comparison.json", "comparison.md", "runs.csv", "quality.csv", "accounting.csv", "speed.csv")
MODEL_CARD_FILES = ("README.md",)
LAYOUT = "a complete report or a documented kind"


def _incomplete_report(folder: Path, *, published: bool) -> list[str]:
    """What a report folder lacks to be whole (domains from its experiment.yaml)."""
    try:
        domains = sorted(load_saved_experiment(folder / "experiment.yaml").config.mixture.domains)
    except RunnerError as err:
        return [f"experiment.yaml unreadable ({err})"] if (folder / "experiment.yaml").exists() else ["experiment.yaml"]
    missing = rpt.missing_report_files(folder, domains)
    return missing + [f for f in PUBLISHED_EXTRA_FILES if published and not (folder / f).is_file()]


def _kind_problems(folder: Path) -> list[str]:
    """Problems of a documented kind's folder (reports/comparisons, reports/claims, reports/models)."""
    problems = []
    entries = sorted(folder.iterdir())
    if folder.name == "claims":
        return [
            f"{e.name}: not a claims file (*.yaml) or README.md"
            for e in entries
            if not (e.is_file() and (e.suffix == ".yaml" or e.name == INDEX))
        ]
    wanted = COMPARISON_FILES if folder.name == "comparisons" else MODEL_CARD_FILES
    for entry in entries:
        if not entry.is_dir():
            problems.append(f"{entry.name}: a file where only folders belong")
            continue
        lacks = [f for f in wanted if not (entry / f).is_file()]
        if folder.name == "comparisons":
            copies = sorted(p for p in (entry / "runs").glob("*") if p.is_dir())
            lacks += [] if copies else ["runs/"]
            for copy in copies:
                lacks += [f"runs/{copy.name}/{f}" for f in _incomplete_report(copy, published=False)]
        if lacks:
            problems.append(
                f"{entry.name}: incomplete ({', '.join(lacks[:8])}{' ...' if len(lacks) > 8 else ''} missing)"
            )
    return problems


#: what `runner export` writes beside the weights that a published card carries (MODEL_CARD_FILES first),
#: and the record that says which run and checkpoint the folder was exported from
CARD_FILES = (*MODEL_CARD_FILES, "accounting.json", "experiment.yaml")
EXPORT_RECORD = "export.json"


def card_problem(run_dir: Path, card_dir: Path) -> str | None:
    """Why the exported folder `card_dir` is not of `run_dir`'s final checkpoint (None when it is)."""
    card_dir = Path(card_dir)
    if not (card_dir / EXPORT_RECORD).is_file():
        return f"not an exported model folder (no {EXPORT_RECORD})"
    lacks = [f for f in CARD_FILES if not (card_dir / f).is_file()]
    if lacks:
        return f"no model card ({', '.join(lacks)} missing)"
    record, run = read_json(card_dir / EXPORT_RECORD), RunFolder(run_dir).record()
    if record.get("fingerprint") != run.fingerprint:
        return (
            f"exported from fingerprint {str(record.get('fingerprint'))[:12]}, the run is {str(run.fingerprint)[:12]}"
        )
    if int(record.get("step", -1)) != int(run.committed_steps):
        return f"exported at step {record.get('step')}, not the run's final step {run.committed_steps}"
    ran = read_json(card_dir / "accounting.json").get("run_id")
    if ran != run.run_id:
        return f"the card is of run {ran}, not {run.run_id}"
    return None


def exported_card(run_dir: Path) -> Path | None:
    """The folder a finished run exported itself to (`export.at_end`/<run id>), when it is there and
    holds the card of the run's final checkpoint."""
    if not (Path(run_dir) / "experiment.yaml").is_file():
        return None  # not a run folder: publish says so
    exp = experiment_of_run(Path(run_dir))
    if not exp.config.export.at_end:
        return None
    folder = exp.resolve_path(exp.config.export.at_end) / Path(run_dir).name  # as runner.export.at_end_folder
    return folder if folder.is_dir() and card_problem(run_dir, folder) is None else None


def check_card_destination(run_dir: Path, reports_dir: Path) -> Path:
    """reports/models/<experiment>-<run_id>/, checked as check_destination checks a report's folder
    (`runner publish` checks it before it publishes the report, so a refusal leaves nothing half done)."""
    run = RunFolder(run_dir).record()
    name = load_saved_experiment(run_dir / "experiment.yaml").config.name
    dest = reports_dir / "models" / f"{name}-{run.run_id}"
    check_destination(dest, run_dir, reports_dir, lambda d: (d / MODEL_CARD_FILES[0]).is_file())
    return dest


def publish_card(run_dir: Path, card_dir: Path, reports_dir: str | Path = "reports") -> Path:
    """Copy an exported folder's card (CARD_FILES) to reports/models/<experiment>-<run_id>/, the
    documented kind `audit-reports` accepts; refused (one line) unless it is of the run's final checkpoint."""
    why = card_problem(run_dir, card_dir)
    if why:
        raise RunnerError(why, file=str(card_dir))
    dest = check_card_destination(Path(run_dir), Path(reports_dir))
    staged = staging_folder(dest)
    for f in CARD_FILES:
        shutil.copy2(Path(card_dir) / f, staged / f)
    replace_folder(staged, dest)
    return dest


def layout_results(reports_dir: str | Path) -> list[AuditResult]:
    """One FAIL per folder or file under reports/ that is neither a complete published report nor a
    documented kind (DOCUMENTED_KINDS): a publish killed midway, a report without its plots or
    evidence, a stray file. Published reports are audited on their own by `audit_reports`."""
    reports_dir = Path(reports_dir)
    found: list[tuple[Path, list[str]]] = []
    for top in sorted(reports_dir.iterdir()) if reports_dir.is_dir() else []:
        if top.is_file():
            if top.name != INDEX:
                found.append(
                    (top, ["a file under reports/ that is neither the index (README.md) nor a documented kind"])
                )
        elif top.name in DOCUMENTED_KINDS:
            found.append((top, _kind_problems(top)))
        else:
            for entry in sorted(top.iterdir()):
                if not entry.is_dir():
                    found.append((entry, ["a file where only published reports (<experiment>/<run_id>/) belong"]))
                elif not rpt.is_report_dir(entry):
                    found.append(
                        (entry, ["not a report (no run_summary.parquet): a publish cut short, or a stray folder"])
                    )
                else:
                    lacks = _incomplete_report(entry, published=True)
                    found.append((entry, [f"incomplete report: {', '.join(lacks)} missing"] if lacks else []))
    results = []
    for path, problems in found:
        if problems:
            result = AuditResult(str(path))
            result.add(LAYOUT, problems)
            results.append(result)
    return results


def audit_reports(reports_dir: str | Path = "reports", *, tracking_uri: str | None = None) -> list[AuditResult]:
    """Audit every published report, against its MLflow run where the store is on hand (the one run.json
    records, or `tracking_uri`); where it is not (CI), the MLflow checks are UNVERIFIED. Every folder
    under reports/ that is neither a complete report nor a documented kind is a FAIL of its own, as is
    an index README.md that is not what the published reports render."""
    broken = layout_results(reports_dir)
    skip = {Path(r.source) for r in broken}
    audited = [
        audit(folder, tracking_uri=tracking_uri) for folder in published_reports(reports_dir) if folder not in skip
    ]
    return broken + index_results(reports_dir) + audited
