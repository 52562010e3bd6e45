"""Build a run's report: tables (schemas/report_tables.py), report.md, plots, and the inputs an audit needs.

Owns: turning a run folder (run.json, experiment.yaml, ledger.json, metrics/*.jsonl, manifests/),
read through runner.runs.recorded, into the report tables, and writing run_dir/report/ (parquet + csv
tables, report.md, PNG plots, copies of experiment.yaml, run.json and the manifests so the report
folder alone can be audited); reading a report folder back; fetching a run folder from an MLflow
run id.
Never: validates or judges the numbers (runner.reports.audit.run does), trains, or edits the run folder
outside report/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from runner.config.load import load_saved_experiment
from runner.config.schema import ExperimentSchema
from runner.data.manifest import num_samples
from runner.errors import RunnerError, display_path
from runner.fsio import read_json, read_jsonl, read_yaml, replace_folder, staging_folder
from runner.planning.flops import Convention, flops_per_token, hfu_flops_per_token, params_of_config
from runner.planning.hardware import run_efficiency
from runner.reports import curves as training_curves
from runner.reports import expert_tables, targets
from runner.reports.downstream import report as downstream_report
from runner.reports.downstream.table import downstream_table
from runner.reports.markdown import render_markdown
from runner.runs.folder import is_reportable_run
from runner.runs.recorded import (
    EVAL_FIELDS,
    EVAL_REQUIRED,
    TRAIN_FIELDS,
    TRAIN_REQUIRED,
    checked_rows,
    conventions_of,
    device_seconds,
    devices_held,
    read_manifest_copies,
    run_times,
    whole,
)
from runner.runs.runjson import as_record
from runner.training import task_targets
from runner.training.routing_record import FINAL_BIAS_FILE, final_bias_of, read_final_bias
from runner.training.tracking import default_tracking_uri, fail_fast_env
from schemas.report_tables import SCHEMA_VERSION, SCHEMAS, with_added_columns

TABLES = tuple(SCHEMAS)
#: Tables added to runner-report/3 after reports were published under it. A report without the table's
#: files whose experiment.yaml declares no eval.tasks and whose evidence.json (if any) lists no such table
#: was written before it existed: it reads the table as empty. (Dropping the table from a newer report
#: means editing evidence.json too, which the MLflow copy of the evidence exposes.)
LATER_TABLES = ("downstream", "downstream_targets")
REPORT_DIR = "report"
PLOTS = ("loss_by_domain.png", "mixture.png", "repetition.png", "throughput.png")
MLFLOW_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def hfu_flops_per_token_or_nan(cfg: ExperimentSchema, convention: Convention, seq_len: int) -> float:
    """flops.hfu_flops_per_token as a table cell: NaN (empty) without activation checkpointing."""
    hfu = hfu_flops_per_token(cfg, convention, seq_len=seq_len)
    return float("nan") if hfu is None else hfu


def _ledger_counters(ledger: dict, domains: list[str], file: str) -> tuple[dict, dict]:
    """ledger.json's counters and histogram, each count a whole number (a forged or damaged ledger
    is one line naming its key, not a traceback in the tables built from it)."""
    counters = ledger.get("counters") if isinstance(ledger, dict) else None
    hist = ledger.get("histogram") if isinstance(ledger, dict) else None
    if not isinstance(counters, dict) or not isinstance(hist, dict):
        raise RunnerError("expected 'counters' and 'histogram' mappings", file=file)
    for d in domains:
        if d not in counters or d not in hist:
            raise RunnerError("missing domain", file=file, key=f"counters.{d}")
    sections = [(f"counters.{d}", counters[d], "") for d in [*domains, *(["total"] if "total" in counters else [])]]
    sections += [(f"histogram.{d}", hist[d], " (keyed by times seen)") for d in domains]
    for where, counts, keyed in sections:
        if not isinstance(counts, dict):
            raise RunnerError(f"must be a mapping of counts, got {json.dumps(counts)[:40]}", file=file, key=where)
        for k, v in counts.items():
            if not whole(v) or (keyed and not k.isdigit()):
                raise RunnerError(
                    f"must be a whole number >= 0{keyed}, got {json.dumps(v)[:40]}", file=file, key=f"{where}.{k}"
                )
    return counters, hist


def build_tables(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """The report tables of a run folder, named as in schemas.report_tables.SCHEMAS."""
    run_dir = Path(run_dir)
    run = read_json(run_dir / "run.json")
    cfg = load_saved_experiment(run_dir / "experiment.yaml").config
    domains = sorted(cfg.mixture.domains)
    counters, hist = _ledger_counters(read_json(run_dir / "ledger.json"), domains, str(run_dir / "ledger.json"))
    accounting = _accounting(cfg, counters, read_manifest_copies(run_dir / "manifests", domains))
    # A resumed run appends again the steps it redid after its last checkpoint: the later row is
    # the one in the model's lineage.
    train_file = run_dir / "metrics" / "train.jsonl"
    train_rows = list(
        {
            int(r["step"]): r
            for r in checked_rows(read_jsonl(train_file), TRAIN_FIELDS, train_file, required=TRAIN_REQUIRED)
        }.values()
    )
    if not train_rows:  # stopped before its first step (a preemption during start-up): no throughput, no MFU
        raise RunnerError(
            f"no step trained yet (status {run.get('status')!r}): nothing to report; "
            f"`runner launch {display_path(run_dir)}` resumes it",
            file=str(run_dir),
        )
    eval_file = run_dir / "metrics" / "eval.jsonl"
    eval_rows = list(
        {
            (int(r["step"]), str(r["domain"])): r
            for r in checked_rows(read_jsonl(eval_file), EVAL_FIELDS, eval_file, required=EVAL_REQUIRED)
        }.values()
    )
    validation = targets.validation_frame(targets.complete_eval_rows(eval_rows, train_rows, str(eval_file)))
    typed = targets.typed_config(cfg, run_dir / "experiment.yaml")
    scores = downstream_table(run_dir)
    tables = {
        "run_summary": _summary(run_dir, run, cfg, accounting, train_rows),
        "accounting": accounting,
        "repetition": pd.DataFrame(
            [
                {"domain": d, "times_seen": int(k), "samples": int(v)}
                for d in domains
                for k, v in sorted(hist[d].items(), key=lambda kv: int(kv[0]))
            ],
            columns=["domain", "times_seen", "samples"],
        ),
        "validation": validation,
        "throughput": pd.DataFrame(
            [
                {c: (int if c == "step" else float)(r[c]) for c in THROUGHPUT_COLUMNS}
                for r in sorted(train_rows, key=lambda r: r["step"])
            ],
            columns=list(THROUGHPUT_COLUMNS),
        ),
        "targets": targets.targets_table(
            targets.declared_targets(typed),
            validation,
            int(as_record(run).committed_steps),
            cfg.hardware.price_per_device_hour_usd,
        ),
        **expert_tables.build(run_dir, cfg, accounting, train_rows),
        "downstream": scores,
        "downstream_targets": task_targets.task_targets_table(
            task_targets.declared_task_targets(typed),
            scores,
            int(as_record(run).committed_steps),
            cfg.hardware.price_per_device_hour_usd,
        ),
    }
    # A table of no rows has no dtypes to infer (object columns): typed as the report writes it, or a run
    # that stopped before its first evaluation (a loss gone non-finite at step 2) FAILed the schema check
    # of its run folder's audit.
    return {name: _typed(name, df) if df.empty else df for name, df in tables.items()}


THROUGHPUT_COLUMNS = TRAIN_REQUIRED  # each row's figures the throughput table holds


def _accounting(cfg: ExperimentSchema, counters: dict, manifests: dict[str, dict]) -> pd.DataFrame:
    """One row per domain: the ledger's counters against the pool the manifest copy describes."""
    seq_len, mix = cfg.train.seq_len, cfg.mixture.domains
    domains = sorted(mix)
    exposure_total = sum(int(counters[d]["exposure"]) for d in domains)
    rows = []
    for d in domains:
        c = counters[d]
        manifest_pool = int(manifests[d]["pool_tokens"])
        samples = num_samples(manifest_pool, seq_len)
        pool = samples * seq_len
        rows.append(
            {
                "domain": d,
                "target_ratio": mix[d].target_ratio,
                "realized_ratio": int(c["exposure"]) / exposure_total if exposure_total else 0.0,
                "pool_tokens": pool,
                "processed_tokens": int(c["processed"]),
                "exposure_tokens": int(c["exposure"]),
                "useful_tokens": int(c["useful"]),
                "unique_tokens": int(c["unique"]),
                "lost_tokens": int(c["lost"]),
                "epochs": int(c["exposure"]) / pool if pool else 0.0,
                "max_repetition_ratio": mix[d].max_repetition_ratio,
                "tail_tokens": max(manifest_pool - pool - 1, 0),
                "samples": samples,
            }
        )
    return pd.DataFrame(rows)


