"""Every downstream figure of a run recomputed from its recorded per-request log-likelihoods.

Owns: an arithmetic of its own (not runner.training.downstream.metrics': two implementations
that must agree) over the request files (`ll`, tokens, characters, bytes, gold and choices per
request), and the comparison with every row the loop (metrics/downstream.jsonl) and `runner eval`
(downstream/eval-step-*.json) recorded: the value, the documents, the random baseline, and the
aggregate over the tasks its record names. A row without its request file is a problem too.
Never scores a model and never writes.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from pathlib import Path

import pandas as pd

from runner.fsio import read_json, read_jsonl
from runner.reports.downstream_table import PROGRESS, downstream_table

REL_TOL = 1e-9
_NORMS = {"acc": None, "acc_norm": "choice_chars", "acc_per_char": "chars", "acc_per_token": "tokens"}


def _read_requests(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def recompute(requests: list[dict]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} (every accuracy, its centered form with the 1/choices baseline, bpb,
    `documents` and `baseline`) from one scoring's request records."""
    docs: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in requests:
        docs[r["task"]][int(r["doc_id"])].append(r)
    out = {}
    for task, by_doc in docs.items():
        right = dict.fromkeys(_NORMS, 0)
        bpb, baseline = 0.0, 0.0
        for reqs in by_doc.values():
            reqs = sorted(reqs, key=lambda r: r["choice"])
            gold = reqs[0]["gold"]
            for metric, norm in _NORMS.items():
                scores = [r["ll"] / (max(r[norm], 1) if norm else 1) for r in reqs]
                right[metric] += scores.index(max(scores)) == gold  # first maximum: numpy's argmax
            bpb += -reqs[gold]["ll"] / (math.log(2) * max(reqs[gold]["bytes"], 1))
            baseline += 1 / len(reqs)
        n = len(by_doc)
        values = {m: right[m] / n for m in _NORMS} | {"bpb": bpb / n, "documents": n, "baseline": baseline / n}
        out[task] = values
    return out


def _centered(value: float, b: float) -> float:
    return (value - b) / (1 - b)


def check_scoring(rows: list[dict], requests: list[dict], where: str) -> list[str]:
    """Problems of one scoring's rows against its request records."""
    got, problems, baselines = recompute(requests), [], {}
    for r in [r for r in rows if r["task"] != "aggregate"]:
        task, metric = r["task"], r["metric"]
        if task not in got:
            problems.append(f"{where}: {task}.{metric}: no request of the task is recorded")
            continue
        stated = json.loads(r["convention"]).get("random_baseline")
        b = baselines[task] = got[task]["baseline"] if stated is None else float(stated)
        if not math.isclose(r["random_baseline"], b, rel_tol=REL_TOL, abs_tol=1e-12):
            problems.append(f"{where}: {task}: random baseline {r['random_baseline']!r}, requests give {b!r}")
        want = (
            _centered(got[task][metric.removeprefix("centered_")], b)
            if metric.startswith("centered_")
            else got[task][metric]
        )
        if not math.isclose(r["value"], want, rel_tol=REL_TOL, abs_tol=1e-12):
            problems.append(f"{where}: {task}.{metric}: recorded {r['value']!r}, the requests give {want!r}")
        if r["documents"] != got[task]["documents"]:
            problems.append(f"{where}: {task}: {r['documents']} documents recorded, {got[task]['documents']} scored")
    for r in [r for r in rows if r["task"] == "aggregate"]:
        chosen = json.loads(r["convention"]).get("tasks") or {}
        if not chosen or any(t not in baselines for t in chosen):
            problems.append(f"{where}: aggregate: names tasks whose figures are not recorded ({chosen})")
            continue
        parts = [_centered(got[t][m.removeprefix("centered_")], baselines[t]) for t, m in chosen.items()]
        want = sum(parts) / len(parts)
        if not math.isclose(r["value"], want, rel_tol=REL_TOL, abs_tol=1e-12):
            problems.append(f"{where}: aggregate: recorded {r['value']!r}, the tasks give {want!r}")
    return problems


def check_run(run_dir: str | Path) -> list[str]:
    """Every scoring of the run (loop and runner eval) against its request file; [] when all agree."""
    run_dir = Path(run_dir)
    scorings: list[tuple[list[dict], Path, str]] = []
    by_step: dict[int, list[dict]] = defaultdict(list)
    latest = {
        (int(r["step"]), r["task"], r["metric"]): r
        for r in read_jsonl(run_dir / "metrics/downstream.jsonl", skip_torn=True)
    }
    for (step, _, _), r in latest.items():
        by_step[step].append(r)
    for step, rows in sorted(by_step.items()):
        scorings.append((rows, run_dir / "downstream" / f"requests-loop-step-{step:07d}.jsonl.gz", f"loop step {step}"))
    for path in sorted((run_dir / "downstream").glob("eval-step-*.json")):
        record = read_json(path)
        scorings.append((record.get("rows", []), path.parent / str(record.get("requests_file")), path.name))
    problems = []
    for rows, requests_file, where in scorings:
        if not requests_file.is_file():
            problems.append(f"{where}: no per-request file {requests_file.name}")
            continue
        problems += check_scoring(rows, _read_requests(requests_file), where)
    return problems


