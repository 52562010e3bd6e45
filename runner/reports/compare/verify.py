"""`runner audit-reports` of a published comparison (reports/comparisons/<name>/): made again from the
report copies it carries.

Owns: remaking a comparison folder's comparison from its `runs/<label>/` copies (the labels and the
`origin` row, what the user named, as comparison.json records them) and comparing it with what the
folder holds. comparison.json is the comparison's data: any other figure there (a target's winner
swapped, a loss edited) is a FAIL. comparison.md, the CSV tables and the plots are renderings of it:
identical bytes are PASS, a difference is UNVERIFIED naming the file (an older runner's wording or
another matplotlib's drawing of the same data differs too), never PASS.
Each copy is audited too (`runner audit`, against its MLflow run where the store is at hand): a copy
that FAILs fails the comparison, one that is UNVERIFIED (offline, the MLflow checks) leaves it
UNVERIFIED, never PASS.
Never: writes into the folder.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.fsio import read_json
from runner.reports import tables as rpt
from runner.reports.audit.result import AuditResult, first_difference
from runner.reports.audit.run import audit
from runner.reports.compare.render import write_folder
from runner.reports.compare.runs import assign_labels, compare, folder_name, load_source

COPIES = "report copies pass the audit"
DATA = "comparison.json = its report copies"
RENDERED = "comparison.md, tables and plots = comparison.json"
REDO = "`runner compare runs/* --out` in the folder writes them again"


def _recorded(folder: Path) -> tuple[dict, list[str]]:
    data = read_json(folder / "comparison.json")  # RunnerError: missing, not JSON, nested too deep
    labels = data.get("labels") if isinstance(data, dict) else None
    if not (isinstance(labels, list) and len(labels) >= 2 and all(isinstance(x, str) for x in labels)):
        raise ValueError("comparison.json names no list of two or more labels")
    return data, labels


def _first_json_difference(ours: Any, theirs: Any, where: str = "") -> str:
    """The first key path at which two JSON values differ, with both values (shortened)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for k in list(ours) + [k for k in theirs if k not in ours]:
            if ours.get(k, ...) != theirs.get(k, ...):
                return _first_json_difference(ours.get(k), theirs.get(k), f"{where}.{k}" if where else str(k))
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                return _first_json_difference(a, b, f"{where}[{i}]")
    return f"{where or 'the file'}: recorded {json.dumps(theirs)[:80]}, the copies give {json.dumps(ours)[:80]}"


def _check_copies(
    result: AuditResult, folder: Path, labels: list[str], tracking_uri: str | None, check_mlflow: bool
) -> None:
    failed, unverified = [], []
    for label in labels:
        copy = folder / "runs" / folder_name(label)
        if not rpt.is_report_dir(copy):
            continue  # DATA names it
        try:
            audited = audit(copy, tracking_uri=tracking_uri, check_mlflow=check_mlflow)
        except RunnerError as err:  # a file missing or unreadable: this copy fails, the other checks still run
            failed.append(f"runs/{copy.name}: cannot be audited: {err}")
            continue
        if audited.failed():
            failed.append(f"runs/{copy.name}: {', '.join(audited.failed())}")
        elif audited.unverified():
            unverified.append(f"runs/{copy.name}: {', '.join(audited.unverified())}")
    if failed:
        result.add(COPIES, failed)
    elif unverified:
        result.could_not(COPIES, "; ".join(unverified))
    else:
        result.add(COPIES, [], ok_detail=f"{len(labels)} copies PASS")


def check_comparison(folder: Path, tracking_uri: str | None = None, *, check_mlflow: bool = True) -> AuditResult:
    """A published comparison folder: its report copies audited (COPIES), the comparison remade from them
    (DATA: FAIL where comparison.json says other figures) and rendered again (RENDERED: UNVERIFIED where
    a rendering differs)."""
    result = AuditResult(str(folder))
    try:
        recorded, labels = _recorded(folder)
    except (OSError, ValueError, RunnerError) as err:
        result.add(DATA, [f"comparison.json unreadable: {err}"])
        return result
    _check_copies(result, folder, labels, tracking_uri, check_mlflow)
    rows = recorded.get("runs")
    rows = rows if isinstance(rows, list) else []  # another shape: DATA finds comparison.json differs
    origins = next((r for r in rows if isinstance(r, dict) and r.get("field") == "origin"), {})
    try:
        sources = []
        for label in labels:
            copy = folder / "runs" / folder_name(label)
            if not rpt.is_report_dir(copy):
                raise RunnerError(f"no report copy of run {label!r} at runs/{folder_name(label)}/")
            sources.append(load_source(str(copy)))
        assign_labels(sources, labels)
        for s in sources:
            s.origin = str(origins.get(s.label, s.origin))
        comp = compare(sources)
        with tempfile.TemporaryDirectory() as tmp:
            write_folder(comp, Path(tmp))
            ours = json.loads((Path(tmp) / "comparison.json").read_text(encoding="utf-8"))
            rendered = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.name != "comparison.json"}
    except RunnerError as err:
        result.add(DATA, [f"its report copies cannot be compared again: {err}"])
        return result
    if ours != recorded:
        result.add(DATA, [_first_json_difference(ours, recorded)])
        return result
    result.add(DATA, [], ok_detail=f"remade from runs/ ({', '.join(labels)}): identical")
    present = [n for n in rendered if (folder / n).is_file()]  # a missing one: the layout check names it
    differ = [n for n in present if (folder / n).read_bytes() != rendered[n]]
    if differ:
        why = [f"{n} differs" for n in differ]
        md = "comparison.md"
        if md in differ:  # where, in the file a reader opens
            written_md = (folder / md).read_text(encoding="utf-8", errors="replace")
            where = first_difference(written_md, rendered[md].decode(), "comparison.json renders")
            why[differ.index(md)] = f"{md} differs ({where})"
        result.could_not(RENDERED, f"{'; '.join(why)}: an edit, or another runner's or matplotlib's rendering; {REDO}")
        return result
    result.add(RENDERED, [], ok_detail=f"{', '.join(present)} rendered again: identical")
    return result


def published_comparisons(reports_dir: Path, tracking_uri: str | None = None) -> list[AuditResult]:
    """check_comparison of each reports/comparisons/<name>/ holding a comparison.json."""
    root = Path(reports_dir) / "comparisons"
    folders = sorted(p.parent for p in root.glob("*/comparison.json")) if root.is_dir() else []
    return [check_comparison(f, tracking_uri) for f in folders]
