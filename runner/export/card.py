"""The model card (README.md), accounting.json and experiment.yaml of an exported folder.

Owns which figures travel with the model and where they come from. The run's own report is audited
first (runner.reports.audit.run; a FAIL is never exported, an UNVERIFIED is said so on the card with
the checks that could not run); for the final checkpoint every figure is the audited report's
(accounting, validation, MFU with its convention, device-hours and cost); for an earlier checkpoint
(`--step N`) the accounting is that checkpoint's own ledger and the validation loss is recomputed
from its weights on the pinned samples (the run's evaluation, replayed), never the final report's.
The downstream section, at either, is the figures scored at the checkpoint's own step and the
targets as they stood there (runner.export.card_downstream).
Written with huggingface_hub's ModelCard/ModelCardData. Never writes into the run folder.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform
import shlex
from pathlib import Path
from typing import Any

import huggingface_hub
import pandas as pd
import torch
import transformers
from huggingface_hub import ModelCard, ModelCardData

from runner.config.load import to_yaml
from runner.data.datacard import describe
from runner.errors import RunnerError
from runner.export import card_downstream, card_prose
from runner.export.source import Source, reference_model
from runner.fsio import sha256_file
from runner.mdtext import text
from runner.reports import tables as rpt
from runner.reports.audit.evidence import final_validation
from runner.reports.audit.recompute_eval import _LocalAccelerator
from runner.reports.audit.run import audit
from runner.runs.recorded import conventions_of
from runner.runs.runjson import RUN_NAME, as_record
from runner.training.batches import load_data
from runner.training.evaluate import evaluate

ACCOUNTING = "accounting.json"
EXPERIMENT = "experiment.yaml"
COUNTERS = ("pool_tokens", "unique_tokens", "exposure_tokens", "useful_tokens", "processed_tokens", "lost_tokens")


def _audited(src: Source) -> dict:
    """The run's report audited now: verdict, date, the checks that could not run. FAIL refuses."""
    if not rpt.is_report_dir(src.run_dir / rpt.REPORT_DIR):
        raise RunnerError(f"the run has no report: run `runner report {src.run_dir}` first", file=str(src.run_dir))
    result = audit(src.run_dir)
    if result.verdict == "FAIL":
        raise RunnerError(
            f"the run's report does not audit (FAIL: {', '.join(result.failed())}): refusing to export it",
            file=str(src.run_dir),
        )
    return {
        "verdict": result.verdict,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "unverified": result.unverified(),
        "command": f"runner audit {src.run_dir}",
    }


def _ledger_accounting(src: Source) -> list[dict]:
    """Per-domain counters of the checkpoint's own ledger (runner.training.ledger's state)."""
    state = src.checkpoint.ledger_state()
    domains = sorted(k.removeprefix("seen.") for k in state if k.startswith("seen."))
    seq_len = int(state["seq_len"][0])
    total = int(state["exposure.total"][0])
    rows = []
    for i, d in enumerate(domains):
        pool = int(state["samples"][i]) * seq_len
        exposure = int(state["exposure.by_domain"][i])
        processed = int(state["processed.by_domain"][i])
        rows.append(
            {
                "domain": d,
                "pool_tokens": pool,
                "unique_tokens": int(state["unique.by_domain"][i]),
                "exposure_tokens": exposure,
                "useful_tokens": int(state["useful.by_domain"][i]),
                "processed_tokens": processed,
                "lost_tokens": processed - exposure,
                "epochs": exposure / pool if pool else 0.0,
                "realized_ratio": exposure / total if total else 0.0,
            }
        )
    return rows


def _replayed_validation(src: Source) -> list[dict]:
    """Validation loss and bpb of the checkpoint's weights on the run's pinned samples."""
    cfg = src.exp.config
    data = load_data(src.exp, cfg.train.seq_len)
    rows = evaluate(
        reference_model(src),
        data,
        _LocalAccelerator(str(cfg.hardware.precision)),
        cfg.eval.micro_batch_sequences,
        src.step,
        0,
    )
    return [
        {"domain": r["domain"], "loss_nats": r["loss_nats"], "bpb": r["bpb"], "samples": r["samples"]} for r in rows
    ]