NAME = "downstream figures recomputed from per-request log-likelihoods"
TABLE = "downstream table equals the recomputed figures"
_KEY = ["source", "step", "task", "metric", "documents", "convention"]


def _numbered(df: pd.DataFrame) -> pd.DataFrame:
    """The frame with `occurrence`, the occurrence of its key (two `runner eval` scorings of one step alike)."""
    df = df.reset_index(drop=True)
    return df.assign(occurrence=df.groupby(_KEY, sort=False).cumcount())


def _matched(table: pd.DataFrame, recorded: pd.DataFrame) -> pd.DataFrame:
    return _numbered(table).merge(_numbered(recorded), on=[*_KEY, "occurrence"], how="outer", indicator="merged")


def later_scorings(table: pd.DataFrame, recorded: pd.DataFrame) -> pd.DataFrame:
    """The run folder's `runner eval` figures the table lacks: scored after the report was written."""
    m = _matched(table, recorded)
    return m[(m["merged"] == "right_only") & (m["source"] == "runner eval")]


def as_reported(table: pd.DataFrame, recorded: pd.DataFrame) -> pd.DataFrame:
    """`recorded` without the `runner eval` figures scored after the report (later_scorings)."""
    later = later_scorings(table, recorded)
    if later.empty:
        return recorded
    r = _numbered(recorded)
    drop = (
        r.merge(later[[*_KEY, "occurrence"]], on=[*_KEY, "occurrence"], how="left", indicator="merged")["merged"]
        == "both"
    )
    return recorded.reset_index(drop=True)[~drop.to_numpy()].reset_index(drop=True)


def table_differences(table: pd.DataFrame, recorded: pd.DataFrame) -> list[str]:
    """Where the downstream table the audit reads (a report's) differs from the one the run folder's
    records give (those check_run recomputes): a figure the records lack, a loop figure the table
    lacks, a value, baseline, exposure or the scoring's progress (useful tokens, wall and device-wall
    seconds: what downstream targets are counted from) off. `runner eval` figures scored after the report are
    not in it and are no difference (later_scorings)."""
    problems = []
    for r in _matched(table, recorded).itertuples(index=False):
        where = f"{r.source} step {int(r.step)} {r.task}.{r.metric}"
        if r.merged == "left_only":
            problems.append(f"{where}: no such figure in the run folder's records")
        elif r.merged == "right_only":
            if r.source == "loop":
                problems.append(f"{where}: recorded by the loop, not in the table")
        else:
            for col in ("value", "random_baseline", "exposure_tokens", *PROGRESS):
                x, y = float(getattr(r, f"{col}_x")), float(getattr(r, f"{col}_y"))
                if math.isnan(x) and math.isnan(y):
                    continue  # a time not recorded (runner eval, a row older than the stamps)
                if not math.isclose(x, y, rel_tol=REL_TOL, abs_tol=1e-12):
                    problems.append(f"{where}: {col} {x!r} in the table, {y!r} recomputed")
    return problems


def audit_checks(run_dir: Path | None, table: pd.DataFrame | None = None) -> list[tuple[str, list[str] | None, str]]:
    """(check name, problems, ok detail) for runner.reports.audit: the run folder's figures against
    their request files, and `table` (the report's downstream table) against those figures. None
    for a run that scored no task; without the run folder a report's table cannot be recomputed
    (check name, None, why)."""
    figures = 0 if table is None else len(table)
    if run_dir is None:
        return [(NAME, None, "the per-request files are in the run folder, not the report")] if figures else []
    run_dir = Path(run_dir)
    if not (run_dir / "metrics/downstream.jsonl").exists() and not list(
        (run_dir / "downstream").glob("eval-step-*.json")
    ):
        return [(TABLE, [f"{figures} figures, the run folder records none"], "")] if figures else []
    try:
        recorded = downstream_table(run_dir)
    except Exception as err:  # pandera's SchemaError(s), a malformed row (RunnerError)
        return [("downstream table schema", [str(err).splitlines()[0]], "")]
    problems = check_run(run_dir)
    scorings = recorded.groupby(["source", "step", "t_eval_seconds"]).ngroups
    out: list[tuple[str, list[str] | None, str]] = [
        ("downstream table schema", [], f"{len(recorded)} figures"),
        (NAME, problems, f"{len(recorded)} figures of {scorings} scorings agree with their request files"),
    ]
    if table is not None:
        later = len(later_scorings(table, recorded))
        note = f"; {later} runner eval figures scored after the report (rebuild it: runner report RUN)" if later else ""
        out.append((TABLE, table_differences(table, recorded), f"{len(table)} figures{note}"))
    return out
