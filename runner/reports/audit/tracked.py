"""The audit's comparisons against the run's MLflow run: the record an edit of the report cannot reach.

Owns: finding the MLflow run a report names (run.json's store, else $MLFLOW_TRACKING_URI, or the
store given as --tracking-uri; a store that is not there is never created), and the checks against
it: its params against experiment.yaml; its tags against the run's record (fingerprint, tokenizer,
recipe and manifest pins, the MFU convention and peak, the run's name); every point of every logged
metric's history against the report wherever the report states that figure (per-domain counters and
realized ratios, recounted by replaying the sampler at steps the report does not hold; validation
losses; throughput; the final summary); and the evidence logged at the end of the run
(runner.reports.audit.evidence) against the report's tables, experiment.yaml, final checkpoint and
validation losses. When the run cannot be reached every one of these checks is UNVERIFIED, saying why.
What reached MLflow from the run folder's journal after the process that journaled it had ended
(`runner sync`, a later start: the run's `runner.replayed.*` tags) vouches only as the folder does:
a check it bears on is UNVERIFIED, never PASS, saying what arrived late.
Never: writes to a tracking store, or trusts anything in the report folder to stand in for it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.config.fingerprint import canonical_meaning
from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl
from runner.reports.audit import downstream_tracked
from runner.reports.audit import evidence as ev
from runner.reports.audit.result import PASS, UNVERIFIED, AuditResult
from runner.reports.markdown import CONVENTION_KEYS
from runner.reports.tables import written_version
from runner.runs.recorded import whole
from runner.training.tracking import REPLAYED_TAG, fail_fast_env, missing_store, sqlite_path
from schemas.report_tables import with_added_columns

if TYPE_CHECKING:
    from runner.reports.audit.input import AuditInput, Replay

RUN = "MLflow run reachable"
PARAMS = "MLflow params = experiment.yaml"
TAGS = "MLflow tags = the run's record"
METRICS = "MLflow metrics = the report"
EVIDENCE = "MLflow evidence = the report"
NAMES = (RUN, PARAMS, TAGS, METRICS, EVIDENCE)

REL_TOL = 1e-9  # MLflow stores float64: a logged figure reads back exactly
KINDS = ("processed", "exposure", "useful", "unique", "lost")
# What the trainer logs at the end of each attempt (callbacks.TrackingCallback.on_end), by the
# run_summary column that states the same figure.
SUMMARY_METRICS = {
    "committed_steps": "steps",
    "wall_seconds": "wall_seconds",
    "step_seconds_total": "step_seconds_total",
    "device_wall_seconds": "device_wall_seconds",
    "device_step_seconds_total": "device_step_seconds",
    "exposure_tokens": "exposure_tokens",
    "useful_tokens": "useful_tokens",
    "processed_tokens": "processed_tokens",
    "lost_tokens": "lost_tokens",
    # the run's MFU figures (a step's own are `mfu`, `goodput_mfu`: THROUGHPUT_METRICS)
    "run.mfu": "mfu",
    "run.goodput_mfu": "goodput_mfu",
    "run.hfu": "hfu",
    "cost_per_billion_useful_tokens": "cost_per_billion_useful_tokens",
}
THROUGHPUT_METRICS = ("tokens_per_second", "step_seconds", "mfu", "goodput_mfu")
# A step's figures no table holds (loss, lr, grad_norm, tokens_per_second_useful, a mixture of experts'
# moe_layer_<i>_load_imbalance) are compared with the run folder's metrics/train.jsonl rows where the audit
# reads one (_Expected.train_fields; training.png draws loss and lr): an earlier segment's rows, which the
# last end's evidence hash covers as they were then, are vouched for at each step MLflow logged.
# A step's router figures, by the router table's column that states the same figure.
ROUTER_METRICS = {
    "router_aux_loss": "router_aux_loss",
    "router_z_loss": "router_z_loss",
    "expert_load_imbalance": "load_imbalance",
    "expert_load_cv": "load_cv",
    "expert_idle_capacity": "idle_capacity",
}
STEP_PREFIX = "step/"  # per-step figures the run also states as a whole (runner.training.callbacks.STEP_NAMES)


def metric_name(key: str) -> str:
    """The trainer's name for a logged key: `step/mfu` (runs since the rename) and `mfu` (runs recorded
    before it) are the same figure of one step."""
    return key[len(STEP_PREFIX) :] if key.startswith(STEP_PREFIX) else key


# What each evaluation logs besides its losses (callbacks.TrackingCallback.on_eval), by validation column.
EVAL_METRICS = {"eval.useful_tokens": "useful_tokens", "eval.wall_seconds": "wall_seconds"}
EVAL_METRICS["eval.device_wall_seconds"] = "device_wall_seconds"
# `target.<name>.<suffix>` (targets.mlflow_record) -> (the targets table's point, its column)
TARGET_METRICS = {
    "step": ("met", "step"),
    "exposure_tokens": ("met", "exposure_tokens"),
    "useful_tokens": ("met", "useful_tokens"),
    "value": ("met", "value"),
    "time_to_target_seconds": ("met", "wall_seconds"),
    "device_hours_to_target": ("met", "device_hours"),
    "cost_to_target_usd": ("met", "cost_usd"),
    **{f"before.{k}": ("before", k) for k in ("step", "exposure_tokens", "useful_tokens", "value", "wall_seconds")},
    "best_value": ("best", "value"),
    "best_step": ("best", "step"),
}
# Keys whose value at a step the report's tables cannot state; extension segments change these params.
EXTENSION_PARAMS = ("train.exposure_tokens", "train.max_duration_tokens")


@dataclass
class Tracked:
    """What the audit read from the run's MLflow run."""

    uri: str
    run_id: str
    run_name: str
    params: dict[str, str]
    tags: dict[str, str]
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # key -> [(step, value)]
    #: key -> [(step, value, timestamp in ms)]: which attempt logged a point (see lineage_points)
    stamps: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return max((step for points in self.history.values() for step, _ in points), default=0)