def _report_validation(tables: dict[str, pd.DataFrame]) -> tuple[int | None, list[dict]]:
    final = final_validation(tables["validation"])
    if not final:
        return None, []
    return int(final["step"]), [{"domain": d, **v} for d, v in sorted(final["domains"].items())]


def _sources(src: Source) -> list[dict]:
    """Each domain's Hub source (repository and revision), where the mixture names one."""
    out = []
    for d, dom in sorted(src.exp.config.mixture.domains.items()):
        if dom.source is not None:
            out.append(
                {"domain": d, "repo": dom.source.repo, "revision": dom.source.revision, "files": list(dom.source.files)}
            )
    return out


def _data(src: Source) -> list[dict]:
    """Each domain's data card (runner.data.datacard): what it is, its source and licence."""
    cfg, out = src.exp.config, []
    for d, dom in sorted(cfg.mixture.domains.items()):
        pin = cfg.data.manifests.get(d)
        hub = dom.source
        about = describe(
            d,
            src.exp.resolve_path(pin.path) if pin is not None else Path(d),
            hub.repo if hub is not None else None,
            hub.revision if hub is not None else None,
        )
        out.append({"domain": d, **(about or {})})
    return out


def _compute(src: Source, summary: pd.Series) -> dict:
    """MFU and goodput with their convention, device-hours and cost: the audited report's."""
    cfg = src.exp.config
    device_hours = float(summary["device_wall_seconds"]) / 3600.0
    return {
        "mfu": float(summary["mfu"]),
        "goodput_mfu": float(summary["goodput_mfu"]),
        "convention": conventions_of(src.run, cfg),
        "device_hours": device_hours,
        "price_per_device_hour_usd": float(cfg.hardware.price_per_device_hour_usd),
        "cost_usd": device_hours * float(cfg.hardware.price_per_device_hour_usd),
        "cost_per_billion_useful_tokens_usd": float(summary["cost_per_billion_useful_tokens"]),
        "scope": "the whole run"
        if src.final
        else f"the whole run (to step {int(summary['steps'])}), not to step {src.step}",
    }


def figures(src: Source) -> dict:
    """Every figure the card states, from the audited report (or the checkpoint's own ledger and
    replayed evaluation for an earlier step); accounting.json is this, as JSON."""
    audited = _audited(src)
    tables = rpt.read_tables(src.run_dir / rpt.REPORT_DIR)
    summary = tables["run_summary"].iloc[0]
    cfg = src.exp.config
    if src.final:
        accounting = [
            {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in tables["accounting"][["domain", *COUNTERS, "epochs", "realized_ratio"]].to_dict("records")
        ]
        val_step, validation = _report_validation(tables)
        validation_source = "the audited report's last evaluation"
    else:
        accounting = _ledger_accounting(src)
        val_step, validation = src.step, _replayed_validation(src)
        validation_source = "recomputed now from this checkpoint's weights on the run's pinned validation samples"
    for row in accounting:
        row["manifest_sha256"] = cfg.data.manifests[row["domain"]].sha256
    return {
        "format": "runner-export-accounting/2",
        "experiment": {"name": cfg.name, "version": cfg.version, "fingerprint": src.exp.fingerprint},
        "run_id": as_record(src.run).run_id,
        "checkpoint": {
            "step": src.step,
            "final": src.final,
            "exposure_tokens": sum(int(r["exposure_tokens"]) for r in accounting),
            "state_json_sha256": sha256_file(src.checkpoint.path / "state.json"),
        },
        "accounting": accounting,
        "validation": {"step": val_step, "source": validation_source, "domains": validation},
        "downstream": card_downstream.downstream_figures(cfg, tables, src.step),
        "compute": _compute(src, summary),
        "audit": audited,
        "tokenizer": {
            "sha256": cfg.tokenizer.sha256,
            "hub": dataclasses.asdict(cfg.tokenizer.hub) if cfg.tokenizer.hub else None,
        },
        "data_sources": _sources(src),
        "data": _data(src),
    }


def export_record(src: Source, dtype: str, verification: dict) -> dict:
    """export.json: which checkpoint, by what software, and what the folder was verified against."""
    return {
        "format": "runner-export/1",
        "run_dir": str(src.run_dir),
        "checkpoint": src.checkpoint.path.name,
        "step": src.step,
        "fingerprint": src.exp.fingerprint,
        "dtype": dtype,
        "checkpoint_files": src.checkpoint.record.files,
        "verification": verification,
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "huggingface_hub": huggingface_hub.__version__,
        },
    }


