"""What a run vouches for when its report is written, recorded where an edit of the report cannot reach.

Owns: the evidence record (format `runner-evidence/1`): the sha256 of each report table's canonical
text (exactly the bytes of the CSV copy the report writes), of the report's experiment.yaml, of the
final checkpoint's state.json with the file hashes it lists, and the final per-domain validation
losses; writing it as report/evidence.json; logging it to the run's MLflow run as `evidence.*`
tags (the copy the audit trusts: a forger who rewrites a report folder rewrites evidence.json too,
not the tracking store); reading it back from those tags.
Never: judges anything (runner.reports.audit compares), trains, or writes outside report/.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from runner.errors import RunnerError
from runner.fsio import atomic_write_json, read_json, sha256_file
from runner.reports import tables as rpt
from runner.training.runjson import RunJson

if TYPE_CHECKING:
    from runner.reports.audit_input import AuditInput

FORMAT = "runner-evidence/1"
EVIDENCE_FILE = "evidence.json"


def table_text(name: str, df: pd.DataFrame) -> str:
    """A report table as the CSV text `write_report` writes for it (typed by the schema)."""
    return rpt._typed(name, df).to_csv(index=False)


def table_sha256(name: str, df: pd.DataFrame) -> str:
    """sha256 of a table's canonical text: equal to `sha256sum report/<name>.csv`."""
    return hashlib.sha256(table_text(name, df).encode()).hexdigest()


def final_validation(validation: pd.DataFrame) -> dict[str, Any]:
    """{"step": last evaluated step, "domains": {d: {"loss_nats", "bpb"}}} ({} without evaluations)."""
    if validation.empty:
        return {}
    step = int(validation["step"].max())
    last = validation[validation["step"] == step]
    return {
        "step": step,
        "domains": {str(r.domain): {"loss_nats": float(r.loss_nats), "bpb": float(r.bpb)} for r in last.itertuples()},
    }


def final_checkpoint(run_dir: Path, committed_steps: int) -> dict[str, Any] | None:
    """The checkpoint written at the run's last committed step: its state.json hash and the file
    hashes state.json lists (computed when it was written); None when there is none."""
    from runner.training.checkpoint import MARKER, dirname  # noqa: PLC0415  (imports torch)

    path = Path(run_dir) / "checkpoints" / dirname(committed_steps)
    if not (path / MARKER).exists() or not (path / "state.json").exists():
        return None
    state = read_json(path / "state.json")
    return {
        "step": int(committed_steps),
        "state_json_sha256": sha256_file(path / "state.json"),
        "files": {str(k): str(v) for k, v in sorted((state.get("files") or {}).items())},
    }


def build_evidence(run_dir: str | Path, report: Path | None = None) -> dict[str, Any]:
    """The evidence of a run folder whose report is written (in report/, or in `report`: the folder
    write_report is building)."""
    run_dir = Path(run_dir)
    report = run_dir / rpt.REPORT_DIR if report is None else Path(report)
    tables = rpt.read_tables(report)
    summary = tables["run_summary"].iloc[0]
    run = RunJson.from_dict(read_json(run_dir / "run.json"), file=str(run_dir / "run.json"))
    committed = int(run.committed_steps if run.has("committed_steps") else summary["steps"])
    return {
        "format": FORMAT,
        "schema_version": str(summary["schema_version"]),
        "tables": {name: table_sha256(name, df) for name, df in tables.items()},
        "experiment_yaml_sha256": sha256_file(report / "experiment.yaml"),
        "checkpoint": final_checkpoint(run_dir, committed),
        "validation": final_validation(tables["validation"]),
    }


def write_evidence(run_dir: str | Path) -> dict[str, Any]:
    """Build the evidence of a run folder and write it as report/evidence.json."""
    evidence = build_evidence(run_dir)
    atomic_write_json(Path(run_dir) / rpt.REPORT_DIR / EVIDENCE_FILE, evidence)
    return evidence


