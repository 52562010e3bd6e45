"""report.md: a run's report tables as the markdown a reader opens first.

Owns: the sections of report.md (what was trained on what data, token accounting, the curves' place,
validation and targets, downstream scores, speed and cost, the experts of a mixture of experts, how
every figure is defined), the markdown table format, the MFU convention's columns, and the lines
shared with the card (final losses, small validation sets, the device-busy line).
Never: builds or reads tables (runner.reports.tables does), writes files, or judges a figure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from runner.config.data_recipes import HubFiles
from runner.config.schema import ExperimentSchema
from runner.data.manifest import small_validation_warning
from runner.mdtext import text
from runner.planning.flops import params_of_config
from runner.reports import curves as training_curves
from runner.reports import expert_tables, targets
from runner.reports.downstream import report as downstream_report
from runner.reports.downstream import targets as downstream_targets
from runner.training import task_targets
from runner.training.startup import report_lines as startup_lines

#: the MFU convention record's fields, as the run summary holds them (SPEC, 'Throughput, MFU and cost')
CONVENTION_KEYS = (
    "flops_formula",
    "params_counted",
    "attention_causal_half",
    "recompute_counted",
    "peak_tflops",
    "peak_dtype",
    "peak_source",
    "devices_counted",
    "time_basis",
    "step_clock",  # runner-report/4; a report written before reads it as host (schemas.report_tables.ADDED_SINCE)
)


def _fmt_int(n: int | np.integer) -> str:
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


def domains_of(tables: dict[str, pd.DataFrame]) -> list[str]:
    """The run's domains, from its accounting table."""
    return sorted(str(d) for d in tables["accounting"]["domain"])


def _hub_source(hub: HubFiles | None) -> str:
    """' from repo@commit (files)' for a Hub asset, else ''."""
    if hub is None:
        return ""
    return f" from {hub.repo}@{hub.revision} ({', '.join(hub.files)})"


def small_validation_sets(validation: pd.DataFrame, domains: list[str], samples_asked: int | None = None) -> list[str]:
    """One phrase per domain validated on fewer than MIN_VALIDATION_SAMPLES samples (none: never
    evaluated), at its last evaluation; `samples_asked` (the eval recipe's) picks the advice."""
    out = []
    scored = validation.sort_values("step").groupby("domain").last() if not validation.empty else None
    for d in domains:
        if scored is None or d not in scored.index:
            samples, tokens = 0, 0
        else:
            samples, tokens = int(scored.loc[d, "samples"]), int(scored.loc[d, "tokens"])
        warning = small_validation_warning(d, samples, tokens, samples_asked)
        if warning:
            out.append(warning)
    return out


def final_losses(validation: pd.DataFrame) -> dict[str, float]:
    """Loss in nats per domain at the last evaluation."""
    if validation.empty:
        return {}
    last = validation[validation["step"] == validation["step"].max()]
    return {str(r.domain): float(r.loss_nats) for r in last.itertuples(index=False)}


def device_busy_line(run: dict | None, mfu: float) -> str:
    """The report's line beside MFU: how busy the device was (run.json `system`), and what that measures."""
    system = (run or {}).get("system") or {}
    if system.get("device_busy") is None:
        return "- Device busy: not recorded (a run before system metrics, or train.system_metrics_interval_seconds: 0)."
    return (
        f"- Device busy {100 * system['device_busy']:.3g}% beside MFU {100 * mfu:.3g}%: mean of {system.get('device_busy_samples')} "
        f"samples of {system.get('device_busy_source')}"
        + (f" ({system['samples_unreadable']} unreadable samples left out)" if system.get("samples_unreadable") else "")
        + ". Busy is not efficient: MFU is the share of the peak the model's FLOPs used."
    )


def render_markdown(
    tables: dict[str, pd.DataFrame],
    cfg: ExperimentSchema,
    manifests: dict[str, dict],
    run: dict | None = None,
    curves: bool = False,
    final_bias: dict[str, Any] | None = None,
) -> str:
    """report.md: what was trained on what data, the token accounting, the training curves (`curves`:
    training.png was written), validation and targets, speed and cost, the experts of a mixture of
    experts, and how every figure is defined."""
    lines = _md_trained_and_data(tables, cfg, manifests)
    lines += training_curves.markdown() if curves else []
    lines += _md_validation(tables, cfg)
    lines += downstream_report.markdown(tables, _md_table)
    lines += _md_speed(tables, cfg, run, final_bias)
    lines += _md_definitions(tables["run_summary"].iloc[0])
    return "\n".join(lines)