def _fmt(x: Any, digits: int = 4) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}g}"
    return str(x)


def _table(rows: list[dict], columns: list[str]) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return out


def card_text(src: Source, f: dict, dtype: str, verification: dict) -> str:
    """The card's body (Markdown) under its front matter, in the Hub template's order: model
    description, intended uses and limitations, how to use, training data, evaluation, then the
    project's proof (compute, audit, reproduce) and the licence."""
    cfg, a, c = src.exp.config, f["audit"], f["compute"]
    conv = c["convention"]
    lines = [
        f"# {cfg.name} (step {src.step:,})",
        "",
        *card_prose.description(cfg, f),
        "",
        f"Exported by `runner export` from run `{f['run_id']}`, checkpoint `{src.checkpoint.path.name}`"
        f" ({'the final one' if src.final else 'not the final one'}), weights in {dtype}.",
        "",
        "## Model description",
        "",
        f"- experiment: `{cfg.name}` version {cfg.version}, fingerprint `{src.exp.fingerprint}`",
        f"- model: {cfg.model.arch}, {cfg.model.n_layers} layers, hidden {cfg.model.hidden_size}, "
        f"context {cfg.train.seq_len} tokens; tokenizer sha256 `{cfg.tokenizer.sha256}`",
        f"- exposure at this checkpoint: {f['checkpoint']['exposure_tokens']:,} tokens",
        "",
        "## Intended uses & limitations",
        "",
        *card_prose.intended_uses(cfg, f),
        "",
        "## How to use",
        "",
        *card_prose.usage_snippet(f),
        "",
        "## Training data",
        "",
        *card_prose.training_data(f),
        "",
        "### Data accounting",
        "",
        "Per domain, in tokens (docs/SPEC.md of the runner defines every counter): "
        + ("the audited report's." if src.final else "this checkpoint's own ledger."),
        "",
        *_table(f["accounting"], ["domain", *COUNTERS[:4], "epochs", "realized_ratio", "manifest_sha256"]),
        "",
    ]
    if f["data_sources"]:
        lines += [
            "Sources: " + "; ".join(f"`{s['repo']}` at `{s['revision']}` ({s['domain']})" for s in f["data_sources"]),
            "",
        ]
    v = f["validation"]
    lines += [
        "## Evaluation",
        "",
        f"### Validation (step {v['step']})",
        "",
        f"Mean token cross-entropy (nats) and bits per byte: {v['source']}.",
        "",
    ]
    lines += [*_table(v["domains"], ["domain", "loss_nats", "bpb"]), ""]
    lines += card_downstream.markdown(cfg, f["downstream"])
    lines += [
        "## Compute",
        "",
        f"- MFU {c['mfu']:.2%}, goodput MFU {c['goodput_mfu']:.2%} ({c['scope']}); convention: "
        f"{conv.get('flops_formula')}, params {conv.get('params_counted')}, time basis {conv.get('time_basis')}, "
        f"peak {_fmt(conv.get('peak_tflops'))} TFLOP/s {conv.get('peak_dtype')} ({text(conv.get('peak_source'))}), "
        f"{conv.get('devices_counted')} device(s) counted",
        f"- device-hours {c['device_hours']:.4g}, cost ${c['cost_usd']:.4g} at ${c['price_per_device_hour_usd']:g} "
        f"per device-hour (${c['cost_per_billion_useful_tokens_usd']:.4g} per billion useful tokens)",
        "",
        "## Audit",
        "",
        f"- verdict **{a['verdict']}** on {a['date']} (`{a['command']}`)"
        + (f"; could not run: {', '.join(a['unverified'])}" if a["unverified"] else ""),
        f"- export verified: logits within {verification['model']['tolerance']:.3g} of the run's model "
        f"(max difference {verification['model']['max_abs_logit_diff']:.3g}, {dtype}); "
        f"{verification['model']['greedy_tokens_compared']} greedy tokens identical; tokenizer ids identical",
        "",
        "## Reproduce",
        "",
        "```bash",
        *reproduce_lines(src),
        "```",
        "",
        f"`{EXPERIMENT}` here is the resolved experiment; `{ACCOUNTING}` holds these figures as JSON.",
        "",
        "## Licence",
        "",
        *card_prose.licence(cfg, f),
        "",
    ]
    return "\n".join(lines)