def write_report_with_evidence(run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """Write run_dir/report/ with its evidence.json in it, put in place whole (tables.write_report):
    a writer killed midway never leaves a report without its evidence. Returns (report/, evidence)."""
    run_dir = Path(run_dir)
    built: dict[str, Any] = {}

    def seal(staged: Path) -> None:
        built.update(build_evidence(run_dir, staged))
        atomic_write_json(staged / EVIDENCE_FILE, built)

    return rpt.write_report(run_dir, seal=seal), built


def record_evidence(run_dir: str | Path, tracker, evidence: dict[str, Any] | None = None) -> dict[str, Any]:
    """At the end of a run: log the report's evidence (written as report/evidence.json by
    `write_report_with_evidence`, else now) to the MLflow run as tags (journaled like every other
    entry when the server is unreachable, sent by `runner sync`)."""
    if evidence is None:
        evidence = write_evidence(run_dir)
    if tracker is not None:
        tracker.log_tags(evidence_tags(evidence))
    return evidence


def read_evidence_file(report_dir: Path) -> dict[str, Any] | None:
    path = Path(report_dir) / EVIDENCE_FILE
    if not path.exists():
        return None
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RunnerError(f"not a {FORMAT} record", file=str(path))
    return data


# ---- as MLflow tags ------------------------------------------------------------------------------


def evidence_tags(evidence: dict[str, Any]) -> dict[str, str]:
    """Flat `evidence.*` tags (floats as repr, so they read back exactly)."""
    tags = {
        "evidence.format": evidence["format"],
        "evidence.schema_version": evidence["schema_version"],
        "evidence.experiment_yaml.sha256": evidence["experiment_yaml_sha256"],
    }
    tags.update({f"evidence.table.{n}.sha256": h for n, h in evidence["tables"].items()})
    ckpt = evidence.get("checkpoint")
    if ckpt:
        tags["evidence.checkpoint.step"] = str(ckpt["step"])
        tags["evidence.checkpoint.state_json.sha256"] = ckpt["state_json_sha256"]
        tags.update({f"evidence.checkpoint.file.{n}.sha256": h for n, h in ckpt["files"].items()})
    val = evidence.get("validation") or {}
    if val:
        tags["evidence.validation.step"] = str(val["step"])
        for d, v in val["domains"].items():
            tags.update({f"evidence.validation.{d}.{k}": repr(float(x)) for k, x in v.items()})
    return tags


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def evidence_from_tags(tags: dict[str, str]) -> dict[str, Any] | None:
    """The evidence logged as tags, in the shape `build_evidence` returns; None when not logged."""
    if tags.get("evidence.format") != FORMAT:
        return None
    ev: dict[str, Any] = {
        "format": FORMAT,
        "schema_version": tags.get("evidence.schema_version"),
        "experiment_yaml_sha256": tags.get("evidence.experiment_yaml.sha256"),
        "tables": {},
        "checkpoint": None,
        "validation": {},
    }
    files: dict[str, Any] = {}
    domains: dict[str, Any] = {}
    for key, value in tags.items():
        if key.startswith("evidence.table.") and key.endswith(".sha256"):
            ev["tables"][key[len("evidence.table.") : -len(".sha256")]] = value
        elif key.startswith("evidence.checkpoint.file.") and key.endswith(".sha256"):
            files[key[len("evidence.checkpoint.file.") : -len(".sha256")]] = value
        elif key.startswith("evidence.validation.") and key != "evidence.validation.step":
            domain, kind = key[len("evidence.validation.") :].rsplit(".", 1)
            domains.setdefault(domain, {})[kind] = _float(value)
    if "evidence.checkpoint.step" in tags:
        ev["checkpoint"] = {
            "step": int(tags["evidence.checkpoint.step"]),
            "state_json_sha256": tags.get("evidence.checkpoint.state_json.sha256"),
            "files": dict(sorted(files.items())),
        }
    if "evidence.validation.step" in tags:
        ev["validation"] = {"step": int(tags["evidence.validation.step"]), "domains": domains}
    return ev


def canonical(evidence: dict[str, Any]) -> str:
    return json.dumps(evidence, sort_keys=True)


def evidence_differences(want: dict, inp: AuditInput, *, checkpoint: bool) -> list[str]:
    """Where an evidence record (report/evidence.json, or the one logged to MLflow) differs from the
    report the audit reads: table hashes, experiment.yaml's hash, final validation losses, and (with
    `checkpoint`, when the run folder is at hand) the final checkpoint's hashes."""
    problems = []
    if want.get("schema_version") == rpt.written_version(inp.tables):  # tables hashed as they were written
        for name, digest in sorted((want.get("tables") or {}).items()):
            got = table_sha256(name, inp.tables[name]) if name in inp.tables else "missing"
            if got != digest:
                problems.append(f"table {name}: sha256 {got[:12]}, evidence {str(digest)[:12]}")
    if inp.cfg_file is not None and sha256_file(inp.cfg_file) != want.get("experiment_yaml_sha256"):
        problems.append(
            f"experiment.yaml: sha256 {sha256_file(inp.cfg_file)[:12]}, evidence {str(want.get('experiment_yaml_sha256'))[:12]}"
        )
    got_val = final_validation(inp.tables["validation"])
    if canonical(got_val) != canonical(want.get("validation") or {}):
        problems.append(f"final validation: report {got_val}, evidence {want.get('validation')}")
    if checkpoint and inp.run_dir is not None and want.get("checkpoint"):
        step = int(want["checkpoint"]["step"])
        got_ckpt = final_checkpoint(inp.run_dir, step)
        if got_ckpt is None:
            problems.append(f"checkpoint step {step}: not in the run folder")
        elif canonical(got_ckpt) != canonical(want["checkpoint"]):
            problems.append(f"checkpoint step {step}: state.json or file hashes differ from the evidence")
    return problems