def _md_trained_and_data(
    tables: dict[str, pd.DataFrame], cfg: ExperimentSchema, manifests: dict[str, dict]
) -> list[str]:
    s = tables["run_summary"].iloc[0]
    acct = tables["accounting"]
    model, recipes = cfg.model, cfg.recipes
    lines = [
        f"# {s.experiment} v{s.version}: run {s.run_id}",
        "",
        f"Report schema `{s.schema_version}`. Config fingerprint `{s.fingerprint}`. Status: {s.status}.",
        "",
        "## What was trained",
        "",
        f"- Model `{recipes.get('model', model.name)}`: {model.arch}, "
        f"hidden {model.hidden_size}, {model.n_layers} layers, {model.n_heads} heads "
        f"({model.n_kv_heads} kv), ffn {model.intermediate_size}; "
        f"N = {_fmt_int(s.params)} parameters ({s.params_counted}); {n_meaning(cfg, str(s.params_counted))}",
        f"- Tokenizer `{recipes.get('tokenizer', '?')}` sha256 `{cfg.tokenizer.sha256}`{_hub_source(cfg.tokenizer.hub)}.",
        f"- Optimizer `{recipes.get('optim', '?')}`, seed {cfg.seed}.",
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
    sources = [
        f"`{d}`{_hub_source(spec.source)}" for d, spec in sorted(cfg.mixture.domains.items()) if spec.source is not None
    ]
    if sources:
        lines += ["", f"Raw documents: {'; '.join(sources)}."]
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
    return lines


def n_meaning(cfg: ExperimentSchema, counted: str) -> str:
    """One line on what N counts, against the total transformers' `num_parameters()` reports."""
    p = params_of_config(cfg)
    if counted == "non_embedding" and cfg.model.tie_embeddings:
        return (
            "non_embedding leaves out the input embedding lookup and counts the LM head; tied, they are one "
            "matrix, so N is transformers' total (`num_parameters()`)."
        )
    if counted == "non_embedding":
        return (
            f"non_embedding leaves out the input embedding lookup and counts the LM head; transformers' total "
            f"(`num_parameters()`) adds the embedding: {_fmt_int(p.all)}."
        )
    return f"what one token passes through; transformers' total (`num_parameters()`) is {_fmt_int(p.all)}."


def _md_validation(tables: dict[str, pd.DataFrame], cfg: ExperimentSchema) -> list[str]:
    lines: list[str] = []
    losses = final_losses(tables["validation"])
    lines += ["## Validation loss", ""]
    if losses:
        last = tables["validation"][tables["validation"]["step"] == tables["validation"]["step"].max()]
        lines += [_md_table(last[["domain", "loss_nats", "bpb", "samples", "tokens"]].reset_index(drop=True)), ""]
        small = small_validation_sets(tables["validation"], domains_of(tables), cfg.eval.samples_per_domain)
        if small:
            lines += ["Warning:", *[f"- {w}" for w in small], ""]
        lines += ["![loss by domain](loss_by_domain.png)", ""]
    else:
        lines += ["No evaluation was recorded.", ""]
    lines += targets.render_markdown(targets.declared_targets(targets.typed_config(cfg)), tables["targets"])
    on_tasks = task_targets.declared_task_targets(targets.typed_config(cfg))
    lines += downstream_targets.render_markdown(on_tasks, tables["downstream_targets"])
    return lines


def _md_speed(
    tables: dict[str, pd.DataFrame], cfg: ExperimentSchema, run: dict | None, final_bias: dict[str, Any] | None
) -> list[str]:
    s = tables["run_summary"].iloc[0]
    return [
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
        device_busy_line(run, float(s.mfu)),
        *eval_time_lines(run),
        *startup_lines(run),
        f"- FLOPs per token {s.flops_per_token:.4g} ({s.flops_formula}, params {s.params_counted}).",
        f"- {s.devices} x {s.device_name} at ${s.price_per_device_hour:.2f}/device-hour: "
        f"${s.cost_per_billion_useful_tokens:.4g} per billion useful tokens.",
        "",
        "![throughput](throughput.png)",
        "",
        *expert_tables.markdown(tables, cfg, params_of_config(cfg).to_dict(), _md_table, final_bias),
    ]


def eval_time_lines(run: dict | None) -> list[str]:
    """The t_eval line of "How fast" (run.json's `t_eval`; none for runs recorded before it)."""
    t = (run or {}).get("t_eval")
    if not isinstance(t, dict):
        return []
    attempts = len(t.get("attempts") or [])
    return [
        f"- Evaluation (t_eval, never step time; run.json `t_eval`): validation {t.get('validation_seconds', 0.0):.1f} s, "
        f"downstream scoring {t.get('downstream_seconds', 0.0):.1f} s (+ {t.get('downstream_prepare_seconds', 0.0):.1f} s "
        f"preparing the tasks) over {attempts} attempt{'s' if attempts != 1 else ''}."
    ]


def _md_definitions(s: pd.Series) -> list[str]:
    lines = [
        "## How every figure is defined",
        "",
        "MFU convention record (SPEC, 'Throughput, MFU and cost'):",
        "",
        "| field | value |",
        "|---|---|",
    ]
    for key in CONVENTION_KEYS:  # peak_source is a hardware recipe's own words: text, never Markdown or HTML
        lines.append(f"| {key} | {text(s[key]) if key == 'peak_source' else s[key]} |")
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
    return lines
