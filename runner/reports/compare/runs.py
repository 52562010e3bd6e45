"""`runner compare`: runs side by side, from their run folders, published reports or MLflow run ids.

Owns: reading each run's report tables, experiment.yaml and run.json; what a comparison shows (the
fingerprinted keys where the resolved configs differ, token accounting per domain, final validation
loss and bits per byte, time-, device-hours- and cost-to-target with who gets there first, MFU and
goodput MFU with their conventions, marked not comparable when the conventions differ), its
markdown, JSON and CSV forms, the overlaid loss plots against exposure tokens and against dollars,
and a comparison folder that carries audited copies of the reports it was made from.
Never: trains, edits a run or a report, or recomputes a figure the report tables already hold
(targets are judged by runner.reports.targets on each run's own evaluations).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from runner.config.fingerprint import canonical_meaning
from runner.config.load import repo_root
from runner.errors import RunnerError
from runner.fsio import read_json, read_yaml, replace_folder, staging_folder
from runner.reports import tables as rpt
from runner.reports import targets as tg
from runner.reports.audit.evidence import write_report_with_evidence
from runner.reports.audit.run import audit
from runner.reports.compare.downstream import mark_firsts, side_by_side, task_target_results, union_task_targets
from runner.reports.compare.experts import expert_balance
from runner.reports.compare.hardware import (
    hardware_differences,
    mfu_denominators_differ,
    not_comparable_line,
    settings_of,
)
from runner.reports.publish import portable
from runner.runs.folder import is_reportable_run
from runner.runs.runjson import as_record
from schemas.report_tables import READABLE_VERSIONS, validate_tables, with_added_columns

ACCOUNTING = ("processed_tokens", "exposure_tokens", "useful_tokens", "unique_tokens", "lost_tokens")
ACCOUNTING_RATIOS = ("target_ratio", "realized_ratio", "epochs")
#: convention fields that must agree for two MFU figures to be compared (SPEC "Throughput, MFU and
#: cost"); devices_counted may differ (MFU is per device held) and so may the device itself, as long
#: as each peak is of the same kind (datasheet or recipe, theoretical, measured).
MFU_CONVENTION = (
    "flops_formula",
    "params_counted",
    "attention_causal_half",
    "recompute_counted",
    "time_basis",
    "step_clock",  # a host-read step ends before the device finishes it: MFU ~1% higher on a GPU
    "peak_dtype",
)
PLOTS = ("loss_vs_tokens.png", "loss_vs_dollars.png")


@dataclass
class Source:
    """One compared run: its report tables, saved resolved config and run.json."""

    origin: str  # what the user named
    folder: Path  # the run or report folder it was read from
    tables: dict[str, pd.DataFrame]
    cfg: dict
    run: dict
    label: str = ""

    @property
    def summary(self) -> pd.Series:
        return self.tables["run_summary"].iloc[0]

    @property
    def price(self) -> float:
        return float(self.summary["price_per_device_hour"])


@dataclass
class Comparison:
    sources: list[Source]
    targets: list[tg.Target]
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    mfu_comparable: bool = True
    mfu_differences: list[str] = field(default_factory=list)
    #: (domain, metric) -> why the runs' values of it are not comparable (absent: comparable)
    not_comparable: dict[tuple[str, str], str] = field(default_factory=dict)
    tokens_not_comparable: str = ""  # why token counts are not in one unit ("" when they are)
    machines: dict[str, str] = field(default_factory=dict)  # label -> machine, when the runs' machines differ
    #: setting -> its values, where the runs' device, threads or peak differ (runner.reports.compare.hardware)
    hardware_differences: dict[str, str] = field(default_factory=dict)

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.sources]


# ---- reading the runs ---------------------------------------------------------------------------


def load_source(target: str) -> Source:
    """A run folder (its tables rebuilt from the raw files), a report folder, or an MLflow run id."""
    path = Path(target)
    if path.is_dir():
        if rpt.is_report_dir(path):
            _check_version(path / "run_summary.parquet")
            tables = rpt.read_tables(path)
        elif is_reportable_run(path):
            tables = rpt.build_tables(path)
        else:
            raise RunnerError(
                "neither a run folder (run.json, ledger.json) nor a report folder (run_summary.parquet)", file=target
            )
        run = read_json(path / "run.json") if (path / "run.json").exists() else {}
        cfg = read_yaml(path / "experiment.yaml")
        if not isinstance(cfg, dict):
            raise RunnerError("expected a mapping (the resolved experiment config)", file=str(path / "experiment.yaml"))
        failures = validate_tables(tables, rpt.written_version(tables))  # as written; then the current columns
        source = Source(target, path, with_added_columns(tables, rpt.written_version(tables)), cfg, run)
        if failures:
            raise RunnerError(
                f"its tables fail their schemas ({failures[0]}); see `runner audit {target}`", file=target
            )
        return source
    if rpt.MLFLOW_RUN_ID.match(str(target)):
        fetched = rpt.fetch_mlflow_run(str(target), tempfile.mkdtemp(prefix="runner-compare-"))
        source = load_source(str(fetched))
        source.origin = str(target)
        return source
    raise RunnerError("no such folder, and not an MLflow run id", file=target)


def _check_version(summary_file: Path) -> None:
    try:
        written = str(pd.read_parquet(summary_file, columns=["schema_version"]).iloc[0, 0])
    except Exception as err:  # pyarrow raises several types for a corrupt or foreign file
        raise RunnerError(f"unreadable run summary: {type(err).__name__}", file=str(summary_file)) from None
    if written not in READABLE_VERSIONS:
        raise RunnerError(
            f"report written under {written}, this runner compares {', '.join(READABLE_VERSIONS)}: rebuild it with "
            "`runner report RUN_DIR` (or compare the run folder)",
            file=str(summary_file.parent),
        )


def assign_labels(sources: list[Source], labels: list[str] | None = None) -> None:
    """Each run's column name: given, else its experiment, else experiment/run_id where experiments
    repeat (and #n where even those do)."""
    if labels:
        if len(labels) != len(sources) or len(set(labels)) != len(labels):
            raise RunnerError(f"--labels: give {len(sources)} distinct labels, got {labels}")
    else:
        names = [str(s.summary["experiment"]) for s in sources]
        labels = [n if names.count(n) == 1 else f"{n}/{s.summary['run_id']}" for n, s in zip(names, sources)]
        labels = [f"{x}#{labels[:i].count(x) + 1}" if labels.count(x) > 1 else x for i, x in enumerate(labels)]
    for s, label in zip(sources, labels):
        s.label = label


def union_targets(sources: list[Source]) -> list[tg.Target]:
    """Every target any run declares; one name must mean one target in all of them."""
    found: dict[str, tuple[tg.Target, str]] = {}
    for s in sources:
        for t in tg.declared_targets(tg.typed_config(s.cfg, str(s.folder / "experiment.yaml"))):
            if t.name in found and found[t.name][0] != t:
                other, where = found[t.name]
                raise RunnerError(
                    f"target '{t.name}' is {other.describe()} in {where} but {t.describe()} in {s.label}: "
                    "rename one so a comparison judges every run by the same target"
                )
            found.setdefault(t.name, (t, s.label))
    return [found[name][0] for name in sorted(found)]


# ---- the comparison (frames of mixed columns keep their Python types: dtype=object) -----------------------------------------------------------------------------


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def config_differences(sources: list[Source]) -> pd.DataFrame:
    """Fingerprinted keys (labels, recipe references and operational keys left out) whose values
    differ between the runs, with each run's value; configs are read with the schema's defaults."""
    flat = []
    for s in sources:
        typed = tg.typed_config(s.cfg, str(s.folder / "experiment.yaml"))
        flat.append(_flatten(canonical_meaning(typed)))
    keys = sorted(set().union(*flat))
    rows = []
    for key in keys:
        values = [f.get(key, "(absent)") for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append({"key": key, **{s.label: _cell(v) for s, v in zip(sources, values)}})
    return pd.DataFrame(rows, columns=["key", *[s.label for s in sources]], dtype=object)


def _cell(v: Any) -> Any:
    return json.dumps(v) if isinstance(v, (list, dict)) else v


def accounting(sources: list[Source]) -> pd.DataFrame:
    """Per domain (and total): processed, exposure, useful, unique and lost tokens, target and
    realized ratios, epochs; one column per run."""
    domains = sorted(set().union(*(set(s.tables["accounting"]["domain"]) for s in sources)))
    rows = []
    for d in [*domains, "total"]:
        for q in ACCOUNTING + (ACCOUNTING_RATIOS if d != "total" else ()):
            row: dict[str, Any] = {"domain": d, "quantity": q}
            for s in sources:
                acct = s.tables["accounting"].set_index("domain")
                if d == "total":
                    row[s.label] = int(s.summary[q])
                else:
                    row[s.label] = acct.loc[d, q].item() if d in acct.index else None
            rows.append(row)
    return pd.DataFrame(rows, columns=["domain", "quantity", *[s.label for s in sources]], dtype=object)


def _final_evaluation(s: Source) -> pd.DataFrame:
    seen = tg.lineage(s.tables["validation"], int(s.summary["steps"]))
    return seen[seen["step"] == seen["step"].max()] if len(seen) else seen


def quality(sources: list[Source]) -> pd.DataFrame:
    """Final validation loss (nats) and bits per byte per domain and their token-weighted mean."""
    finals = {s.label: _final_evaluation(s) for s in sources}
    domains = sorted(set().union(*(set(f["domain"]) for f in finals.values())))
    rows = [
        {
            "domain": "(step)",
            "metric": "step",
            **{k: int(f["step"].max()) if len(f) else None for k, f in finals.items()},
        }
    ]
    for d in [*domains, tg.MEAN_DOMAIN]:
        for metric in ("loss_nats", "bpb"):
            row: dict[str, Any] = {"domain": d, "metric": metric}
            for label, f in finals.items():
                values = tg.metric_by_step(f, d, metric) if len(f) else pd.Series(dtype=float)
                row[label] = float(values.iloc[-1]) if len(values) else None
            rows.append(row)
    return pd.DataFrame(rows, columns=["domain", "metric", *finals], dtype=object)


def target_results(sources: list[Source], targets: list[tg.Target]) -> pd.DataFrame:
    """Every target judged on every run: where it was met (or the best value), and at what tokens,
    seconds and dollars; `first_in_*` names the run(s) that got there first by each measure."""
    rows = []
    for t in targets:
        for s in sources:
            table = tg.targets_table([t], s.tables["validation"], int(s.summary["steps"]), s.price)
            out = tg.outcome(table, t.name)
            r = out.get("met") or out.get("best") or {}
            rows.append(
                {
                    "target": t.name,
                    "definition": t.describe(),
                    "run": s.label,
                    "met": "met" in out,
                    "step": r.get("step"),
                    "value": r.get("value"),
                    "before_step": out.get("before", {}).get("step"),
                    "exposure_tokens": r.get("exposure_tokens"),
                    "useful_tokens": r.get("useful_tokens"),
                    "wall_seconds": r.get("wall_seconds"),
                    "device_hours": r.get("device_hours"),
                    "cost_usd": r.get("cost_usd"),
                }
            )
    columns = ["target", "definition", "run", "met", "step", "value", "before_step", "exposure_tokens"]
    columns += ["useful_tokens", "wall_seconds", "device_hours", "cost_usd"]
    return mark_firsts(pd.DataFrame(rows, columns=columns))


# ---- what can be compared ------------------------------------------------------------------------


@dataclass(frozen=True)
class LossBasis:
    """What a run's validation figures rest on: its tokenizer, and per domain the validation set it
    scored (the manifests' validation shards and the samples scored) and the documents those were cut
    from (the manifest's sources and its validation rule), None where its manifest copy is missing."""

    tokenizer: str
    scored: dict[str, tuple | None]
    documents: dict[str, tuple | None]


def loss_basis(s: Source) -> LossBasis:
    domains = sorted((s.cfg.get("mixture") or {}).get("domains") or {})
    final = _final_evaluation(s)
    samples = {str(r.domain): int(r.samples) for r in final.itertuples()} if "samples" in final else {}
    scored: dict[str, tuple | None] = {}
    documents: dict[str, tuple | None] = {}
    for d in domains:
        path = s.folder / "manifests" / f"{d}.json"
        m = read_json(path) if path.is_file() else None
        if not isinstance(m, dict):
            scored[d] = documents[d] = None
            continue
        shards = tuple(str(x.get("sha256")) for x in m.get("validation_shards") or [])
        scored[d] = (shards, samples.get(d))
        sources = tuple(sorted(str(x.get("sha256")) for x in m.get("sources") or []))
        documents[d] = (sources, json.dumps(m.get("validation"), sort_keys=True))
    return LossBasis(str((s.cfg.get("tokenizer") or {}).get("sha256")), scored, documents)


def _each(sources: list[Source], values: list) -> str:
    return " vs ".join(f"{v} ({s.label})" for v, s in zip(values, sources))


def _domain_reasons(sources: list[Source], bases: list[LossBasis], d: str) -> tuple[str, str]:
    """(why loss_nats is not comparable, why bpb is not) for domain d; "" when it is."""
    if any(d not in b.scored for b in bases):
        missing = "domain absent from " + ", ".join(s.label for s, b in zip(sources, bases) if d not in b.scored)
        return missing, missing
    if any(b.scored[d] is None for b in bases):
        why = "no manifest copy to say what was scored in " + ", ".join(
            s.label for s, b in zip(sources, bases) if b.scored[d] is None
        )
        return why, why
    same_docs = len({b.documents[d] for b in bases}) == 1
    docs_why = "" if same_docs else "validation documents differ (the manifests' sources or validation rule)"
    if len({b.tokenizer for b in bases}) > 1:
        why = "tokenizers differ: sha256 " + _each(sources, [b.tokenizer[:12] for b in bases])
        return why, docs_why  # bits per byte stays comparable across tokenizers (SPEC, "Validation loss")
    scored = [b.scored[d] for b in bases]
    if len({x[0] for x in scored if x}) > 1:
        why = "validation sets differ (the manifests' validation shard sha256s)"
        return why, why
    if len({x[1] for x in scored if x}) > 1:
        why = "validation samples scored differ: " + _each(sources, [x[1] for x in scored if x])
        return why, why
    return "", ""


def comparability(sources: list[Source]) -> tuple[dict[tuple[str, str], str], str]:
    """What cannot be compared: {(domain, metric): why} over every domain and the token-weighted mean,
    and why token counts are not one unit ("" when the runs share a tokenizer)."""
    bases = [loss_basis(s) for s in sources]
    domains = sorted(set().union(*(set(b.scored) for b in bases)))
    out: dict[tuple[str, str], str] = {}
    for d in domains:
        for metric, why in zip(("loss_nats", "bpb"), _domain_reasons(sources, bases, d)):
            if why:
                out[(d, metric)] = why
    for metric in ("loss_nats", "bpb"):
        bad = [d for d in domains if (d, metric) in out]
        if bad:
            out[(tg.MEAN_DOMAIN, metric)] = f"not comparable in {', '.join(bad)}"
    tokenizers = [b.tokenizer for b in bases]
    tokens_why = (
        "" if len(set(tokenizers)) == 1 else "tokenizers differ: sha256 " + _each(sources, [t[:12] for t in tokenizers])
    )
    return out, tokens_why


def machine_of(s: Source) -> str:
    """Where a run's seconds were measured: its device, the devices held and the hosts (run.json)."""
    hosts = sorted({str(k).rsplit("#", 1)[0] for k in ((as_record(s.run).system or {}).get("nodes") or {})})
    where = f" on {', '.join(hosts)}" if hosts else " (hosts not recorded)"
    return f"{s.summary['device_name']} x {int(s.summary['devices'])}{where}"


def machines(sources: list[Source]) -> dict[str, str]:
    """label -> machine when the runs' wall-clock figures were measured on different machines, else {}."""
    found = {s.label: machine_of(s) for s in sources}
    return found if len(set(found.values())) > 1 else {}


def _peak_kind(source: str) -> str:
    head = str(source).split(":", 1)[0].strip().lower()
    return head if head in ("measured", "theoretical") else "datasheet or recipe"


def speed(sources: list[Source]) -> tuple[pd.DataFrame, bool, list[str]]:
    """MFU, goodput MFU (and HFU), time and cost, with each run's convention record; whether the
    MFU figures can be compared and, if not, which convention fields differ."""
    quantities = [
        "mfu",
        "goodput_mfu",
        "hfu",
        "wall_seconds",
        "step_seconds_total",
        "device_wall_seconds",
        "cost_per_billion_useful_tokens",
        "cost_usd",
        *MFU_CONVENTION,
        "peak_tflops",
        "peak_source",
        "device_name",
        "devices_counted",
    ]
    rows = []
    for q in quantities:
        row: dict[str, Any] = {"quantity": q}
        for s in sources:
            sm = s.summary
            value = sm["device_wall_seconds"] / 3600.0 * s.price if q == "cost_usd" else sm[q]
            row[s.label] = value.item() if hasattr(value, "item") else value
        rows.append(row)
    differences = []
    for f in MFU_CONVENTION:
        values = [str(s.summary[f]) for s in sources]
        if len(set(values)) > 1:
            differences.append(f"{f}: " + " vs ".join(f"{v} ({s.label})" for v, s in zip(values, sources)))
    kinds = [_peak_kind(s.summary["peak_source"]) for s in sources]
    if len(set(kinds)) > 1:
        differences.append("peak kind: " + " vs ".join(f"{k} ({s.label})" for k, s in zip(kinds, sources)))
    return (
        pd.DataFrame(rows, columns=["quantity", *[s.label for s in sources]], dtype=object),
        not differences,
        differences,
    )


def compare(sources: list[Source]) -> Comparison:
    """Every table of the comparison (labels already assigned)."""
    if len(sources) < 2:
        raise RunnerError(f"compare needs at least two runs, got {len(sources)}")
    targets = union_targets(sources)
    comp = Comparison(sources, targets)
    speed_df, comp.mfu_comparable, comp.mfu_differences = speed(sources)
    comp.hardware_differences = hardware_differences(comp.labels, [settings_of(s.summary, s.run) for s in sources])
    if mfu_denominators_differ(comp.hardware_differences):  # MFU against another peak
        comp.mfu_comparable = False
    comp.not_comparable, comp.tokens_not_comparable = comparability(sources)
    comp.machines = machines(sources)
    comp.frames = {
        "runs": runs_table(sources),
        "config_differences": config_differences(sources),
        "targets": _without_incomparable_firsts(target_results(sources, targets), comp),
        "quality": quality(sources),
        "accounting": accounting(sources),
        "speed": speed_df,
    }
    balance = expert_balance(comp.labels, sources)
    if balance is not None:  # mixtures of experts: load imbalance per layer, and how each run balances
        comp.frames["expert_balance"] = balance
    downstream = side_by_side(comp.labels, [s.tables.get("downstream") for s in sources])
    if len(downstream):  # refused above when the runs' convention records differ
        comp.frames["downstream"] = downstream
    configs = [tg.typed_config(s.cfg, str(s.folder / "experiment.yaml")) for s in sources]
    on_tasks = union_task_targets(comp.labels, configs)
    if on_tasks:
        runs = [(s.label, s.tables.get("downstream"), int(s.summary["steps"]), s.price) for s in sources]
        comp.frames["downstream_targets"] = task_target_results(runs, on_tasks)
        if comp.hardware_differences:  # no winner in seconds or dollars across hardware settings
            comp.frames["downstream_targets"][["first_in_wall_seconds", "first_in_cost_usd"]] = False
    return comp


def _without_incomparable_firsts(df: pd.DataFrame, comp: Comparison) -> pd.DataFrame:
    """No run is first at a target whose figure cannot be compared across the runs, nor first in
    tokens when the runs count tokens of different tokenizers, nor first in seconds or dollars when
    they ran under different hardware settings."""
    for t in comp.targets:
        rows = df["target"] == t.name
        if (t.domain, t.metric) in comp.not_comparable:
            df.loc[rows, [f"first_in_{m}" for m in ("exposure_tokens", "wall_seconds", "cost_usd")]] = False
        elif comp.tokens_not_comparable:
            df.loc[rows, "first_in_exposure_tokens"] = False
        if comp.hardware_differences:
            df.loc[rows, ["first_in_wall_seconds", "first_in_cost_usd"]] = False
    return df


def runs_table(sources: list[Source]) -> pd.DataFrame:
    fields = ("experiment", "version", "run_id", "fingerprint", "status", "steps", "device_name", "devices")
    rows: list[dict[str, Any]] = [{"field": "origin", **{s.label: s.origin for s in sources}}]
    rows += [{"field": f, **{s.label: _plain(s.summary[f]) for s in sources}} for f in fields]
    rows.append({"field": "price_per_device_hour", **{s.label: s.price for s in sources}})
    return pd.DataFrame(rows, columns=["field", *[s.label for s in sources]], dtype=object)


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


# ---- output -------------------------------------------------------------------------------------


def to_json(comp: Comparison) -> dict:
    def records(df: pd.DataFrame) -> list[dict]:
        """Rows as JSON values at full precision; NaN (a figure not recorded) is null."""
        return [{k: _json_value(v) for k, v in row.items()} for row in df.to_dict(orient="records")]

    return {
        "labels": comp.labels,
        "target_definitions": [{"name": t.name, "definition": t.describe()} for t in comp.targets],
        "mfu_comparable": comp.mfu_comparable,
        "mfu_convention_differences": comp.mfu_differences,
        **{name: records(df) for name, df in comp.frames.items()},
        **_incomparable_json(comp),
    }


def _incomparable_json(comp: Comparison) -> dict:
    """What cannot be compared, only where something cannot (comparisons of comparable runs keep the
    form they had)."""
    out: dict[str, Any] = {}
    if comp.not_comparable:
        out["not_comparable"] = [
            {"domain": d, "metric": m, "why": why} for (d, m), why in sorted(comp.not_comparable.items())
        ]
    if comp.tokens_not_comparable:
        out["tokens_not_comparable"] = comp.tokens_not_comparable
    if comp.machines:
        out["wall_clock_machines"] = comp.machines
    if comp.hardware_differences:
        out["speed_and_cost_not_comparable"] = list(comp.hardware_differences.values())
    return out


def _json_value(v: Any) -> Any:
    v = _plain(v)
    return None if isinstance(v, float) and math.isnan(v) else v


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1e5 or (v.is_integer() and abs(v) >= 1) else f"{v:.4g}"
    return str(v)


def _md(df: pd.DataFrame) -> list[str]:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(_fmt(_plain(v)) for v in row) + " |")
    return lines


def _target_cell(r: pd.Series) -> str:
    if r["step"] is None or (isinstance(r["step"], float) and math.isnan(r["step"])):
        return "no evaluation"
    if not r["met"]:
        return f"not met (best {r['value']:.4g} at step {int(r['step']):,})"
    secs = "time not recorded" if pd.isna(r["wall_seconds"]) else f"{r['wall_seconds']:,.1f} s"
    cost = "-" if pd.isna(r["cost_usd"]) else f"${r['cost_usd']:.4g}"
    return f"step {int(r['step']):,}: {int(r['exposure_tokens']):,} tokens, {secs}, {cost}"


def targets_markdown(comp: Comparison) -> list[str]:
    df = comp.frames["targets"]
    if df.empty:
        return ["No run declares a quality target (eval recipe `targets:`).", ""]
    header = ["target", *comp.labels, "first in tokens", "first in seconds", "first in dollars"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for t in comp.targets:
        g = df[df["target"] == t.name].set_index("run")
        firsts = [
            ", ".join(g.index[g[f"first_in_{m}"]]) or "none" for m in ("exposure_tokens", "wall_seconds", "cost_usd")
        ]
        if (t.domain, t.metric) in comp.not_comparable:
            firsts = ["not comparable"] * 3
        elif comp.tokens_not_comparable:
            firsts[0] = "not comparable (tokenizers differ)"
        if comp.hardware_differences:
            firsts[1:] = ["not comparable (hardware settings differ)"] * 2
        elif comp.machines:
            firsts[1:] = [f"{x} (different machines)" for x in firsts[1:]]
        cells = [_target_cell(g.loc[label]) for label in comp.labels]
        lines.append("| " + " | ".join([f"`{t.name}` ({t.describe()})", *cells, *firsts]) + " |")
    return lines + [""]


def _incomparable_markdown(comp: Comparison) -> list[str]:
    """Which final figures are NOT comparable and why (losses in nats need the same tokenizer and
    validation set; bits per byte the same validation documents)."""
    if not comp.not_comparable:
        return []
    lines = ["**NOT comparable** (shown, not to be compared):", ""]
    lines += [f"- {d} {m}: {why}" for (d, m), why in sorted(comp.not_comparable.items())]
    comparable = [
        d
        for d in sorted({d for d, _ in comp.not_comparable} | {tg.MEAN_DOMAIN})
        if (d, "bpb") not in comp.not_comparable
    ]
    if comparable:
        lines.append(f"- bits per byte is comparable for {', '.join(comparable)}")
    return lines + [""]


def render_markdown(comp: Comparison, plots: list[str] | None = None) -> str:
    f = comp.frames
    lines = [f"# Comparison: {' vs '.join(comp.labels)}", "", *_md(f["runs"]), ""]
    lines += ["## Where the configs differ (fingerprinted keys)", ""]
    diffs = f["config_differences"].assign(key=lambda df: "`" + df["key"] + "`")
    lines += _md(diffs) if len(diffs) else ["The fingerprinted configs are equal."]
    lines += ["", "## Quality targets: who gets there first", "", *targets_markdown(comp)]
    lines += [
        "A target is met at the first evaluation at or below it; tokens are exposure tokens, seconds the wall",
        "time from the first launch to the end of that evaluation (every attempt), dollars its device-hours x",
        "the price per device-hour (SPEC 'Quality targets').",
        "",
        "## Final validation loss (nats) and bits per byte",
        "",
        *_md(f["quality"]),
        "",
        "`mean` is weighted by each domain's validation tokens.",
        "",
        *_incomparable_markdown(comp),
        *_downstream_markdown(comp),
        "## Token accounting",
        "",
        *_md(f["accounting"]),
        "",
        *(
            [f"**Token counts NOT comparable**: {comp.tokens_not_comparable}; compare bits per byte.", ""]
            if comp.tokens_not_comparable
            else []
        ),
        *(
            [
                "## Expert load balance (max / mean load per MoE layer, all domains, over the run)",
                "",
                *_md(f["expert_balance"]),
                "",
            ]
            if "expert_balance" in f
            else []
        ),
        "## Speed and cost",
        "",
        *([not_comparable_line(comp.hardware_differences), ""] if comp.hardware_differences else []),
        *_md(f["speed"]),
        "",
        *(
            [
                "**Wall-clock figures measured on different machines** (seconds, device-hours, dollars, MFU): "
                + "; ".join(f"{label}: {m}" for label, m in comp.machines.items())
                + ".",
                "",
            ]
            if comp.machines
            else []
        ),
    ]
    if comp.mfu_comparable:
        lines.append("MFU and goodput MFU are under the same convention: comparable.")
    else:
        why = [*comp.mfu_differences]
        if mfu_denominators_differ(comp.hardware_differences):
            why.insert(0, "peaks of different hardware settings, named above")
        lines.append("**MFU figures NOT comparable**: the conventions differ (" + "; ".join(why) + ").")
    lines.append("")
    for p in plots or []:
        lines += [f"![{Path(p).stem}]({p})", ""]
    return "\n".join(lines)


def _downstream_markdown(comp: Comparison) -> list[str]:
    if "downstream" not in comp.frames:
        return _downstream_targets_markdown(comp)
    return [
        "## Downstream tasks",
        "",
        *_md(comp.frames["downstream"]),
        "",
        "Each run's latest scoring (the loop's, else `runner eval`'s); every figure shown here was recorded under",
        "the same convention record as the other runs' (SPEC 'Downstream evaluation').",
        "",
        *_downstream_targets_markdown(comp),
    ]


def _downstream_targets_markdown(comp: Comparison) -> list[str]:
    df = comp.frames.get("downstream_targets")
    if df is None:
        return []
    header = ["target", *comp.labels, "first in tokens", "first in seconds", "first in dollars"]
    lines = ["### Downstream targets: who gets there first", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    for name, g in df.groupby("target", sort=True):
        g = g.set_index("run")
        firsts = [
            ", ".join(g.index[g[f"first_in_{m}"]]) or "none" for m in ("exposure_tokens", "wall_seconds", "cost_usd")
        ]
        if comp.tokens_not_comparable:
            firsts[0] = "not comparable (tokenizers differ)"
        if comp.hardware_differences:
            firsts[1:] = ["not comparable (hardware settings differ)"] * 2
        elif comp.machines:
            firsts[1:] = [f"{x} (different machines)" for x in firsts[1:]]
        cells = [_target_cell(g.loc[label]) for label in comp.labels]
        lines.append("| " + " | ".join([f"`{name}` ({g['definition'].iloc[0]})", *cells, *firsts]) + " |")
    return lines + ["", "Met at the first in-loop scoring at or above `at_least` (SPEC 'Downstream evaluation').", ""]


def write_plots(comp: Comparison, out: Path) -> list[Path]:
    """Per-domain validation loss of every run against exposure tokens and against dollars spent,
    with each loss_nats target of the domain as a dashed line."""
    import matplotlib  # noqa: PLC0415  (matplotlib: only when plots are written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    domains = sorted(set().union(*(set(s.tables["validation"]["domain"]) for s in comp.sources))) + [tg.MEAN_DOMAIN]
    paths = []
    for name, xlabel in zip(PLOTS, ("exposure tokens", "dollars (device-hours x price)")):
        fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.6), squeeze=False)
        for ax, d in zip(axes[0], domains):
            for s in comp.sources:
                seen = tg.lineage(s.tables["validation"], int(s.summary["steps"]))
                if seen.empty:
                    continue
                y = tg.metric_by_step(seen, d, "loss_nats")
                progress = seen.groupby("step")[["exposure_tokens", "device_wall_seconds"]].first().loc[y.index]
                x = (
                    progress["exposure_tokens"]
                    if name == PLOTS[0]
                    else progress["device_wall_seconds"] / 3600.0 * s.price
                )
                ax.plot(x.to_numpy(dtype=float), y.to_numpy(), marker="o", ms=3, label=s.label)
            for t in comp.targets:
                if t.domain == d and t.metric == "loss_nats":
                    ax.axhline(t.threshold, ls="--", lw=0.8, color="grey")
                    ax.annotate(t.name, (0.02, t.threshold), xycoords=("axes fraction", "data"), fontsize=7)
            ax.set(title=d, xlabel=xlabel, ylabel="validation loss (nats)" if d == domains[0] else "")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    return paths


# ---- a comparison folder ------------------------------------------------------------------------


def _folder_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def collect_reports(sources: list[Source], dest: Path) -> None:
    """Audited copies of each run's report in dest/runs/<label>/, so a comparison folder carries what
    it was made from (`runner compare dest/runs/*` remakes it; `runner audit` checks each). A run
    folder's report is rebuilt first. Each source is then read back from its copy. Nothing is copied
    when an audit FAILs (the offline audit cannot PASS: its MLflow checks are UNVERIFIED): RunnerError
    names the run and the failed checks."""
    reports = []
    for s in sources:
        folder = s.folder if rpt.is_report_dir(s.folder) else write_report_with_evidence(s.folder)[0]
        result = audit(folder, check_mlflow=False)  # offline: UNVERIFIED at best, never FAIL
        if not result.consistent:
            raise RunnerError(f"its report fails the audit ({', '.join(result.failed())})", file=s.origin)
        reports.append(folder)
    staged = dest / "runs"
    if staged.exists():
        shutil.rmtree(staged)
    for s, folder in zip(sources, reports):
        copy = staged / _folder_name(s.label)
        shutil.copytree(folder, copy)
        if (copy / "run.json").exists():  # published: no machine paths, as `runner publish` writes it
            info = read_json(copy / "run.json")
            root = Path(as_record(info).project_root or repo_root(folder))
            (copy / "run.json").write_text(json.dumps(portable(info, root), indent=1))
        s.folder, s.tables = copy, rpt.read_tables(copy)


def write_comparison_folder(sources: list[Source], out: Path) -> tuple[Comparison, list[Path]]:
    """A comparison folder made whole beside `out` and renamed into place (fsio.replace_folder): the
    audited report copies (collect_reports), comparison.md/.json, the CSV tables and plots; files of
    an earlier `out` that a comparison does not write (a README of its own) are kept. A writer killed
    midway leaves the earlier folder or none. Returns the comparison and the paths it wrote in `out`."""
    staged = staging_folder(out)
    if out.is_dir():
        for f in out.iterdir():
            if f.is_file() and f.name not in _WRITTEN:
                shutil.copy2(f, staged / f.name)
    collect_reports(sources, staged)
    comp = compare(sources)
    written = write_folder(comp, staged)
    replace_folder(staged, out)
    for s in sources:  # the copies moved with the folder
        s.folder = out / s.folder.relative_to(staged)
    return comp, [out / p.name for p in written]


_WRITTEN = {"comparison.md", "comparison.json", *PLOTS} | {
    f"{name}.csv"
    for name in (
        "runs",
        "config_differences",
        "targets",
        "quality",
        "accounting",
        "speed",
        "downstream",
        "downstream_targets",
    )
}


def write_folder(comp: Comparison, out: Path) -> list[Path]:
    """comparison.md, comparison.json, one CSV per table and the plots in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(comp, out)
    (out / "comparison.md").write_text(render_markdown(comp, [p.name for p in plots]))
    (out / "comparison.json").write_text(json.dumps(to_json(comp), indent=1) + "\n")
    for name, df in comp.frames.items():
        df.to_csv(out / f"{name}.csv", index=False)
    return [out / "comparison.md", out / "comparison.json", *plots]