# ---- finding the run ----------------------------------------------------------------------------


def _in_project(uri: str, report_dir: Path | None) -> str:
    """A published run.json names a SQLite store inside its project relative to the project root
    (`sqlite:///mlflow.db`): resolved against the checkout the report sits in, when it sits in one."""
    path = sqlite_path(uri)
    if path is None or path.is_absolute() or report_dir is None:
        return uri
    for folder in [report_dir.resolve(), *report_dir.resolve().parents]:
        if (folder / "recipes").is_dir() and (folder / "reports").is_dir():
            return f"sqlite:///{folder / path}"
    return uri


def _named_run(inp: AuditInput) -> tuple[str | None, list[str]]:
    """(the MLflow run id run.json names, the store URIs it records), the run folder's run.json included."""
    records = [inp.record.mlflow]
    if inp.run_dir is not None and (inp.run_dir / "run.json").exists():
        live = read_json(inp.run_dir / "run.json")
        records.append((live.get("mlflow") or {}) if isinstance(live, dict) else {})
    run_id = next((r.get("run_id") for r in records if r.get("run_id")), None)
    return run_id, [r["tracking_uri"] for r in records if r.get("tracking_uri")]


def locate(inp: AuditInput, *, enabled: bool = True, tracking_uri: str | None = None) -> tuple[Tracked | None, str]:
    """The run's MLflow record, or (None, why it could not be read)."""
    if not enabled:
        return None, "not asked (--no-mlflow)"
    if not inp.has_run_json:
        return None, "no run.json: nothing names the MLflow run"
    run_id, recorded = _named_run(inp)
    if not run_id:
        return None, "run.json names no MLflow run (trained with --no-tracking, or the server was never reached)"
    recorded = [_in_project(uri, inp.report_dir) for uri in recorded]
    candidates = [tracking_uri] if tracking_uri else [*recorded, os.environ.get("MLFLOW_TRACKING_URI")]
    reasons = []
    for uri in dict.fromkeys(u for u in candidates if u):
        missing = missing_store(uri)
        if missing:
            reasons.append(missing)
            continue
        try:
            return _read_run(uri, run_id), ""
        except Exception as err:  # unreachable server, unknown run, bad URI: this store cannot vouch
            reasons.append(f"{uri}: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}")
    if not reasons:
        reasons.append("no tracking URI recorded or given (--tracking-uri, MLFLOW_TRACKING_URI)")
    return None, f"MLflow run {run_id} not reachable: " + "; ".join(reasons)