def _summary(
    run_dir: Path, run: dict, cfg: ExperimentSchema, accounting: pd.DataFrame, train_rows: list[dict]
) -> pd.DataFrame:
    """The one-row run summary: totals, times, FLOPs, MFU and cost with their convention."""
    rec = as_record(run)
    conv = conventions_of(rec, cfg)
    convention = Convention.from_dict(conv)
    hw, seq_len = cfg.hardware, cfg.train.seq_len
    wall_seconds, step_seconds_total = run_times(run, train_rows)
    device_wall, device_step = device_seconds(run, cfg, wall_seconds, step_seconds_total)
    fpt = flops_per_token(cfg, convention, seq_len=seq_len)
    hfu_fpt = hfu_flops_per_token_or_nan(cfg, convention, seq_len)
    totals = {
        k: int(accounting[f"{k}_tokens"].sum()) for k in ("pool", "processed", "exposure", "useful", "unique", "lost")
    }
    peak_tflops, price, useful = float(conv["peak_tflops"]), hw.price_per_device_hour_usd, totals["useful"]
    eff = run_efficiency(fpt, hfu_fpt, totals["processed"], useful, device_step, device_wall, peak_tflops, price)
    row = {
        "schema_version": SCHEMA_VERSION,
        "experiment": str(rec.experiment if rec.experiment is not None else cfg.name),
        "version": str(cfg.version),
        "fingerprint": str(rec.fingerprint),
        "run_id": str(rec.run_id if rec.run_id is not None else run_dir.name),
        "status": str(rec.status if rec.status is not None else "finished"),
        "steps": int(rec.committed_steps),
        "seq_len": seq_len,
        "global_batch_sequences": cfg.train.global_batch_sequences,
        **{f"{k}_tokens": v for k, v in totals.items()},
        "wall_seconds": wall_seconds,
        "step_seconds_total": step_seconds_total,
        "device_wall_seconds": device_wall,
        "device_step_seconds": device_step,
        "params": int(params_of_config(cfg).get(convention.params_counted)),
        "flops_per_token": float(fpt),
        "mfu": eff.mfu,
        "goodput_mfu": eff.goodput_mfu,
        "hfu_flops_per_token": hfu_fpt,
        "hfu": eff.hfu,
        "flops_formula": convention.flops_formula,
        "params_counted": convention.params_counted,
        "attention_causal_half": bool(convention.attention_causal_half),
        "recompute_counted": bool(convention.recompute_counted),
        "peak_tflops": peak_tflops,
        "peak_dtype": str(conv["peak_dtype"]),
        "peak_source": str(conv["peak_source"]),
        "devices_counted": int(conv["devices_counted"]),
        "time_basis": str(conv["time_basis"]),
        "step_clock": str(conv.get("step_clock", "host")),
        "device_name": hw.device_name,
        "devices": devices_held(run, cfg),
        "price_per_device_hour": price,
        "cost_per_billion_useful_tokens": eff.cost_per_billion_useful_tokens or 0.0,
    }
    return pd.DataFrame([row])


