"""What a run vouches for when its report is written, recorded where an edit of the report cannot reach.

Owns: the evidence record (format `runner-evidence/1`): the sha256 of each report table's canonical
text (exactly the bytes of the CSV copy the report writes), of the report's experiment.yaml, of the
final checkpoint's state.json with the file hashes it lists, and the final per-domain validation
losses; writing it as report/evidence.json; logging it to the run's MLflow run as `evidence.*`
tags (the copy the audit trusts: a forger who rewrites a report folder rewrites evidence.json too,
not the tracking store); reading it back from those tags. After a `runner eval` scoring
(vouch_for_runner_eval): the downstream table's sha256 with that scoring, logged as
`evidence.runner_eval.<stem>.downstream.sha256` only when the table without it is one the logged
evidence already vouches for, so that a report rebuilt with the scoring matches MLflow's evidence and
an edit made before the scoring is never vouched for.
Never: judges anything (runner.reports.audit.run compares), trains, or writes outside report/ (but
that one MLflow tag).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from runner.errors import RunnerError
from runner.fsio import atomic_write_json, read_json, sha256_file
from runner.reports import tables as rpt
from runner.reports.downstream.table import downstream_table
from runner.runs.checkpoints import MARKER, dirname
from runner.runs.runjson import RunJson
from runner.training.tracking import fail_fast_env, missing_store
from schemas.report_tables import SCHEMA_VERSION

if TYPE_CHECKING:
    from runner.reports.audit.input import AuditInput

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
    raw = read_json(run_dir / "run.json")
    run = RunJson.from_dict(raw, file=str(run_dir / "run.json"))
    committed = int(run.committed_steps if run.has("committed_steps") else summary["steps"])
    return {
        "format": FORMAT,
        "schema_version": str(summary["schema_version"]),
        "tables": {name: table_sha256(name, df) for name, df in tables.items()},
        "experiment_yaml_sha256": sha256_file(report / "experiment.yaml"),
        "checkpoint": final_checkpoint(run_dir, committed),
        "validation": final_validation(tables["validation"]),
        "train_jsonl_sha256": train_jsonl_sha256(run_dir),
        "record_figures_sha256": record_figures_sha256(
            read_json(report / "run.json") if (report / "run.json").is_file() else raw
        ),
    }


#: run.json's records that report.md renders and no table or MLflow metric states: the start-up, evaluation
#: time and device-busy lines ("How fast")
RECORD_FIGURES = ("t_startup", "t_eval", "system")


def record_figures(run: Any) -> dict[str, float]:
    """`path.to.leaf` -> every number of run.json's RECORD_FIGURES (text left out: a published copy's paths
    are made portable, its numbers never change)."""
    out: dict[str, float] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[path] = value

    for key in RECORD_FIGURES:
        walk(run.get(key) if isinstance(run, dict) else None, key)
    return out


def record_figures_sha256(run: Any) -> str | None:
    """sha256 of record_figures' canonical JSON (None where run.json holds none of them)."""
    figures = record_figures(run)
    return hashlib.sha256(json.dumps(figures, sort_keys=True).encode()).hexdigest() if figures else None


def train_jsonl_sha256(run_dir: Path) -> str | None:
    """sha256 of the run folder's metrics/train.jsonl: every step's loss, learning rate, gradient norm and
    times, which no table holds but training.png draws (None without one)."""
    path = Path(run_dir) / TRAIN_JSONL
    return sha256_file(path) if path.is_file() else None


TRAIN_JSONL = "metrics/train.jsonl"


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


def vouch_for_runner_eval(run_dir: str | Path, record: Path) -> str:
    """After `runner eval` wrote `record` (RUN/downstream/eval-step-NNNNNNN[-K].json): log to the run's
    MLflow run the sha256 of the downstream table with the scoring (runner_eval_tag), when the table
    without it is one the logged evidence vouches for (vouched_downstream). Returns the line to say:
    what was logged, or why nothing was (no MLflow run, no evidence yet, a store not reachable, a run
    folder whose figures changed since MLflow's evidence was logged); first, the scoring's own figures are
    logged as metrics (log_runner_eval_figures) wherever the run is reachable."""
    run_dir, record = Path(run_dir), Path(record)
    recorded = RunJson.from_dict(read_json(run_dir / "run.json"), file=str(run_dir / "run.json")).mlflow or {}
    run_id = recorded.get("run_id")
    if not run_id:
        return (
            "evidence: the run has no MLflow run (trained with --no-tracking): only rescoring vouches for this "
            "scoring (`runner audit --recompute-eval`)"
        )
    tag = runner_eval_tag(record.stem.removeprefix("eval-"))
    try:
        before = table_sha256("downstream", downstream_table(run_dir, exclude=(record,)))
        after = table_sha256("downstream", downstream_table(run_dir))
    except RunnerError as err:
        return f"evidence: not logged: the run folder's downstream figures are unreadable ({err})"
    not_logged = (
        "evidence: not logged to MLflow (a report rebuilt with this scoring FAILs `MLflow evidence = the report`)"
    )
    candidates = [recorded.get("tracking_uri"), os.environ.get("MLFLOW_TRACKING_URI")]
    uri = next((u for u in candidates if u and missing_store(u) is None), None)
    if uri is None:
        return f"{not_logged}: no store of MLflow run {run_id} here ({missing_store(candidates[0])})"
    fail_fast_env(timeout_seconds=5)  # a dead server costs seconds, not minutes
    from mlflow.tracking import MlflowClient  # noqa: PLC0415  (mlflow: seconds to import)

    client = MlflowClient(tracking_uri=uri)
    try:
        logged = evidence_from_tags(client.get_run(run_id).data.tags)
    except Exception as err:  # an unreachable server, an unknown run: nothing to vouch with
        return f"{not_logged}: MLflow run {run_id} not readable at {uri} ({type(err).__name__})"
    figures = log_runner_eval_figures(client, run_id, record)
    line = _vouch(client, run_id, logged, tag, before, after, not_logged, uri)
    return f"{figures}; {line}"


