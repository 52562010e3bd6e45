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
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from runner.config.fingerprint import canonical_meaning
from runner.errors import RunnerError
from runner.fsio import read_json, read_yaml
from runner.reports import tables as rpt
from runner.reports import targets as tg
from runner.reports.compare.downstream import mark_firsts, side_by_side, task_target_results, union_task_targets
from runner.reports.compare.experts import expert_balance
from runner.reports.compare.hardware import (
    hardware_differences,
    mfu_denominators_differ,
    settings_of,
)
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


#: a column name, written into markdown tables, CSV headers and runs/<label> folder names
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._+=@#/-]{0,63}")
LABEL_RULE = "1-64 of letters, digits, space, . _ + = @ # / -, starting with a letter or digit"


def folder_name(label: str) -> str:
    """runs/<this> in a comparison folder: the label with anything but letters, digits and ._- as '_'."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)


def _distinct_folders(labels: list[str]) -> list[str]:
    """Default labels whose runs/<label> folders differ: an experiment `a_b` beside two runs of `a`
    (labelled `a/b`, `a/c`) named one folder twice, the second copy refused midway; a later label whose
    folder is taken gets `#n` (`a/b#2`, folder `a_b_2`)."""
    taken: set[str] = set()
    out = []
    for label in labels:
        shown, n = label, 1
        while folder_name(shown) in taken:
            n += 1
            shown = f"{label}#{n}"
        taken.add(folder_name(shown))
        out.append(shown)
    return out


def assign_labels(sources: list[Source], labels: list[str] | None = None) -> None:
    """Each run's column name: given, else its experiment, else experiment/run_id where experiments
    repeat (and #n where even those do)."""
    if labels:
        if len(labels) != len(sources) or len(set(labels)) != len(labels):
            raise RunnerError(f"--labels: give {len(sources)} distinct labels, got {labels}")
        for label in labels:
            if not LABEL.fullmatch(label):
                raise RunnerError(f"--labels: {label[:80]!r} is not a label ({LABEL_RULE})")
        folders = [folder_name(x) for x in labels]
        if len(set(folders)) != len(folders):  # each run's report copy is runs/<label> in --out
            raise RunnerError(f"--labels: {labels} name the same folder runs/<label> ({folders}): make them differ")
    else:
        names = [str(s.summary["experiment"]) for s in sources]
        labels = [n if names.count(n) == 1 else f"{n}/{s.summary['run_id']}" for n, s in zip(names, sources)]
        labels = [f"{x}#{labels[:i].count(x) + 1}" if labels.count(x) > 1 else x for i, x in enumerate(labels)]
        labels = _distinct_folders(labels)
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
        values = [_convention_label(s, f) for s in sources]
        if len({_convention_value(s, f) for s in sources}) > 1:
            differences.append(f"{f}: " + " vs ".join(f"{v} ({s.label})" for v, s in zip(values, sources)))
    kinds = [_peak_kind(s.summary["peak_source"]) for s in sources]
    if len(set(kinds)) > 1:
        differences.append("peak kind: " + " vs ".join(f"{k} ({s.label})" for k, s in zip(kinds, sources)))
    return (
        pd.DataFrame(rows, columns=["quantity", *[s.label for s in sources]], dtype=object),
        not differences,
        differences,
    )


def _is_dense(s: Source) -> bool:
    model = s.cfg.get("model") if isinstance(s.cfg, dict) else None
    return not (isinstance(model, dict) and model.get("moe"))


def _convention_label(s: Source, field: str) -> str:
    """The field as a difference line shows it: what `params_counted` counts for this model."""
    value = str(s.summary[field])
    if field != "params_counted" or value not in ("non_embedding", "active"):
        return value
    if _is_dense(s):
        return f"{value} (dense: non_embedding = active)"
    return "active" if value == "active" else "non_embedding (every expert)"


def _convention_value(s: Source, field: str) -> str:
    """A run's MFU convention field as compared: a dense model's active parameters are its non-embedding
    ones (SPEC 'Mixture-of-experts'; runner.planning.flops ParamCounts.active), so a dense run counted
    `non_embedding` and a mixture of experts counted `active` count by one rule, and their MFU compares."""
    value = str(s.summary[field])
    if field == "params_counted" and (value == "active" or (_is_dense(s) and value == "non_embedding")):
        return "active"
    return value


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
    rows += [{"field": f, **{s.label: plain_value(s.summary[f]) for s in sources}} for f in fields]
    rows.append({"field": "price_per_device_hour", **{s.label: s.price for s in sources}})
    return pd.DataFrame(rows, columns=["field", *[s.label for s in sources]], dtype=object)


def plain_value(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


# ---- output -------------------------------------------------------------------------------------
