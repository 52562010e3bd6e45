"""Every downstream figure of a run recomputed from its recorded per-request log-likelihoods.

Owns: an arithmetic of its own (not runner.training.downstream.metrics': two implementations
that must agree) over the request files (`ll`, tokens, characters, bytes, gold and choices per
request), and the comparison with every row the loop (metrics/downstream.jsonl) and `runner eval`
(downstream/eval-step-*.json) recorded: the value, the documents, the random baseline, and the
aggregate over the tasks its record names. Reading a request file (read_requests, for
runner.reports.audit.recompute_downstream too): each record's fields and each document's choices checked.
A row without its request file, or one whose file is damaged (not gzip, cut short, not JSON, a
field missing), is a problem too, never a crash. Never scores a model and never writes.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections import defaultdict
from pathlib import Path

import pandas as pd

from runner.errors import RunnerError
from runner.reports.downstream.table import PROGRESS, downstream_table, loop_rows, read_eval_record

REL_TOL = 1e-9
_NORMS = {"acc": None, "acc_norm": "choice_chars", "acc_per_char": "chars", "acc_per_token": "tokens"}


#: what every request record carries (runner.training.downstream.run writes them), beside `task` and `ll`
REQUEST_INTS = ("doc_id", "choice", "choices", "gold", "tokens", "chars", "choice_chars", "bytes")


def _request(row: object, n: int, path: Path) -> dict:
    if not isinstance(row, dict):
        raise RunnerError(f"line {n} is not a JSON object", file=str(path))
    lacks = [k for k in ("task", "ll", *REQUEST_INTS) if k not in row]
    if lacks:
        raise RunnerError(f"line {n} lacks {', '.join(lacks)}", file=str(path))
    ll = row["ll"]
    if not isinstance(row["task"], str):
        raise RunnerError(f"line {n}: task must be a string, got {row['task']!r}", file=str(path))
    if not isinstance(ll, (int, float)) or isinstance(ll, bool) or not math.isfinite(ll):
        raise RunnerError(f"line {n}: ll must be a finite number, got {ll!r}", file=str(path))
    bad = [k for k in REQUEST_INTS if not isinstance(row[k], int) or isinstance(row[k], bool) or row[k] < 0]
    if bad:
        raise RunnerError(f"line {n}: {', '.join(bad)} must be integers >= 0", file=str(path))
    return row


def _check_documents(rows: list[dict], path: Path) -> None:
    """Each document's requests are its choices 0..n-1 once each, with one gold among them."""
    docs: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        docs[(r["task"], r["doc_id"])].append(r)
    for (task, doc), reqs in docs.items():
        n, golds = reqs[0]["choices"], {r["gold"] for r in reqs}
        if sorted(r["choice"] for r in reqs) != list(range(n)) or {r["choices"] for r in reqs} != {n}:
            raise RunnerError(
                f"task {task} document {doc}: its requests are not choices 0..{n - 1} once each", file=str(path)
            )
        if len(golds) != 1 or not 0 <= reqs[0]["gold"] < n:
            raise RunnerError(
                f"task {task} document {doc}: gold {sorted(golds)} is not one of its {n} choices", file=str(path)
            )


def read_requests(path: Path) -> list[dict]:
    """A per-request file's records (gzip jsonl), each with every field the audit reads; RunnerError
    naming the file for one that is not gzip, is cut short, is not UTF-8 JSON or lacks a field."""
    rows: list[dict] = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as err:  # not JSON, an integer of too many digits, nested deep
                    raise RunnerError(
                        f"line {n} is not JSON ({str(err).splitlines()[0][:80]})", file=str(path)
                    ) from None
                rows.append(_request(row, n, path))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:  # not gzip, cut short, not UTF-8
        raise RunnerError(f"not a whole gzip jsonl file ({type(err).__name__}: {err})", file=str(path)) from None
    _check_documents(rows, path)
    return rows


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