def log_runner_eval_figures(client, run_id: str, record: Path) -> str:
    """Log a `runner eval` scoring's figures as MLflow metrics `runner_eval/<task>/<metric>` at the
    scored step, just after it scored them: what the audit compares the report's runner eval rows
    with once a later segment's evidence covers whatever the run folder then holds
    (runner.reports.audit.downstream_tracked). Returns the line to say."""
    from mlflow.entities import Metric  # noqa: PLC0415  (mlflow: seconds to import)

    data = read_json(record)
    step, now = int(data["step"]), int(time.time() * 1000)
    metrics = [Metric(f"runner_eval/{r['task']}/{r['metric']}", float(r["value"]), now, step) for r in data["rows"]]
    try:
        client.log_batch(run_id, metrics=metrics)
    except Exception as err:
        return f"figures: not logged to MLflow run {run_id} ({type(err).__name__})"
    return f"figures: {len(metrics)} logged to MLflow run {run_id} at step {step} (runner_eval/<task>/<metric>)"


def _vouch(client, run_id: str, logged, tag: str, before: str, after: str, not_logged: str, uri: str) -> str:
    if logged is None:
        return f"evidence: MLflow run {run_id} holds no evidence yet: the run's end logs it, this scoring included"
    if logged.get("schema_version") != SCHEMA_VERSION:
        return f"{not_logged}: its evidence was logged under {logged.get('schema_version')}, this runner writes {SCHEMA_VERSION}"
    if before not in vouched_downstream(logged):
        return (
            f"{not_logged}: the run folder's downstream figures without this scoring (sha256 {before[:12]}) are not "
            "those MLflow's evidence vouches for: they changed after it was logged"
        )
    try:
        client.set_tag(run_id, tag, after)
    except Exception as err:
        return f"{not_logged}: MLflow run {run_id} at {uri} refused the tag ({type(err).__name__})"
    return f"evidence: MLflow run {run_id} vouches for the downstream table with this scoring ({tag} = {after[:12]})"


def read_evidence_file(report_dir: Path) -> dict[str, Any] | None:
    path = Path(report_dir) / EVIDENCE_FILE
    if not path.exists():
        return None
    data = read_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RunnerError(f"not a {FORMAT} record", file=str(path))
    wrong = _shape_problem(data)  # read by key below: a wrong shape is named, never a traceback
    if wrong is not None:
        raise RunnerError(wrong[1], file=str(path), key=wrong[0])
    return data


