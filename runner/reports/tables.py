"""Build a run's report: tables (schemas/report_tables.py), report.md, plots, and the inputs an audit needs.

Owns: turning a run folder (run.json, experiment.yaml, ledger.json, metrics/*.jsonl, manifests/)
into the report tables, and writing run_dir/report/ (parquet + csv tables, report.md, PNG plots,
copies of experiment.yaml, run.json and the manifests so the report folder alone can be audited);
reading a report folder back; fetching a run folder from an MLflow run id.
Never: validates or judges the numbers (runner.reports.audit does), trains, or edits the run folder
outside report/.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runner.config.rules import devices
from runner.data.manifest import num_samples
from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl, read_yaml
from runner.planning.flops import Convention, flops_per_token, hfu_flops_per_token, params_of_config
from runner.reports import expert_tables
from schemas.report_tables import SCHEMA_VERSION, SCHEMAS

TABLES = tuple(SCHEMAS)
REPORT_DIR = "report"
PLOTS = ("loss_by_domain.png", "mixture.png", "repetition.png", "throughput.png")
MLFLOW_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


# ---- reading the run folder ---------------------------------------------------------------------


def read_experiment_yaml(path: Path) -> dict:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise RunnerError("expected a mapping (the resolved experiment config)", file=str(path))
    return data


def _get(cfg: dict, dotted: str, file: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise RunnerError("missing", file=file, key=dotted)
        node = node[part]
    return node


def load_manifests(folder: Path, domains: list[str]) -> dict[str, dict]:
    """The manifest JSON of each domain from `folder/<domain>.json` (copies; shards not needed)."""
    out = {}
    for d in domains:
        out[d] = read_json(folder / f"{d}.json")
        if not isinstance(out[d], dict) or "pool_tokens" not in out[d]:
            raise RunnerError("pool_tokens: missing", file=str(folder / f"{d}.json"))
    return out


def devices_held(run: dict, cfg: dict) -> int:
    """Devices the run held: run.json `devices` (the trainer's world size), else
    conventions.devices_counted, else the hardware recipe (runs recorded before either existed).

    The recipe is only a last resort because a launcher (torchrun --nproc-per-node) can start more
    processes than the recipe names, and MFU and cost are over what was held.
    """
    if run.get("devices") is not None:
        return int(run["devices"])
    recorded = (run.get("conventions") or {}).get("devices_counted")
    if recorded is not None:
        return int(recorded)
    return devices(cfg)


def conventions_of(run: dict, cfg: dict) -> dict:
    """The MFU convention record: run.json's `conventions`, peak fields defaulting to the hardware
    recipe and devices_counted to the devices held."""
    recorded = dict(run.get("conventions") or {})
    conv = Convention.from_dict(recorded).to_dict()
    hw = cfg.get("hardware") or {}
    for key in ("peak_tflops", "peak_dtype", "peak_source"):
        conv[key] = recorded.get(key, hw.get(key))
    conv["devices_counted"] = int(recorded.get("devices_counted", devices_held(run, cfg)))
    conv["time_basis"] = recorded.get("time_basis", "step")
    if conv["peak_tflops"] is None:
        raise RunnerError(
            "no peak_tflops recorded in run.json conventions or hardware recipe", key="conventions.peak_tflops"
        )
    return conv


def hfu_flops_per_token_or_nan(cfg: dict, convention: Convention, seq_len: int) -> float:
    """flops.hfu_flops_per_token as a table cell: NaN (empty) without activation checkpointing."""
    hfu = hfu_flops_per_token(cfg, convention, seq_len=seq_len)
    return float("nan") if hfu is None else hfu


def device_seconds(run: dict, cfg: dict, wall_seconds: float, step_seconds_total: float) -> tuple[float, float]:
    """(device_wall_seconds, device_step_seconds): time x devices held, summed over attempts.

    run.json's figures when recorded (the trainer sums each attempt with its own world size),
    else the seconds x the devices held (runs recorded before; one world size throughout)."""
    held = devices_held(run, cfg)
    wall = run.get("device_wall_seconds")
    step = run.get("device_step_seconds_total")
    return (
        float(wall) if wall is not None else wall_seconds * held,
        float(step) if step is not None else step_seconds_total * held,
    )


def _ledger_counters(ledger: dict, domains: list[str], file: str) -> tuple[dict, dict]:
    counters = ledger.get("counters")
    hist = ledger.get("histogram")
    if not isinstance(counters, dict) or not isinstance(hist, dict):
        raise RunnerError("expected 'counters' and 'histogram' mappings", file=file)
    for d in domains:
        if d not in counters or d not in hist:
            raise RunnerError("missing domain", file=file, key=f"counters.{d}")
    return counters, hist


def _run_times(run: dict, train_rows: list[dict]) -> tuple[float, float]:
    """(wall_seconds, step_seconds_total): run.json's totals when recorded, else from train.jsonl.

    A train.jsonl row's step_seconds is taken to stand for each step since the previous row
    (log_interval_steps > 1 logs one row per interval).
    """
    wall = run.get("wall_seconds")
    step_total = run.get("step_seconds_total")
    if train_rows and (wall is None or step_total is None):
        rows = sorted(train_rows, key=lambda r: r["step"])
        prev, summed = 0, 0.0
        for r in rows:
            span = max(int(r["step"]) - prev, 1)
            summed += float(r["step_seconds"]) * span
            prev = int(r["step"])
        wall = wall if wall is not None else max(float(r["wall_seconds"]) for r in rows)
        step_total = step_total if step_total is not None else summed
    if wall is None or step_total is None:
        raise RunnerError("no wall_seconds/step_seconds_total and no metrics/train.jsonl rows", file="run.json")
    return float(wall), float(step_total)


def build_tables(run_dir: str | Path) -> dict[str, pd.DataFrame]:
    """The report tables of a run folder, named as in schemas.report_tables.SCHEMAS."""
    run_dir = Path(run_dir)
    run = read_json(run_dir / "run.json")
    cfg_file = str(run_dir / "experiment.yaml")
    cfg = read_experiment_yaml(run_dir / "experiment.yaml")
    ledger_file = str(run_dir / "ledger.json")
    ledger = read_json(run_dir / "ledger.json")

    seq_len = int(_get(cfg, "train.seq_len", cfg_file))
    global_batch = int(_get(cfg, "train.global_batch_sequences", cfg_file))
    mix = _get(cfg, "mixture.domains", cfg_file)
    domains = sorted(mix)
    manifests = load_manifests(run_dir / "manifests", domains)
    counters, hist = _ledger_counters(ledger, domains, ledger_file)
    conv = conventions_of(run, cfg)
    convention = Convention.from_dict(conv)
    hw = cfg.get("hardware") or {}
    devices = devices_held(run, cfg)
    price = float(hw.get("price_per_device_hour_usd") or 0.0)

    acct_rows = []
    exposure_total = sum(int(counters[d]["exposure"]) for d in domains)
    for d in domains:
        c = counters[d]
        manifest_pool = int(manifests[d]["pool_tokens"])
        samples = num_samples(manifest_pool, seq_len)
        pool = samples * seq_len
        acct_rows.append(
            {
                "domain": d,
                "target_ratio": float(mix[d]["target_ratio"]),
                "realized_ratio": int(c["exposure"]) / exposure_total if exposure_total else 0.0,
                "pool_tokens": pool,
                "processed_tokens": int(c["processed"]),
                "exposure_tokens": int(c["exposure"]),
                "useful_tokens": int(c["useful"]),
                "unique_tokens": int(c["unique"]),
                "lost_tokens": int(c["lost"]),
                "epochs": int(c["exposure"]) / pool if pool else 0.0,
                "max_repetition_ratio": float(mix[d].get("max_repetition_ratio", 1.0)),
                "tail_tokens": max(manifest_pool - pool - 1, 0),
                "samples": samples,
            }
        )
    accounting = pd.DataFrame(acct_rows)

    hist_rows = [
        {"domain": d, "times_seen": int(k), "samples": int(v)}
        for d in domains
        for k, v in sorted(hist[d].items(), key=lambda kv: int(kv[0]))
    ]
    repetition = pd.DataFrame(hist_rows, columns=["domain", "times_seen", "samples"])

    # A resumed run appends again the steps it redid after its last checkpoint: the later row is
    # the one in the model's lineage.
    train_rows = list({int(r["step"]): r for r in read_jsonl(run_dir / "metrics" / "train.jsonl")}.values())
    wall_seconds, step_seconds_total = _run_times(run, train_rows)
    device_wall, device_step = device_seconds(run, cfg, wall_seconds, step_seconds_total)
    fpt = flops_per_token(cfg, convention, seq_len=seq_len)
    hfu_fpt = hfu_flops_per_token_or_nan(cfg, convention, seq_len)
    n_params = params_of_config(cfg).get(convention.params_counted)
    totals = {
        k: int(accounting[f"{k}_tokens"].sum()) for k in ("pool", "processed", "exposure", "useful", "unique", "lost")
    }
    peak_flops = float(conv["peak_tflops"]) * 1e12
    useful = totals["useful"]
    summary = pd.DataFrame(
        [
            {
                "schema_version": SCHEMA_VERSION,
                "experiment": str(run.get("experiment", cfg.get("name"))),
                "version": str(cfg.get("version")),
                "fingerprint": str(run.get("fingerprint")),
                "run_id": str(run.get("run_id", run_dir.name)),
                "status": str(run.get("status", "finished")),
                "steps": int(run.get("committed_steps", 0)),
                "seq_len": seq_len,
                "global_batch_sequences": global_batch,
                **{f"{k}_tokens": v for k, v in totals.items()},
                "wall_seconds": wall_seconds,
                "step_seconds_total": step_seconds_total,
                "device_wall_seconds": device_wall,
                "device_step_seconds": device_step,
                "params": int(n_params),
                "flops_per_token": float(fpt),
                "mfu": fpt * totals["processed"] / (device_step * peak_flops),
                "goodput_mfu": fpt * useful / (device_wall * peak_flops),
                "hfu_flops_per_token": hfu_fpt,
                "hfu": hfu_fpt * totals["processed"] / (device_step * peak_flops),
                "flops_formula": convention.flops_formula,
                "params_counted": convention.params_counted,
                "attention_causal_half": bool(convention.attention_causal_half),
                "recompute_counted": bool(convention.recompute_counted),
                "peak_tflops": float(conv["peak_tflops"]),
                "peak_dtype": str(conv["peak_dtype"]),
                "peak_source": str(conv["peak_source"]),
                "devices_counted": int(conv["devices_counted"]),
                "time_basis": str(conv["time_basis"]),
                "device_name": str(hw.get("device_name", hw.get("name", ""))),
                "devices": devices,
                "price_per_device_hour": price,
                "cost_per_billion_useful_tokens": price * (device_wall / 3600.0) / (useful / 1e9) if useful else 0.0,
            }
        ]
    )

    eval_rows = list(
        {(int(r["step"]), str(r["domain"])): r for r in read_jsonl(run_dir / "metrics" / "eval.jsonl")}.values()
    )
    validation = pd.DataFrame(
        [
            {
                "step": int(r["step"]),
                "exposure_tokens": int(r["exposure_tokens"]),
                "domain": str(r["domain"]),
                "loss_nats": float(r["loss_nats"]),
                "bpb": float(r["bpb"]),
            }
            for r in eval_rows
        ],
        columns=["step", "exposure_tokens", "domain", "loss_nats", "bpb"],
    )
    throughput = pd.DataFrame(
        [
            {
                "step": int(r["step"]),
                "tokens_per_second": float(r["tokens_per_second"]),
                "step_seconds": float(r["step_seconds"]),
                "mfu": float(r["mfu"]),
                "goodput_mfu": float(r["goodput_mfu"]),
            }
            for r in sorted(train_rows, key=lambda r: r["step"])
        ],
        columns=["step", "tokens_per_second", "step_seconds", "mfu", "goodput_mfu"],
    )
    return {
        "run_summary": summary,
        "accounting": accounting,
        "repetition": repetition,
        "validation": validation,
        "throughput": throughput,
        **expert_tables.build(run_dir, cfg, accounting, train_rows),
    }


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


def read_tables(report_dir: str | Path) -> dict[str, pd.DataFrame]:
    """Read a report folder's tables back from parquet. A report written under an older schema may
    lack tables added since: what it has is returned, and the audit says which version to rebuild."""
    report_dir = Path(report_dir)
    tables, missing = {}, []
    for name in TABLES:
        path = report_dir / f"{name}.parquet"
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


def _fmt_int(n: int) -> str:
    return f"{int(n):,}"


def _md_table(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        cells = []
        for v in row:
            if isinstance(v, (bool, np.bool_)):
                cells.append(str(bool(v)))
            elif isinstance(v, (int, np.integer)):
                cells.append(_fmt_int(v))
            elif isinstance(v, (float, np.floating)):
                cells.append(f"{v:.6g}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def final_losses(validation: pd.DataFrame) -> dict[str, float]:
    """Loss in nats per domain at the last evaluation."""
    if validation.empty:
        return {}
    last = validation[validation["step"] == validation["step"].max()]
    return {str(r.domain): float(r.loss_nats) for r in last.itertuples(index=False)}


def render_markdown(tables: dict[str, pd.DataFrame], cfg: dict, manifests: dict[str, dict]) -> str:
    s = tables["run_summary"].iloc[0]
    acct = tables["accounting"]
    model = cfg.get("model") or {}
    recipes = cfg.get("recipes") or {}
    lines = [
        f"# {s.experiment} v{s.version}: run {s.run_id}",
        "",
        f"Report schema `{s.schema_version}`. Config fingerprint `{s.fingerprint}`. Status: {s.status}.",
        "",
        "## What was trained",
        "",
        f"- Model `{recipes.get('model', model.get('name', '?'))}`: {model.get('arch', 'llama')}, "
        f"hidden {model.get('hidden_size')}, {model.get('n_layers')} layers, {model.get('n_heads')} heads "
        f"({model.get('n_kv_heads')} kv), ffn {model.get('intermediate_size')}; "
        f"N = {_fmt_int(s.params)} parameters ({s.params_counted}).",
        f"- Tokenizer `{recipes.get('tokenizer', '?')}` sha256 `{(cfg.get('tokenizer') or {}).get('sha256', '?')}`.",
        f"- Optimizer `{recipes.get('optim', '?')}`, seed {cfg.get('seed')}.",
        f"- {_fmt_int(s.steps)} committed steps x {s.global_batch_sequences} sequences x L = {s.seq_len} "
        f"= {_fmt_int(s.exposure_tokens)} exposure tokens.",
        "",
        "## On what data",
        "",
        "| domain | manifest sha256 | manifest pool tokens | samples | tail tokens |",
        "|---|---|---|---|---|",
    ]
    for r in acct.itertuples(index=False):
        m = manifests.get(r.domain, {})
        lines.append(
            f"| {r.domain} | `{m.get('manifest_sha256', '?')}` | {_fmt_int(m.get('pool_tokens', 0))} "
            f"| {_fmt_int(r.samples)} | {_fmt_int(r.tail_tokens)} |"
        )
    lines += [
        "",
        "## Token accounting",
        "",
        _md_table(acct),
        "",
        f"Totals: processed {_fmt_int(s.processed_tokens)}, exposure {_fmt_int(s.exposure_tokens)}, "
        f"useful {_fmt_int(s.useful_tokens)}, unique {_fmt_int(s.unique_tokens)}, "
        f"lost {_fmt_int(s.lost_tokens)}.",
        "",
        "![mixture](mixture.png)",
        "![repetition](repetition.png)",
        "",
    ]
    losses = final_losses(tables["validation"])
    lines += ["## Validation loss", ""]
    if losses:
        last = tables["validation"][tables["validation"]["step"] == tables["validation"]["step"].max()]
        lines += [
            _md_table(last[["domain", "loss_nats", "bpb"]].reset_index(drop=True)),
            "",
            "![loss by domain](loss_by_domain.png)",
            "",
        ]
    else:
        lines += ["No evaluation was recorded.", ""]
    lines += [
        "## How fast, at what cost",
        "",
        f"- Wall time {s.wall_seconds:.1f} s, of which training steps {s.step_seconds_total:.1f} s; "
        f"device-seconds {s.device_wall_seconds:.1f} held, {s.device_step_seconds:.1f} in steps.",
        f"- MFU {100 * s.mfu:.3g}% (step time), goodput MFU {100 * s.goodput_mfu:.3g}% (wall time, useful tokens)"
        + (
            f"; HFU {100 * s.hfu:.3g}% (activation checkpointing: the recomputed forward counted, 8N)."
            if s.hfu == s.hfu
            else "."
        ),
        f"- FLOPs per token {s.flops_per_token:.4g} ({s.flops_formula}, params {s.params_counted}).",
        f"- {s.devices} x {s.device_name} at ${s.price_per_device_hour:.2f}/device-hour: "
        f"${s.cost_per_billion_useful_tokens:.4g} per billion useful tokens.",
        "",
        "![throughput](throughput.png)",
        "",
        *expert_tables.markdown(tables, cfg, params_of_config(cfg).to_dict(), _md_table),
        "## How every figure is defined",
        "",
        "MFU convention record (SPEC, 'Throughput, MFU and cost'):",
        "",
        "| field | value |",
        "|---|---|",
    ]
    for key in (
        "flops_formula",
        "params_counted",
        "attention_causal_half",
        "recompute_counted",
        "peak_tflops",
        "peak_dtype",
        "peak_source",
        "devices_counted",
        "time_basis",
    ):
        lines.append(f"| {key} | {s[key]} |")
    lines += [
        "",
        "- `mfu` = flops_per_token * processed / (device_step_seconds * peak), where device_step_seconds =",
        "  sum over steps of step time * devices held (= step_seconds_total * devices when the world size",
        "  never changed; an attempt resumed on another world size counts its own devices).",
        "- `goodput_mfu` = flops_per_token * useful / (device_wall_seconds * peak), device_wall_seconds =",
        "  sum over attempts of wall time * devices held.",
        "- `cost_per_billion_useful_tokens` = price per device-hour * device_wall_seconds / 3600 / (useful / 1e9).",
        "- `devices` / `devices_counted`: the world size of the latest attempt.",
        "- `hfu` (activation checkpointing only, else empty) = hfu_flops_per_token * processed / (device_step_seconds",
        "  * peak), hfu_flops_per_token counting the recomputed forward (8N instead of 6N); MFU never counts it.",
        "",
        "Token kinds (exact integers, input positions unless stated):",
        "",
        "- `pool`: samples * L, the domain's pool in input positions; `samples` = floor((pool tokens - 1) / L);",
        "  `tail_tokens` = manifest pool tokens - samples * L - 1, the tail that fits no sample.",
        "- `processed`: went through forward and backward in any step, lost ones and padding included.",
        "- `exposure`: in committed steps, every repeat counted. `useful`: target positions that counted in the loss.",
        "- `unique`: distinct pool positions among the exposures. `lost` = processed - exposure.",
        "- `epochs` = exposure / pool; `realized_ratio` = exposure / total exposure.",
        "",
        "This folder holds experiment.yaml and manifests/ so `runner audit` can replay the sampler from it alone.",
        "",
    ]
    return "\n".join(lines)


def write_plots(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(paths[-1], dpi=80), plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(acct))
    ax.bar(x - 0.2, acct["target_ratio"], 0.4, label="target")
    ax.bar(x + 0.2, acct["realized_ratio"], 0.4, label="realized")
    ax.set_xticks(x, acct["domain"])
    ax.set(ylabel="share of exposure", title="Mixture: target vs realized")
    ax.legend()
    paths.append(out / "mixture.png")
    fig.savefig(paths[-1], dpi=80), plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    domains = list(acct["domain"])
    width = 0.8 / max(len(domains), 1)
    for i, d in enumerate(domains):
        g = hist[hist["domain"] == d]
        ax.bar(g["times_seen"] + (i - (len(domains) - 1) / 2) * width, g["samples"], width, label=d)
    ax.set(xlabel="times seen", ylabel="samples", title="Repetition histogram")
    ax.legend()
    paths.append(out / "repetition.png")
    fig.savefig(paths[-1], dpi=80), plt.close(fig)

    fig, ax1 = plt.subplots(figsize=(6, 4))
    ax1.plot(thr["step"], thr["tokens_per_second"], color="tab:blue", label="tokens/s")
    ax1.set(xlabel="step", ylabel="processed tokens / s", title="Throughput and MFU")
    ax2 = ax1.twinx()
    ax2.plot(thr["step"], thr["mfu"], color="tab:red", label="MFU")
    ax2.plot(thr["step"], thr["goodput_mfu"], color="tab:orange", label="goodput MFU")
    ax2.set_ylabel("fraction of peak")
    ax2.legend(loc="lower right")
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=80), plt.close(fig)
    return paths + expert_tables.write_heatmap(tables, out)


def write_report(run_dir: str | Path) -> Path:
    """Write run_dir/report/ (tables, report.md, plots, audit inputs); return its path."""
    run_dir = Path(run_dir)
    tables = build_tables(run_dir)
    cfg = read_experiment_yaml(run_dir / "experiment.yaml")
    domains = sorted(cfg["mixture"]["domains"])
    manifests = load_manifests(run_dir / "manifests", domains)
    out = run_dir / REPORT_DIR
    if out.exists():
        shutil.rmtree(out)
    (out / "manifests").mkdir(parents=True)
    for name, df in tables.items():
        df = _typed(name, df)
        df.to_parquet(out / f"{name}.parquet", index=False)
        df.to_csv(out / f"{name}.csv", index=False)
    shutil.copy2(run_dir / "experiment.yaml", out / "experiment.yaml")
    shutil.copy2(run_dir / "run.json", out / "run.json")
    for d in domains:
        shutil.copy2(run_dir / "manifests" / f"{d}.json", out / "manifests" / f"{d}.json")
    (out / "report.md").write_text(render_markdown(tables, cfg, manifests))
    write_plots(tables, out)
    return out


def render_report_dir(report_dir: str | Path) -> Path:
    """Re-render report.md and the plots of a report folder from its own tables; return it.

    An MLflow run's artifacts hold the run's report/ folder, not the raw run (no ledger.json or
    metrics), so `runner report MLFLOW_RUN_ID` rebuilds what can be rebuilt from the tables.
    """
    report_dir = Path(report_dir)
    tables = read_tables(report_dir)
    cfg = read_experiment_yaml(report_dir / "experiment.yaml")
    domains = sorted(_get(cfg, "mixture.domains", str(report_dir / "experiment.yaml")))
    manifests = load_manifests(report_dir / "manifests", domains)
    (report_dir / "report.md").write_text(render_markdown(tables, cfg, manifests))
    write_plots(tables, report_dir)
    return report_dir


def report_from_fetched(folder: str | Path) -> Path:
    """Write or re-render the report of a folder fetched by `fetch_mlflow_run`."""
    folder = Path(folder)
    if is_run_dir(folder):
        return write_report(folder)
    if is_report_dir(folder):
        return render_report_dir(folder)
    raise RunnerError(
        "neither a run folder (run.json, ledger.json) nor a report folder (run_summary.parquet)", file=str(folder)
    )


# ---- locating a run ----------------------------------------------------------------------------


def fetch_mlflow_run(run_id: str, dst: str | Path) -> Path:
    """Download an MLflow run's artifacts to `dst` and return the folder holding run.json."""
    import os

    # A tqdm bar per artifact file would bury the one line the user needs.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    from runner.training.tracking import default_tracking_uri

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


def is_run_dir(path: Path) -> bool:
    return (path / "run.json").exists() and (path / "ledger.json").exists()


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
