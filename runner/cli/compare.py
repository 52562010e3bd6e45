"""CLI verb `runner compare`: parsing and printing only (runner.reports.compare.runs compares,
runner.reports.compare.render writes)."""

from __future__ import annotations

import json
from pathlib import Path

from runner.errors import EXIT_OK


def _compare(args) -> int:
    from runner.reports.compare import render
    from runner.reports.compare import runs as cmp

    sources = [cmp.load_source(target) for target in args.runs]
    cmp.assign_labels(sources, [x.strip() for x in args.labels.split(",")] if args.labels else None)
    render.check_outputs(sources, Path(args.out) if args.out else None, Path(args.markdown) if args.markdown else None)
    plots: list[str] = []
    if args.out:  # built beside --out and renamed into place: never half a comparison
        comp, written = render.write_comparison_folder(sources, Path(args.out))
        plots = [str(p.resolve()) for p in written if p.suffix == ".png"]
    else:
        comp = cmp.compare(sources)
    if args.markdown:
        md = Path(args.markdown)
        md.parent.mkdir(parents=True, exist_ok=True)
        links = [_relative(p, md.parent) for p in plots]
        md.write_text(render.render_markdown(comp, links))
    if args.json:
        print(json.dumps(render.to_json(comp), indent=1))
    else:
        print(render.render_markdown(comp, plots))
        for what, where in (("comparison folder", args.out), ("markdown", args.markdown)):
            if where:
                print(f"wrote {what} {where}")
    return EXIT_OK


def _relative(path: str, start: Path) -> str:
    import os

    return os.path.relpath(path, start.resolve())


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="runs side by side: config differences, accounting, losses, time- and cost-to-target, MFU",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run folders, report folders (reports/...) or MLflow run ids; the first is the baseline",
    )
    p.add_argument(
        "--labels", default=None, help="comma-separated column names, one per run (default: experiment names)"
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="write comparison.md/.json, CSV tables, the loss plots (PNG) and audited copies of the compared reports (runs/) here",
    )
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the tables as markdown to FILE")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON instead of markdown")
    p.set_defaults(func=_compare)