# ---- typed empty tables survive csv/parquet round trips with the schema's dtypes -----------------


def _typed(name: str, df: pd.DataFrame) -> pd.DataFrame:
    schema = SCHEMAS[name]
    df = df.copy()
    for col, spec in schema.columns.items():
        if col not in df.columns:
            continue
        dtype = str(spec.dtype)
        if dtype == "int64":
            df[col] = df[col].astype("int64")
        elif dtype == "float64":
            df[col] = df[col].astype("float64")
        elif dtype == "bool":
            df[col] = df[col].astype(bool)
        else:
            df[col] = df[col].astype(str)
    return df


def predated_tables(report_dir: str | Path) -> tuple[str, ...]:
    """The LATER_TABLES a report folder was written before (see LATER_TABLES)."""
    report_dir = Path(report_dir)
    absent = tuple(n for n in LATER_TABLES if not (report_dir / f"{n}.parquet").exists())
    if not absent:
        return ()
    try:
        cfg = read_yaml(report_dir / "experiment.yaml")
        evidence = read_json(report_dir / "evidence.json") if (report_dir / "evidence.json").is_file() else {}
    except RunnerError:  # the audit names what is wrong with either file
        return ()
    if not isinstance(cfg, dict) or not isinstance(evidence, dict) or (cfg.get("eval") or {}).get("tasks"):
        return ()
    listed = evidence.get("tables") or {}
    if not isinstance(listed, dict):  # not what the runner writes: the audit's evidence check FAILs it
        listed = {}
    return tuple(n for n in absent if n not in listed)


