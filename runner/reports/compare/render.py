"""`runner compare`'s outputs: a comparison as JSON, as markdown (report.md's style: the tables, the
targets, what is not comparable and why, the downstream figures), its plots, and the comparison
folder (the reports it compares, copied and re-audited, beside comparison.md and comparison.json).
The comparison itself (sources, frames, comparability) is runner.reports.compare.runs'.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pandas as pd

from runner.config.load import repo_root
from runner.errors import RunnerError
from runner.fsio import (
    check_output_file,
    check_output_folder,
    new_or_empty_folder,
    read_json,
    replace_folder,
    staging_folder,
)
from runner.mdtext import code, text
from runner.reports import tables as rpt
from runner.reports import targets as tg
from runner.reports.audit.evidence import write_report_with_evidence
from runner.reports.audit.run import audit
from runner.reports.compare.hardware import (
    mfu_denominators_differ,
    not_comparable_line,
)
from runner.reports.compare.runs import PLOTS, Comparison, Source, compare, folder_name, plain_value
from runner.reports.publish import portable
from runner.runs.runjson import as_record


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
    v = plain_value(v)
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
    return text(v)  # a run's strings (another's report: its config values, labels) are text


def _md(df: pd.DataFrame, code_columns: tuple[str, ...] = ()) -> list[str]:
    cols = list(df.columns)
    lines = ["| " + " | ".join(text(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        cells = [code(v, in_table=True) if c in code_columns else _fmt(plain_value(v)) for c, v in zip(cols, row)]
        lines.append("| " + " | ".join(cells) + " |")
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
        firsts = _firsts(comp, g, (t.domain, t.metric) in comp.not_comparable)
        cells = [_target_cell(g.loc[label]) for label in comp.labels]
        lines.append("| " + " | ".join([f"`{t.name}` ({t.describe()})", *cells, *firsts]) + " |")
    return lines + [""]


def _firsts(comp: Comparison, g: Any, not_comparable: bool = False) -> list[str]:
    """Who met a target first in tokens, seconds and dollars (`g`: the target's rows by run), each
    qualified where the runs' tokenizers, hardware settings or machines differ."""
    firsts = [", ".join(g.index[g[f"first_in_{m}"]]) or "none" for m in ("exposure_tokens", "wall_seconds", "cost_usd")]
    if not_comparable:
        firsts = ["not comparable"] * 3
    elif comp.tokens_not_comparable:
        firsts[0] = "not comparable (tokenizers differ)"
    if comp.hardware_differences:
        firsts[1:] = ["not comparable (hardware settings differ)"] * 2
    elif comp.machines:
        firsts[1:] = [f"{x} (different machines)" for x in firsts[1:]]
    return firsts


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
    diffs = f["config_differences"]
    lines += _md(diffs, code_columns=("key",)) if len(diffs) else ["The fingerprinted configs are equal."]
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
        firsts = _firsts(comp, g)
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
        copy = staged / folder_name(s.label)
        shutil.copytree(folder, copy)
        if (copy / "run.json").exists():  # published: no machine paths, as `runner publish` writes it
            info = read_json(copy / "run.json")
            root = Path(as_record(info).project_root or repo_root(folder))
            (copy / "run.json").write_text(json.dumps(portable(info, root), indent=1))
        s.folder, s.tables = copy, rpt.read_tables(copy)


def is_comparison_folder(folder: Path) -> bool:
    """A folder `runner compare --out` wrote: it holds a comparison.json, a JSON object."""
    try:
        data = json.loads((folder / "comparison.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict)


def check_outputs(sources: list[Source], out: Path | None, markdown: Path | None) -> None:
    """--out and --markdown refused (one line, before anything is written) where writing would lose
    something: --out replaces its folder whole, so it must be new, empty or a comparison folder (a run
    folder given as --out was replaced by the comparison, its checkpoints gone); neither may be inside a
    compared run or report folder; --markdown is a file."""
    inside = [s.folder.resolve() for s in sources]
    for flag, path in (("--out", out), ("--markdown", markdown)):
        if path is None:
            continue
        for folder in inside:
            if path.resolve().is_relative_to(folder):
                raise RunnerError(f"{path} is inside a compared folder ({folder}): write it elsewhere", key=flag)
    if markdown is not None:
        check_output_file(markdown, "--markdown")
    if out is None:
        return
    check_output_folder(out, "--out")
    if new_or_empty_folder(out):
        return
    if not is_comparison_folder(out):
        raise RunnerError(
            f"{out} holds other things and no comparison: --out replaces its folder whole, so give a new "
            "or empty folder, or one an earlier `runner compare --out` wrote",
            key="--out",
        )


def write_comparison_folder(sources: list[Source], out: Path) -> tuple[Comparison, list[Path]]:
    """A comparison folder made whole beside `out` and renamed into place (fsio.replace_folder): the
    audited report copies (collect_reports), comparison.md/.json, the CSV tables and plots; files and
    folders of an earlier `out` that a comparison does not write (a README of its own) are kept. A writer killed
    midway leaves the earlier folder or none. Returns the comparison and the paths it wrote in `out`."""
    check_outputs(sources, out, None)
    staged = staging_folder(out)
    if out.is_dir():
        for f in out.iterdir():
            if f.is_file() and f.name not in _WRITTEN:
                shutil.copy2(f, staged / f.name)
            elif f.is_dir() and f.name != "runs" and not f.is_symlink():
                shutil.copytree(f, staged / f.name, symlinks=True)
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