def reproduce_lines(src: Source) -> list[str]:
    """The launches that retrain this run: the pinned experiment, then one `--extend-to` per later
    segment (an extension changes the schedule's length, so it is part of what was trained)."""
    rec = as_record(src.run)
    cfg, run_id = src.exp.config, rec.run_id or src.run_dir.name
    segments = rec.segments
    first = segments[0].get("fingerprint", "")[:12] if segments else src.exp.fingerprint[:12]
    # a run id `--run-name` takes, as it is; another (a `--run-dir` folder's name) as the folder, quoted
    # (shlex leaves a run name's letters, digits and `_ . -` as they are)
    folder = shlex.quote(f"runs/{cfg.name}/{run_id}")
    where = f"--run-name {run_id}" if RUN_NAME.fullmatch(run_id) else f"--run-dir {folder}"
    lines = [f"runner launch experiments/{cfg.name}.yaml {where}   # fingerprint {first}"]
    for seg in segments[1:]:
        tokens = seg.get("exposure_tokens") or seg.get("max_duration_tokens")
        lines.append(f"runner launch {folder} --extend-to {tokens}   # fingerprint {str(seg.get('fingerprint'))[:12]}")
    if src.final:
        return lines
    return lines + [f"# this export is of step {src.step:,}: checkpoints/{src.checkpoint.path.name} of that run"]


def write(src: Source, out: Path, f: dict, dtype: str, verification: dict) -> None:
    """README.md (the card), accounting.json and experiment.yaml into `out`."""
    cfg = src.exp.config
    data = ModelCardData(
        library_name="transformers",
        license=cfg.export.license or "other",
        # no licence chosen: the Hub's `other` wants a name; the card's Licence section says why
        license_name=None if cfg.export.license else "unspecified",
        datasets=sorted({s["repo"] for s in f["data_sources"]}) or None,
        tags=["runner", "pretraining", cfg.model.arch, f"fingerprint-{src.exp.fingerprint[:12]}"],
        pipeline_tag="text-generation",
        model_name=cfg.name,
    )
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{card_text(src, f, dtype, verification)}")
    card.save(out / "README.md")
    # strict JSON (jq, JavaScript): a figure not recorded (NaN, inf) is null, never Python's NaN
    (out / ACCOUNTING).write_text(json.dumps(_finite(f), indent=1, default=_plain, allow_nan=False) + "\n")
    (out / EXPERIMENT).write_text(to_yaml(cfg))


def _finite(x: Any) -> Any:
    """`x` with every non-finite float (numpy's too) as None, containers walked."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    x = x.item() if hasattr(x, "item") else x
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _plain(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON: {type(x).__name__}")