def written_version(tables: dict[str, pd.DataFrame]) -> str:
    """The schema version the report's run summary was written under ('none' without one)."""
    summary = tables.get("run_summary")
    if summary is None or "schema_version" not in summary or not len(summary):
        return "none"
    return str(summary["schema_version"].iloc[0])


def empty_table(name: str) -> pd.DataFrame:
    """A table of no rows, typed as its schema says."""
    return _typed(name, pd.DataFrame(columns=list(SCHEMAS[name].columns)))


def read_tables(report_dir: str | Path) -> dict[str, pd.DataFrame]:
    """Read a report folder's tables back from parquet. A report written under an older schema may
    lack tables added since: what it has is returned, and the audit says which version to rebuild.
    A table the report predates (predated_tables) reads as empty."""
    report_dir = Path(report_dir)
    tables, missing = {}, []
    predated = predated_tables(report_dir)
    for name in TABLES:
        path = report_dir / f"{name}.parquet"
        if name in predated:
            tables[name] = empty_table(name)
            continue
        if not path.exists():
            missing.append(path)
            continue
        try:
            tables[name] = pd.read_parquet(path)
        except Exception as err:  # pyarrow raises several types for a corrupt file
            raise RunnerError(f"unreadable parquet: {err}", file=str(path)) from None
    summary = tables.get("run_summary")
    older = summary is not None and "schema_version" in summary and set(summary["schema_version"]) != {SCHEMA_VERSION}
    if missing and not older:
        raise RunnerError("missing table", file=str(missing[0]))
    return tables


# ---- writing the report -------------------------------------------------------------------------