def convention_record(row: dict) -> dict:
    """A row's convention record ({} when it is not a JSON object: the schema check names that)."""
    try:
        record = json.loads(row["convention"])
    except (TypeError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


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
        if metric.removeprefix("centered_") not in _NORMS and metric != "bpb":
            problems.append(f"{where}: {task}.{metric}: not a metric the request records give")
            continue
        stated = convention_record(r).get("random_baseline")
        if stated is not None and (not isinstance(stated, (int, float)) or isinstance(stated, bool)):
            problems.append(f"{where}: {task}.{metric}: the record's random_baseline {stated!r} is not a number")
            continue
        b = baselines[task] = got[task]["baseline"] if stated is None else float(stated)
        recorded = math.nan if r["random_baseline"] is None else float(r["random_baseline"])
        if metric == "bpb" and math.isnan(recorded):
            pass  # bpb has no random baseline (rows written before this carry the accuracies')
        elif not math.isclose(recorded, b, rel_tol=REL_TOL, abs_tol=1e-12):
            problems.append(f"{where}: {task}.{metric}: random baseline {recorded!r}, requests give {b!r}")
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
        chosen = convention_record(r).get("tasks") or {}
        if (
            not isinstance(chosen, dict)
            or not chosen
            or any(t not in baselines or str(m).removeprefix("centered_") not in _NORMS for t, m in chosen.items())
        ):
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
    loop_file = run_dir / "metrics/downstream.jsonl"
    latest = {(r["step"], r["task"], r["metric"]): r for r in (loop_rows(loop_file) if loop_file.exists() else [])}
    for (step, _, _), r in latest.items():
        by_step[step].append(r)
    for step, rows in sorted(by_step.items()):
        scorings.append((rows, run_dir / "downstream" / f"requests-loop-step-{step:07d}.jsonl.gz", f"loop step {step}"))
    for path in sorted((run_dir / "downstream").glob("eval-step-*.json")):
        record = read_eval_record(path)
        scorings.append((record["rows"], path.parent / record["requests_file"], path.name))
    problems = []
    for rows, requests_file, where in scorings:
        if not requests_file.is_file():
            problems.append(f"{where}: no per-request file {requests_file.name}")
            continue
        try:
            requests = read_requests(requests_file)
        except RunnerError as err:  # a damaged evidence file is a failed check, not a crash
            problems.append(f"{where}: {err}")
            continue
        problems += check_scoring(rows, requests, where)
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
    """(check name, problems, ok detail) for runner.reports.audit.run: the run folder's figures against
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
    except RunnerError as err:  # a malformed row or record, named with its file and column
        return [("downstream table schema", [str(err).splitlines()[0]], "")]
    problems = check_run(run_dir)
    counts = recorded.groupby("source")[["step", "t_eval_seconds"]].apply(lambda g: len(g.drop_duplicates()))
    said = ", ".join(f"{source}: {n}" for source, n in counts.items())
    checked = (
        f"{len(recorded)} figures of {int(counts.sum())} scorings ({said}) are the arithmetic of their request "
        "files' log-likelihoods (the log-likelihoods themselves are rescored by --recompute-eval)"
    )
    out: list[tuple[str, list[str] | None, str]] = [
        ("downstream table schema", [], f"{len(recorded)} figures"),
        (NAME, problems, checked),
    ]
    if table is not None:
        later = len(later_scorings(table, recorded))
        note = f"; {later} runner eval figures scored after the report (rebuild it: runner report RUN)" if later else ""
        out.append((TABLE, table_differences(table, recorded), f"{len(table)} figures{note}"))
    return out


EVAL_FIGURES = "runner eval figures vouched for"


def runner_eval_check(table: pd.DataFrame | None, evidence_passed: bool) -> tuple[str, bool, str] | None:
    """(EVAL_FIGURES, vouched, detail) for the `runner eval` figures of `table` (the report's) when
    they were not rescored; None when it holds none. A runner eval scoring is recorded nowhere but
    its own two files, which an edit rewrites together (check_run only finds them consistent): its
    figures are vouched for where MLflow's evidence holds the table's hash with them (runner eval
    logs it: runner.reports.audit.evidence.vouch_for_runner_eval), else only by rescoring."""
    if table is None or table.empty:
        return None
    mine = table[table["source"] == "runner eval"]
    if mine.empty:
        return None
    n, steps = len(mine[["step", "t_eval_seconds"]].drop_duplicates()), sorted(set(mine["step"]))
    said = (
        f"{len(mine)} figures of {n} runner eval scoring{'s' if n > 1 else ''} "
        f"(step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"
    )
    if evidence_passed:
        return (
            EVAL_FIGURES,
            True,
            f"{said}: the table with them is the one runner eval logged to MLflow's evidence; their "
            "log-likelihoods were not rescored (`runner audit --recompute-eval` rescores them)",
        )
    return (
        EVAL_FIGURES,
        False,
        f"{said}: only their arithmetic was checked, against request files an edit rewrites with them, and "
        "MLflow's evidence does not vouch for them here: run `runner audit --recompute-eval` on the run folder "
        "to rescore them from their checkpoints",
    )