def _shape_problem(data: dict[str, Any]) -> tuple[str, str] | None:
    """(key, problem) where an evidence record is first not of the shape `build_evidence` writes."""
    tables = data.get("tables")
    if not (isinstance(tables, dict) and all(isinstance(v, str) for v in tables.values())):
        return "tables", "must map each table to its sha256"
    for key in ("checkpoint", "validation", "runner_eval"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            return key, "must be a JSON object or null"
    ckpt = data.get("checkpoint")
    if ckpt is not None and not (
        isinstance(ckpt.get("step"), int) and not isinstance(ckpt["step"], bool) and isinstance(ckpt.get("files"), dict)
    ):
        return "checkpoint", "must hold a whole-number step and its files' sha256s"
    for key in ("train_jsonl_sha256", "record_figures_sha256"):
        if data.get(key) is not None and not isinstance(data[key], str):
            return key, "must be a sha256 (text) or null"
    val = data.get("validation")
    if val and not (isinstance(val.get("domains"), dict) and all(isinstance(v, dict) for v in val["domains"].values())):
        return "validation.domains", "must map each domain to its losses"
    return None


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
    if evidence.get("train_jsonl_sha256"):
        tags[TRAIN_TAG] = evidence["train_jsonl_sha256"]
    if evidence.get("record_figures_sha256"):
        tags[RECORD_TAG] = evidence["record_figures_sha256"]
    val = evidence.get("validation") or {}
    if val:
        tags["evidence.validation.step"] = str(val["step"])
        for d, v in val["domains"].items():
            tags.update({f"evidence.validation.{d}.{k}": repr(float(x)) for k, x in v.items()})
    return tags


def runner_eval_tag(stem: str) -> str:
    """The tag vouching for the downstream table with `runner eval`'s scoring `stem` (step-NNNNNNN[-K])."""
    return f"{RUNNER_EVAL_PREFIX}{stem}.downstream.sha256"


RUNNER_EVAL_PREFIX = "evidence.runner_eval."
TRAIN_TAG = "evidence.train_jsonl.sha256"
RECORD_TAG = "evidence.run_json.figures.sha256"


def vouched_downstream(evidence: dict[str, Any]) -> set[str]:
    """Every downstream table sha256 the logged evidence vouches for: the run end's, and the table's
    after each `runner eval` scoring logged since."""
    tables = evidence.get("tables") or {}
    return {str(h) for h in [tables.get("downstream"), *(evidence.get("runner_eval") or {}).values()] if h}


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
        "train_jsonl_sha256": tags.get(TRAIN_TAG),
        "record_figures_sha256": tags.get(RECORD_TAG),
    }
    files: dict[str, Any] = {}
    domains: dict[str, Any] = {}
    runner_eval: dict[str, str] = {}
    for key, value in tags.items():
        if key.startswith(RUNNER_EVAL_PREFIX) and key.endswith(".downstream.sha256"):
            runner_eval[key[len(RUNNER_EVAL_PREFIX) : -len(".downstream.sha256")]] = value
        elif key.startswith("evidence.table.") and key.endswith(".sha256"):
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
    if runner_eval:
        ev["runner_eval"] = dict(sorted(runner_eval.items()))
    return ev


def canonical(evidence: dict[str, Any]) -> str:
    return json.dumps(evidence, sort_keys=True)


def _hash_problem(what: str, got: str | None, want: Any) -> list[str]:
    """[`what: sha256 <got>, evidence <want>`] where the hash taken now is not the one the evidence holds."""
    got = got or "missing"
    return [] if got == want else [f"{what}: sha256 {got[:12]}, evidence {str(want)[:12]}"]


def evidence_differences(want: dict, inp: AuditInput, *, checkpoint: bool) -> list[str]:
    """Where an evidence record (report/evidence.json, or the one logged to MLflow) differs from the
    report the audit reads: table hashes, experiment.yaml's hash, final validation losses, and (with
    `checkpoint`, when the run folder is at hand) the final checkpoint's hashes."""
    problems = []
    if want.get("schema_version") == rpt.written_version(inp.tables):  # tables hashed as they were written
        for name, digest in sorted((want.get("tables") or {}).items()):
            got = table_sha256(name, inp.tables[name]) if name in inp.tables else "missing"
            if name == "downstream" and got in vouched_downstream(want):
                continue  # the run end's table, or the table after a runner eval scoring MLflow vouches for
            if got != digest:
                later = len(want.get("runner_eval") or {})
                also = (
                    f" (nor any of the {later} runner eval scorings' since)" if name == "downstream" and later else ""
                )
                problems.append(f"table {name}: sha256 {got[:12]}, evidence {str(digest)[:12]}{also}")
    if inp.cfg_file is not None:
        problems += _hash_problem("experiment.yaml", sha256_file(inp.cfg_file), want.get("experiment_yaml_sha256"))
    got_val = final_validation(inp.tables["validation"])
    if canonical(got_val) != canonical(want.get("validation") or {}):
        problems.append(f"final validation: report {got_val}, evidence {want.get('validation')}")
    if want.get("record_figures_sha256") and inp.has_run_json:  # without one: `run.json` is UNVERIFIED, says so
        problems += _hash_problem(
            f"run.json's {', '.join(RECORD_FIGURES)} (report.md's start-up, evaluation time and device-busy lines)",
            record_figures_sha256(inp.run),
            want["record_figures_sha256"],
        )
    if checkpoint and inp.run_dir is not None and want.get("train_jsonl_sha256"):
        # training.png's rows: a halved loss curve redrawn by `runner report` passed every other check
        problems += _hash_problem(
            f"{TRAIN_JSONL} (the training curve's loss, learning rate, gradient norm and times)",
            train_jsonl_sha256(inp.run_dir),
            want["train_jsonl_sha256"],
        )
    if checkpoint and inp.run_dir is not None and want.get("checkpoint"):
        step = int(want["checkpoint"]["step"])
        got_ckpt = final_checkpoint(inp.run_dir, step)
        if got_ckpt is None:
            problems.append(f"checkpoint step {step}: not in the run folder")
        elif canonical(got_ckpt) != canonical(want["checkpoint"]):
            problems.append(f"checkpoint step {step}: state.json or file hashes differ from the evidence")
    return problems