def write_plots(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415  (heavy, and its backend must be chosen before pyplot loads)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    paths = []
    val, acct, hist, thr = (tables[k] for k in ("validation", "accounting", "repetition", "throughput"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for d, g in val.groupby("domain"):
        g = g.sort_values("exposure_tokens")
        ax.plot(g["exposure_tokens"], g["loss_nats"], marker="o", label=d)
    ax.set(xlabel="exposure tokens", ylabel="validation loss (nats)", title="Validation loss per domain")
    if not val.empty:
        ax.legend()
    paths.append(out / "loss_by_domain.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(acct))
    ax.bar(x - 0.2, acct["target_ratio"], 0.4, label="target")
    ax.bar(x + 0.2, acct["realized_ratio"], 0.4, label="realized")
    ax.set_xticks(x, acct["domain"])
    ax.set(ylabel="share of exposure", title="Mixture: target vs realized")
    ax.legend()
    paths.append(out / "mixture.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    domains = list(acct["domain"])
    width = 0.8 / max(len(domains), 1)
    for i, d in enumerate(domains):
        g = hist[hist["domain"] == d]
        ax.bar(g["times_seen"] + (i - (len(domains) - 1) / 2) * width, g["samples"], width, label=d)
    ax.set(xlabel="times seen", ylabel="samples (log)", title="Repetition histogram")
    ax.set_yscale("log")  # a small domain's few samples stay visible beside a large one's thousands
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # times seen is a count
    ax.legend()
    paths.append(out / "repetition.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    # Two panels sharing the step axis: MFU is tokens/s times a constant, so on twin axes the two
    # lines fall on each other; a legend inside the axes covered the data.
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    ax1.plot(thr["step"], thr["tokens_per_second"], color="tab:blue")
    ax1.set(ylabel="processed tokens / s", title="Throughput and MFU")
    ax1.set_ylim(bottom=0)
    ax2.plot(thr["step"], 100 * thr["mfu"], color="tab:red", label="MFU (step time)")
    ax2.plot(thr["step"], 100 * thr["goodput_mfu"], color="tab:orange", label="goodput MFU (wall time)")
    ax2.set(xlabel="step", ylabel="% of peak")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    if not thr.empty:
        ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, frameon=False)  # below the axes
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)
    return paths + expert_tables.write_heatmap(tables, out) + downstream_report.write_plot(tables, out)


def write_report(run_dir: str | Path, seal: Callable[[Path], None] | None = None) -> Path:
    """Write run_dir/report/ (tables, report.md, plots, audit inputs); return its path.

    The folder is built beside report/ and renamed into place (fsio.replace_folder), `seal` (the
    evidence writer) called on it last: a writer killed at any point leaves the previous report or
    none, never a report without its plots or evidence.json."""
    run_dir = Path(run_dir)
    tables = build_tables(run_dir)
    cfg = load_saved_experiment(run_dir / "experiment.yaml").config
    domains = sorted(cfg.mixture.domains)
    manifests = read_manifest_copies(run_dir / "manifests", domains)
    final = run_dir / REPORT_DIR
    out = staging_folder(final)
    (out / "manifests").mkdir(parents=True)
    for name, df in tables.items():
        df = _typed(name, df)
        df.to_parquet(out / f"{name}.parquet", index=False)
        df.to_csv(out / f"{name}.csv", index=False)
    shutil.copy2(run_dir / "experiment.yaml", out / "experiment.yaml")
    shutil.copy2(run_dir / "run.json", out / "run.json")
    for d in domains:
        shutil.copy2(run_dir / "manifests" / f"{d}.json", out / "manifests" / f"{d}.json")
    train_rows = run_dir / "metrics" / "train.jsonl"
    curves = training_curves.write_training_curves(
        read_jsonl(train_rows) if train_rows.exists() else [], out, warn=True
    )
    info = read_json(run_dir / "run.json")
    bias = None
    if cfg.model.moe is not None:
        bias = final_bias_of(run_dir, int(as_record(info).committed_steps), cfg.model.moe.first_dense_layers)
        if bias is not None:
            (out / FINAL_BIAS_FILE).write_text(json.dumps(bias, indent=1) + "\n")
    (out / "report.md").write_text(
        render_markdown(tables, cfg, manifests, info, curves=curves is not None, final_bias=bias)
    )
    write_plots(tables, out)
    if seal is not None:
        seal(out)
    replace_folder(out, final)
    return final


def render_report_dir(report_dir: str | Path) -> Path:
    """Re-render report.md and the plots of a report folder from its own tables; return it.

    An MLflow run's artifacts hold the run's report/ folder, not the raw run (no ledger.json or
    metrics), so `runner report MLFLOW_RUN_ID` rebuilds what can be rebuilt from the tables.
    """
    report_dir = Path(report_dir)
    tables = read_tables(report_dir)
    (report_dir / "report.md").write_text(report_markdown(report_dir, tables))
    draw_plots(tables, report_dir)
    return report_dir


def draw_plots(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    """The plots of a report folder's tables (an older schema's with each newer column at the value it
    stands for), written to `out`: what `write_report` drew there, byte for byte, when this runner and
    this matplotlib drew them (`runner audit` compares). Not training.png: it is drawn from the run
    folder's train.jsonl."""
    return write_plots(with_added_columns(tables, written_version(tables)), out)


def report_markdown(report_dir: str | Path, tables: dict[str, pd.DataFrame] | None = None) -> str:
    """report.md as this runner renders it from a report folder's own files (tables, experiment.yaml,
    manifests, run.json, the curves' and final bias' files): what `write_report` wrote there, byte for
    byte, when this runner wrote it (`runner audit` compares). `tables`: the folder's, already read."""
    report_dir = Path(report_dir)
    tables = read_tables(report_dir) if tables is None else tables
    tables = with_added_columns(tables, written_version(tables))  # an older schema's: each new column at its meaning
    cfg = load_saved_experiment(report_dir / "experiment.yaml").config
    domains = sorted(cfg.mixture.domains)
    manifests = read_manifest_copies(report_dir / "manifests", domains)
    run = read_json(report_dir / "run.json") if (report_dir / "run.json").exists() else None
    curves = (report_dir / training_curves.PLOT).exists()  # drawn from train.jsonl, kept as it was
    bias = read_final_bias(report_dir)  # written with the report from the run's routing record, kept as it was
    return render_markdown(tables, cfg, manifests, run, curves=curves, final_bias=bias)


def report_from_fetched(folder: str | Path) -> Path:
    """Write or re-render the report of a folder fetched by `fetch_mlflow_run`."""
    folder = Path(folder)
    if is_reportable_run(folder):
        return write_report(folder)
    if is_report_dir(folder):
        return render_report_dir(folder)
    raise RunnerError(
        "neither a run folder (run.json, ledger.json) nor a report folder (run_summary.parquet)", file=str(folder)
    )


# ---- locating a run ----------------------------------------------------------------------------


def fetch_mlflow_run(run_id: str, dst: str | Path) -> Path:
    """Download an MLflow run's artifacts to `dst` and return the folder holding run.json."""
    # A tqdm bar per artifact file would bury the one line the user needs.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    fail_fast_env()  # a dead server: one line in seconds (4 min 10 s of retries before)
    import mlflow  # noqa: PLC0415  (mlflow: seconds to import, and it reads the setting above when it does)

    # The store launch writes to by default; a missing SQLite file is reported, never created empty.
    uri = default_tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        raise RunnerError(
            f"no MLflow store at {uri[len('sqlite:///') :]} to look up run {run_id} in "
            "(set MLFLOW_TRACKING_URI to the server or sqlite:///path/mlflow.db that holds it)"
        )
    mlflow.set_tracking_uri(uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, dst_path=str(dst)))
    except Exception as err:  # mlflow raises its own and requests' errors for unknown runs/servers
        raise RunnerError(
            f"cannot download artifacts of MLflow run {run_id} from {mlflow.get_tracking_uri()} "
            f"(set MLFLOW_TRACKING_URI for another store): {err}"
        ) from None
    found = sorted(local.rglob("run.json"), key=lambda p: len(p.parts))
    if not found:
        raise RunnerError(f"MLflow run {run_id}: its artifacts hold no run.json")
    return found[0].parent


def is_report_dir(path: Path) -> bool:
    return (path / "run_summary.parquet").exists()


#: What `write_report` puts in every report folder besides one manifests/<domain>.json per domain.
REPORT_FILES = (
    *(f"{name}.{ext}" for name in TABLES for ext in ("parquet", "csv")),
    "report.md",
    *PLOTS,
    "experiment.yaml",
    "run.json",
)


def missing_report_files(report_dir: Path, domains: list[str]) -> list[str]:
    """The files of a complete report (REPORT_FILES, manifests/<d>.json, the expert heat map of a
    mixture of experts) that `report_dir` lacks: a report cut short by a killed writer, or edited."""
    predated = {f"{name}.{ext}" for name in predated_tables(report_dir) for ext in ("parquet", "csv")}
    wanted = [f for f in REPORT_FILES if f not in predated] + [f"manifests/{d}.json" for d in domains]
    load = report_dir / "expert_load.parquet"
    if load.exists() and len(pd.read_parquet(load, columns=["layer"])):
        wanted.append(expert_tables.HEATMAP)
    scores = report_dir / "downstream.parquet"
    if scores.exists() and not downstream_report.plotted(pd.read_parquet(scores)).empty:
        wanted.append(downstream_report.PLOT)
    return [name for name in wanted if not (report_dir / name).is_file()]