def _read_run(uri: str, run_id: str) -> Tracked:
    fail_fast_env(timeout_seconds=5)  # a dead server costs seconds, not minutes
    from mlflow.tracking import MlflowClient  # noqa: PLC0415  (mlflow: only when run.json names a run)

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    stamps = {
        key: [(int(m.step), float(m.value), int(m.timestamp)) for m in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
    }
    history = {key: [(step, value) for step, value, _ in points] for key, points in stamps.items()}
    return Tracked(uri, run_id, run.info.run_name or "", dict(run.data.params), dict(run.data.tags), history, stamps)


def _replayable(key: str) -> bool:
    """Counters the sampler alone decides at every step: exposure, unique and realized ratios."""
    return key.startswith("realized_ratio.") or (key.startswith("tokens.") and key.endswith((".exposure", ".unique")))


def replay_steps(tracked: Tracked | None, final_step: int) -> set[int]:
    """Steps at which MLflow holds a replayable counter."""
    if tracked is None:
        return set()
    return {
        step
        for key, points in tracked.history.items()
        if _replayable(key)
        for step, _ in points
        if 0 < step <= final_step
    }


# ---- the checks ---------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)
    return math.isclose(x, y, rel_tol=REL_TOL, abs_tol=1e-12) or (math.isnan(x) and math.isnan(y))


def _check_params(res: AuditResult, inp: AuditInput, tracked: Tracked) -> None:
    from runner.training.tracking import flatten  # noqa: PLC0415  (imports torch)

    if not tracked.params:
        res.could_not(PARAMS, f"MLflow run {tracked.run_id} holds no params (its first start never reached the server)")
        return
    want = flatten(canonical_meaning(inp.config))
    extended = len(inp.record.segments) > 1
    problems = [
        f"{key}: MLflow {tracked.params.get(key)!r}, experiment.yaml {value!r}"
        for key, value in sorted(want.items())
        if not (extended and key in EXTENSION_PARAMS) and tracked.params.get(key) != value
    ]
    # A key the run logged that experiment.yaml no longer has at all (a domain removed, say).
    present = flatten(inp.exp.to_container())
    problems += [
        f"{key}: logged to MLflow, absent from experiment.yaml" for key in sorted(set(tracked.params) - set(present))
    ]
    res.add(PARAMS, problems, ok_detail=f"{len(want)} params that make the fingerprint compared")


def _check_tags(res: AuditResult, inp: AuditInput, tracked: Tracked, later: str) -> None:
    """`later`: why the run's latest tags may describe a later state than this report ('' if not)."""
    cfg, s = inp.config, inp.tables["run_summary"].iloc[0]
    want: dict[str, Any] = {"fingerprint": inp.exp.fingerprint, "tokenizer.sha256": cfg.tokenizer.sha256}
    want.update({f"recipe.{kind}": ref for kind, ref in cfg.recipes.items()})
    want.update({f"manifest.{d}.sha256": pin.sha256 for d, pin in cfg.data.manifests.items()})
    # A report written before a convention key was a column reads it at its default (step_clock: host)
    version = written_version(inp.tables)
    s = with_added_columns({"run_summary": inp.tables["run_summary"]}, version)["run_summary"].iloc[0]
    want.update({f"mfu.{k}": s[k] for k in CONVENTION_KEYS})
    want.update({f"hfu.{k}": v for k, v in (inp.record.conventions_hfu or {}).items()})
    problems: list[str] = []
    superseded: list[str] = []
    for key, value in want.items():
        got = tracked.tags.get(key)
        if got is None and key == "mfu.step_clock" and value == "host":
            continue  # runs before issue 28 logged no step clock: they timed steps on the host
        if got is None:
            problems.append(f"{key}: not logged")
        elif not _same(got, value):
            # Set again at every start: an extension (new fingerprint) or a resume on another world
            # size after this report rewrites them.
            moved = later and key in ("fingerprint", "mfu.devices_counted", "hfu.devices_counted")
            (superseded if moved else problems).append(f"{key}: MLflow {got!r}, report {value!r}")
    logged_pins = {k[len("manifest.") : -len(".sha256")] for k in tracked.tags if k.startswith("manifest.")}
    for d in sorted(logged_pins - set(cfg.data.manifests)):
        problems.append(f"manifest.{d}.sha256: MLflow pins domain {d}, the report has no such domain")
    if tracked.run_name != str(s["run_id"]):
        problems.append(f"run name: MLflow {tracked.run_name!r}, report run_id {s['run_id']!r}")
    if superseded and not problems:
        res.could_not(TAGS, f"{later}; the run's latest tags differ: {'; '.join(superseded)}")
        return
    res.add(TAGS, problems, ok_detail=f"{len(want) + 1} tags compared")


class _Expected:
    """What the report states for a metric at a step, in the trainer's metric names."""

    def __init__(self, inp: AuditInput, rep: Replay | None, tracked: Tracked):
        t = inp.tables
        self.ends_at: dict[int, int] = {}  # step -> attempts or segments whose end was logged there
        for step, _ in tracked.history.get("committed_steps", []):
            self.ends_at[step] = self.ends_at.get(step, 0) + 1
        self.s = t["run_summary"].iloc[0]
        self.final = inp.steps()
        self.seq_len = inp.config.train.seq_len
        self.domains = set(inp.config.mixture.domains)
        self.acct = t["accounting"].set_index("domain")
        self.throughput = {int(r["step"]): r for _, r in t["throughput"].iterrows()}
        self.router = {int(r["step"]): r for _, r in t["router"].iterrows()} if "router" in t else {}
        self.validation = {(int(r["step"]), str(r["domain"])): r for _, r in t["validation"].iterrows()}
        self.progress = {step: r for (step, _), r in self.validation.items()}  # the same in every domain's row
        self.targets = (
            {(str(r["target"]), str(r["point"])): r for _, r in t["targets"].iterrows()} if "targets" in t else None
        )
        self.snapshots: dict[int, dict[str, tuple[int, int]]] = rep.snapshots if rep is not None else {}
        self.train = _train_rows(inp.run_dir)
        # a row's own figures: not the run's totals an attempt's end also logs (wall_seconds, exposure_tokens)
        self.train_fields = {
            k for rows in self.train.values() for r in rows for k in r if k != "step" and k not in SUMMARY_METRICS
        }

    def domain_of(self, key: str) -> str | None:
        """The domain a per-domain key names (None for other keys)."""
        for prefix in ("tokens.", "realized_ratio.", "val_loss.", "val_bpb."):
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                return rest.rsplit(".", 1)[0] if prefix == "tokens." else rest
        return None

    def _counter(self, domain: str, kind: str, step: int) -> float | None:
        if step == self.final:
            if domain != "total" and domain not in self.acct.index:
                return None  # the domain check names a domain missing from the accounting table
            row = self.s if domain == "total" else self.acct.loc[domain]
            return row[f"{kind}_tokens"]
        snap = self.snapshots.get(step)
        if snap is None or kind not in ("exposure", "unique") or (domain != "total" and domain not in snap):
            return None  # processed, useful and lost at earlier steps: no table states them
        index = 0 if kind == "exposure" else 1
        drawn = sum(v[index] for v in snap.values()) if domain == "total" else snap[domain][index]
        return drawn * self.seq_len

    def _ratio(self, domain: str, step: int) -> float | None:
        if step == self.final:
            return self.acct.loc[domain, "realized_ratio"] if domain in self.acct.index else None
        snap = self.snapshots.get(step) or {}
        total = sum(v[0] for v in snap.values())
        return snap[domain][0] / total if total and domain in snap else None

    def values(self, key: str, step: int) -> list[float] | None:
        """The report's values for `key` at `step`, or None when the report does not state it."""
        key = metric_name(key)
        domain = self.domain_of(key) or ""
        if key.startswith("tokens."):
            v = self._counter(domain, key.rsplit(".", 1)[1], step)
            return None if v is None else [v]
        if key.startswith("realized_ratio."):
            v = self._ratio(domain, step)
            return None if v is None else [v]
        if key.startswith(("val_loss.", "val_bpb.")):
            row = self.validation.get((step, domain))
            return None if row is None else [row["loss_nats" if key.startswith("val_loss.") else "bpb"]]
        if key in SUMMARY_METRICS and step == self.final:
            v = self.s[SUMMARY_METRICS[key]]
            return None if isinstance(v, float) and math.isnan(v) else [v]
        if key in THROUGHPUT_METRICS and step in self.throughput:
            return [self.throughput[step][key]]
        if key in ROUTER_METRICS and step in self.router:
            return [self.router[step][ROUTER_METRICS[key]]]
        if key in self.train_fields and step in self.train:
            return [v for v in (r.get(key) for r in self.train[step]) if isinstance(v, int | float)] or None
        return None


def _train_rows(run_dir: Path | None) -> dict[int, list[dict]]:
    """step -> the run folder's metrics/train.jsonl rows at it (a step redone after a resume has two);
    {} without a run folder or a readable file (the checks of the run folder name what is wrong)."""
    path = Path(run_dir) / "metrics" / "train.jsonl" if run_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        rows = read_jsonl(path)
    except (RunnerError, OSError, ValueError):
        return {}
    out: dict[int, list[dict]] = {}
    for row in rows:
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            out.setdefault(step, []).append(row)
    return out


def _compare_history(
    key: str, points: list[tuple[int, float]], want: _Expected, problems: list[str]
) -> tuple[int, int]:
    """Compare one metric's history; returns (steps compared, steps the report states nothing for)."""
    by_step: dict[int, list[float]] = {}
    for step, value in points:
        by_step.setdefault(step, []).append(value)
    compared = uncompared = 0
    for step, values in sorted(by_step.items()):
        if step > want.final:
            continue  # the run went on after this report: check() says so
        expected = want.values(key, step)
        # Where an earlier attempt or segment ended (its on_end logs committed_steps there), that
        # many of the values are its own MFU summaries, which no table states.
        ends = want.ends_at.get(step, 0) if key in SUMMARY_METRICS and step != want.final else 0
        if expected is None or len(values) <= ends:
            uncompared += 1
            continue
        compared += 1
        # A step redone after a resume is logged twice and the report keeps the run's lineage: one of
        # the values must be the report's. Counters the sampler decides are the same in every attempt:
        # every value must be.
        matches = [any(_same(v, e) for e in expected) for v in values]
        if not (all(matches) if _replayable(key) else any(matches)):
            shown = ", ".join(f"{v:.10g}" for v, ok in zip(values, matches) if not ok)
            problems.append(f"{key} at step {step}: MLflow {shown}, report {float(expected[0]):.10g}")
    return compared, uncompared


# ---- evaluation times and target figures, by the attempt that evaluated --------------------------


def _target_field(key: str) -> tuple[str, str, str] | None:
    """(target name, point, targets column) of a `target.<name>.<suffix>` metric, else None."""
    if not key.startswith("target."):
        return None
    for suffix in sorted(TARGET_METRICS, key=len, reverse=True):
        if key.endswith(f".{suffix}") and len(key) > len("target.") + len(suffix) + 1:
            return (key[len("target.") : -len(suffix) - 1], *TARGET_METRICS[suffix])
    return None


def lineage_points(tracked: Tracked, key: str) -> dict[int, float]:
    """step -> the value of `key` the lineage's evaluation at that step vouches for: logged at or
    after the latest `val_loss.*` point of that step (the evaluation the lineage kept; an earlier
    attempt's, redone after a resume, is superseded), the latest such point. A step no evaluation
    logged at has none: nothing vouches for a figure there."""
    evaluated: dict[int, int] = {}
    for k, points in tracked.stamps.items():
        if k.startswith("val_loss."):
            for step, _, ts in points:
                evaluated[step] = max(evaluated.get(step, ts), ts)
    out: dict[int, tuple[int, int, float]] = {}
    for i, (step, value, ts) in enumerate(tracked.stamps.get(key, [])):
        at = evaluated.get(step)
        if at is not None and ts >= at and (step not in out or (ts, i) >= out[step][:2]):
            out[step] = (ts, i, value)
    return {step: v for step, (_, _, v) in out.items()}


def _compare_lineage(key: str, tracked: Tracked, want: _Expected, problems: list[str]) -> tuple[int, int]:
    """An evaluation time or target figure against what MLflow recorded when the evaluation happened."""
    target = _target_field(key)
    compared = uncompared = 0
    for step, value in sorted(lineage_points(tracked, key).items()):
        if step > want.final:
            continue
        if target is not None:
            name, point, col = target
            rows = want.targets or {}
            anchor = rows.get((name, "best" if point == "best" else "met"))  # logged at its step, `before` too
            if anchor is None or int(anchor["step"]) != step:
                # a best so far a later evaluation bettered, or a target defined otherwise when it was
                # logged (targets are operational): the step's evaluation times are compared anyway
                uncompared += 1
                continue
            row = rows.get((name, point))
            if row is None:
                problems.append(f"{key} at step {step}: MLflow {value:.10g}, the report has no {point} row")
                continue
            expected = row[col]
        else:
            row = want.progress.get(step)
            if row is None:
                uncompared += 1
                continue
            expected = row[EVAL_METRICS[key]]
        compared += 1
        if not _same(value, expected):
            problems.append(f"{key} at step {step}: MLflow {value:.10g}, report {float(expected):.10g}")
    return compared, uncompared


def _check_metrics(res: AuditResult, inp: AuditInput, tracked: Tracked, rep: Replay | None, later: str) -> None:
    want = _Expected(inp, rep, tracked)
    problems: list[str] = []
    lineage_problems: list[str] = []  # shown first: the figures a forger of time-to-target edits
    compared = uncompared = 0
    without_counterpart = []
    for key in sorted(tracked.history, key=lambda k: (not k.startswith("target."), k)):
        if key in EVAL_METRICS or _target_field(key) is not None:
            c, u = _compare_lineage(key, tracked, want, lineage_problems)
            compared, uncompared = compared + c, uncompared + u
    # downstream figures and their stamps, against what MLflow logged at each scoring
    d_problems, c, u = downstream_tracked.compare(tracked.history, inp.tables.get("downstream"), want.final)
    lineage_problems += d_problems
    compared, uncompared = compared + c, uncompared + u
    for key, points in sorted(tracked.history.items()):
        if key in EVAL_METRICS or _target_field(key) is not None or downstream_tracked.handles(key):
            continue
        domain = want.domain_of(key)
        if domain is not None and domain not in want.domains and domain != "total":
            problems.append(f"{key}: MLflow logs domain {domain!r}, absent from the report")
            continue
        name = metric_name(key)
        stated = (*THROUGHPUT_METRICS, *ROUTER_METRICS, *want.train_fields)
        if domain is None and name not in SUMMARY_METRICS and name not in stated:
            without_counterpart.append(key)
            continue
        c, u = _compare_history(key, points, want, problems)
        compared, uncompared = compared + c, uncompared + u
    logged_domains = {want.domain_of(k) or "" for k in tracked.history if k.startswith("tokens.")} - {"", "total"}
    if logged_domains and logged_domains != want.domains:
        problems.append(f"MLflow logs counters for domains {sorted(logged_domains)}, the report {sorted(want.domains)}")
    problems = lineage_problems + problems
    missing = [
        k
        for k, col in SUMMARY_METRICS.items()
        if not (col == "hfu" and math.isnan(float(want.s["hfu"])))
        and not any(step == want.final for step, _ in tracked.history.get(k, []))
    ]
    detail = (
        f"{compared} logged points compared over {len(tracked.history)} keys; {uncompared} at steps the report "
        f"does not state (processed, useful and lost before the last step); no report counterpart: "
        f"{key_groups(without_counterpart)}"
    )
    if later and not problems:
        res.could_not(METRICS, f"{later}: points up to step {want.final} agree; {detail}")
        return
    if missing and not problems:
        res.could_not(
            METRICS,
            f"MLflow holds no value at the last step {want.final} for {', '.join(missing)} (still pending in "
            f"journal/mlflow-pending.jsonl? send it with `runner sync RUN_DIR`); {detail}",
        )
        return
    res.add(METRICS, problems, ok_detail=detail)


def key_groups(keys: list[str], shown: int = 6) -> str:
    """Metric keys said briefly: one entry per family (`system/... (24 keys)`, `target.* (40 keys)`),
    single keys by name, at most `shown` entries (a line, not 2,000 characters of names)."""
    if not keys:
        return "none"
    families: dict[str, list[str]] = {}
    for key in keys:
        cut = min((i for i in (key.find("/"), key.find(".")) if i > 0), default=-1)
        families.setdefault(key[: cut + 1] if cut > 0 else key, []).append(key)
    parts = [
        (f"{fam}* ({len(members)} keys)" if len(members) > 1 else members[0])
        for fam, members in sorted(families.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    ]
    more = len(parts) - shown
    return ", ".join(parts[:shown]) + (f" and {more} more" if more > 0 else "")


def _check_evidence(res: AuditResult, inp: AuditInput, tracked: Tracked, later: str) -> None:
    logged = ev.evidence_from_tags(tracked.tags)
    if logged is None:
        res.could_not(
            EVIDENCE,
            f"MLflow run {tracked.run_id} holds no evidence.* tags: trained before the runner logged them, or its "
            "end was never reported (`runner report` rebuilds tables but cannot vouch for them)",
        )
        return
    problems = ev.evidence_differences(logged, inp, checkpoint=True)
    if later and problems:
        res.could_not(EVIDENCE, f"{later}: the evidence logged is the later end's ({'; '.join(problems[:3])})")
        return
    if logged.get("schema_version") != written_version(inp.tables):
        if problems:
            res.add(EVIDENCE, problems)
        else:
            res.could_not(
                EVIDENCE,
                f"tables logged under schema {logged.get('schema_version')}, rebuilt under "
                f"{written_version(inp.tables)}: their "
                "hashes cannot be compared (experiment.yaml and validation losses agree)",
            )
        return
    compared = "tables, experiment.yaml, validation losses" + (
        ", final checkpoint" if inp.run_dir is not None and logged.get("checkpoint") else ""
    )
    if logged.get("record_figures_sha256"):
        compared += ", run.json's start-up, evaluation and device-busy figures"
    if inp.run_dir is not None and logged.get("train_jsonl_sha256"):
        compared += ", metrics/train.jsonl"
    segments = inp.record.segments
    if len(segments) > 1:
        # Logged at the last segment's end over the tables as they were then: it never vouches for
        # figures of an earlier segment (those are compared with MLflow's history, METRICS).
        start = int(segments[-1].get("start_step", 0) or 0)
        compared += f" as of the last segment's end (rows up to step {start} rest on MLflow's metric history)"
    res.add(EVIDENCE, problems, ok_detail=compared)


def check(res: AuditResult, inp: AuditInput, tracked: Tracked | None, why: str, rep: Replay | None) -> None:
    """Every MLflow check, or each of them UNVERIFIED with the reason the run could not be read."""
    if tracked is None:
        for name in NAMES:
            res.could_not(name, why)
        return
    res.add(RUN, [], ok_detail=f"run {tracked.run_id} in {tracked.uri}")
    later = ""
    if tracked.last_step > inp.steps():
        # An extension or a resume after this report was written, or a report cut short: either
        # way the run's latest record is not this report's, and cannot vouch for it.
        later = (
            f"MLflow logs the run up to step {tracked.last_step}, this report ends at step {inp.steps()} "
            "(the run went on after it, or the report is cut short)"
        )
    _check_params(res, inp, tracked)
    _check_tags(res, inp, tracked, later)
    _check_metrics(res, inp, tracked, rep, later)
    _check_evidence(res, inp, tracked, later)
    _late_entries(res, tracked)


def _late_entries(res: AuditResult, tracked: Tracked) -> None:
    """A check that PASSed on what reached MLflow late (REPLAYED_TAG: sent from an earlier process's
    journal by `runner sync` or a later start) is UNVERIFIED instead: a forger who kept the server away
    while the run trained (a dead or blocked server journals everything) rewrites the journal with the
    folder, and its replay puts the forgery into MLflow. A FAIL stays a FAIL."""
    told = [_told(value) for key, value in sorted(tracked.tags.items()) if key.startswith(REPLAYED_TAG + ".")]
    if not told:
        return
    kinds: dict[str, int] = {}
    for t in told:
        for k, n in t["kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
    rows = sum(t["metric_rows"] for t in told)
    steps = [t["steps"] for t in told if t["steps"] is not None]
    evidence = sum(t["evidence_tags"] for t in told)
    others = sum(t["other_tags"] for t in told)
    by = sorted({t["by"] for t in told})
    parts = (["the MLflow run itself"] if kinds.get("start") else []) + (["its params"] if kinds.get("params") else [])
    if rows:
        lo, hi = min(s[0] for s in steps) if steps else "?", max(s[1] for s in steps) if steps else "?"
        parts.append(f"{rows} metric rows (steps {lo}-{hi})")
    parts += [f"{evidence} evidence tags"] if evidence else []
    parts += [f"{others} other tags"] if others else []
    why = (
        f"{', '.join(parts) or 'entries'} reached MLflow from the run folder's journal after the process that "
        f"journaled them had ended ({'; '.join(by)}): only the folder vouched for them in between"
    )
    bears = set()
    if kinds.get("start"):
        bears |= {PARAMS, TAGS, METRICS, EVIDENCE}
    bears |= {PARAMS} if kinds.get("params") else set()
    bears |= {METRICS} if rows else set()
    bears |= {EVIDENCE} if evidence else set()
    bears |= {TAGS} if others else set()
    for check in res.checks:
        if check.name in bears and check.status == PASS:
            check.status, check.detail = UNVERIFIED, f"{why}; {check.detail}" if check.detail else why


def _told(value: str) -> dict:
    """One REPLAYED_TAG's value as the tracker writes it; anything else (unreadable, a wrong type) is
    read as the worst it could have said: the run itself and everything in it arrived late."""
    worst = {"by": "an unreadable replay tag", "kinds": {"start": 1}, "metric_rows": 0, "steps": None}
    worst |= {"evidence_tags": 0, "other_tags": 0}
    try:
        t = json.loads(value)
        counts = {k: t.get(k, 0) for k in ("metric_rows", "evidence_tags", "other_tags")}
        kinds, steps = t.get("kinds") or {}, t.get("steps")
        if not (isinstance(kinds, dict) and all(whole(n) for n in [*counts.values(), *kinds.values()])):
            return worst
        if steps is not None and not (isinstance(steps, list) and len(steps) == 2 and all(map(whole, steps))):
            return worst
        return {"by": str(t.get("by")), "kinds": {str(k): n for k, n in kinds.items()}, "steps": steps, **counts}
    except (ValueError, TypeError, AttributeError, RecursionError):  # not JSON, not an object, nested deep
        return worst
