"""The `runner` command: argument parsing and error presentation only; every verb calls a module.

Bad input (RunnerError) prints one `error: file: key: message` line per problem and exits 2, with
no traceback. Each verb imports the modules it calls when it runs (the one place in the package
where imports are deferred): `runner --help` and every verb pay only for their own imports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runner.cli import compare, data, downstream, export, hub, job, plan, report, train
from runner.errors import EXIT_OK, EXIT_USAGE, RunnerError, display_path

#: when this module was imported: the start of a command's wall time where runner.STARTED is missing (main)
_IMPORTED = time.perf_counter()

#: modules under runner/cli that add their verbs through `register(subparsers)`
COMMAND_MODULES = (data, hub, train, job, report, plan, compare, export, downstream)


def _cmd_validate(args) -> int:
    from runner.data.manifest import said_once

    paths = [f for p in args.paths for f in yaml_files(Path(p))] or default_targets(Path.cwd())
    failed = 0
    warned: list[str] = []
    said: set[str] = set()  # a base experiment's problem, found again through each one built on it: said once
    # Flushed line by line: piped together (2>&1 | less), errors and the summary keep their order.
    for path in paths:
        try:
            line, notes, warnings = validate_one(path)
            print(line, flush=True)
            for n in notes:
                print(f"  note: {n}", flush=True)
            warned += warnings
        except RunnerError as e:
            failed += 1
            for msg in str(e).splitlines():
                if msg not in said:
                    said.add(msg)
                    print(f"error: {msg}", file=sys.stderr, flush=True)
    for w in said_once(warned):  # the same warning of many experiments is said once, naming them
        print(f"warning: {w}", flush=True)
    print(f"{len(paths) - failed} valid, {failed} invalid", flush=True)
    return EXIT_USAGE if failed else EXIT_OK


def default_targets(cwd: Path) -> list[Path]:
    from runner.config.load import find_project_root
    from runner.config.schema import KINDS

    root = find_project_root(cwd)
    if not (root / "recipes").is_dir():
        raise RunnerError(
            f"no recipes/ folder in {cwd.resolve()} or above: run inside a runner checkout, or name the files to validate"
        )
    out = [p for k in KINDS for p in sorted((root / "recipes" / k).glob("*.yaml"))]
    # rglob: `runner pilot-grid` writes its experiments to experiments/pilots/, and they must
    # validate as well as the hand-written ones (a bumped base breaks them).
    return out + sorted((root / "experiments").rglob("*.yaml"))


def yaml_files(path: Path) -> list[Path]:
    """A file as given; a folder as the files under it that `runner validate` checks by default where it is
    the checkout, or inside its recipes/ or experiments/ (`runner validate recipes/model experiments/`;
    recipes/hardware/accelerate holds accelerate's files, not recipes), else every .yaml under it; or
    the folder itself where it holds none (refused by `validate_one`)."""
    from runner.config.load import find_project_root

    if not path.is_dir():
        return [path]
    whole, root = path.resolve(), find_project_root(path)
    ours = (root / "recipes").is_dir() and (
        whole == root or whole.is_relative_to(root / "recipes") or whole.is_relative_to(root / "experiments")
    )
    if ours:
        found = [path / t.relative_to(whole) for t in default_targets(root) if t.is_relative_to(whole)]
    else:
        found = sorted(path.rglob("*.yaml"))
    return found or [path]


def validate_one(path: Path) -> tuple[str, list[str], list[str]]:
    """Validate a recipe on its own (kind from its folder) or an experiment with the data checks that
    need no training (pins present here, feasibility over the pools' sizes, pinned when the data is
    absent). Returns the OK line, notes and warnings (small validation sets)."""
    from runner.config.schema import KINDS
    from runner.errors import Problems
    from runner.planning.resources import load_experiment, load_recipe_file

    if path.is_dir():
        raise RunnerError("a folder with no recipe or experiment .yaml file under it", file=str(path))
    if path.parent.name in KINDS:
        problems = Problems()
        load_recipe_file(path, path.parent.name, problems)
        problems.raise_if_any()
        return f"ok  {display_path(path)}", [], []
    from runner.data.manifest import check_experiment_data
    from runner.training.downstream.tasks import check_task_pins

    exp = load_experiment(path)
    notes, warnings = check_experiment_data(exp)
    notes += check_task_pins(exp)  # the eval recipe's task files, as the manifests: their pins where present
    return f"ok  {display_path(path)}  fingerprint {exp.fingerprint}", exp.notes + notes, warnings


def _cmd_show(args) -> int:
    from runner.config.load import experiment_from_dict, to_yaml
    from runner.fsio import read_yaml
    from runner.planning.resources import load_experiment

    path = Path(args.experiment)
    if path.is_dir():  # a run folder: its resolved experiment.yaml
        if not (path / "experiment.yaml").is_file():
            raise RunnerError(
                f"{display_path(path)}: a folder without experiment.yaml: give an experiment file "
                "(experiments/NAME.yaml) or a run folder (runs/NAME/RUN_ID)"
            )
        path = path / "experiment.yaml"
    data = read_yaml(path)
    if isinstance(data, dict) and isinstance(data.get("tokenizer"), dict) and isinstance(data.get("recipes"), dict):
        exp = experiment_from_dict(data, path=path)  # already resolved (a run's copy)
    else:
        exp = load_experiment(path)
    if args.json:
        print(json.dumps({"fingerprint": exp.fingerprint, "config": exp.to_container()}, indent=2))
    else:
        print(f"# fingerprint: {exp.fingerprint}")
        print(to_yaml(exp.config), end="")
        for n in exp.notes:
            print(f"# note: {n}")
    return EXIT_OK


def _cmd_check_pr(args) -> int:
    from runner.fsio import check_output_file
    from runner.reports.pr_review import Loads, check_pr, review_markdown

    md = check_output_file(args.markdown, "--markdown") if args.markdown else None
    loads = Loads()
    problems, report = check_pr(args.base, Path.cwd(), loads)
    if md is not None:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(review_markdown(args.base, Path.cwd(), problems, loads))
        report.append(f"review summary written to {md}")
    for line in report:
        print(line)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    print("check-pr: " + ("FAIL" if problems else "PASS"))
    return EXIT_USAGE if problems else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runner", description="LLM pretraining experiments as data, with provable token accounting."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("validate", help="validate recipes and experiments (default: all of them)")
    p.add_argument("paths", nargs="*", help="recipe or experiment YAML files, or folders of them")
    p.set_defaults(func=_cmd_validate)
    p = sub.add_parser("show", help="print an experiment's resolved config and fingerprint")
    p.add_argument("experiment", help="experiments/NAME.yaml, or a run folder (its resolved experiment.yaml)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_show)
    p = sub.add_parser("check-pr", help="what a pull request must satisfy, against a base git ref")
    p.add_argument("--base", required=True, help="git ref to compare with, e.g. origin/main")
    p.add_argument(
        "--markdown",
        default=None,
        metavar="FILE",
        help="write the reviewer's summary (changed keys, plan before/after per experiment) to FILE",
    )
    p.set_defaults(func=_cmd_check_pr)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


#: verbs of seconds to hours that end by saying their whole wall time (start-up and imports included)
TIMED = ("launch", "export", "eval", "report", "audit", "smoke", "compare", "data")


def _say_wall(command: str, started: float) -> None:
    """`runner VERB: N s in all`: what the user waited, not only the part a verb measures itself."""
    if command in TIMED and os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        from runner.progress import format_seconds

        seconds = time.perf_counter() - started
        long = f" ({format_seconds(seconds)})" if seconds >= 60 else ""
        print(f"runner {command}: {seconds:.1f} s in all{long}, start-up included", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    import runner

    # In a process: from the package's first import. Read by attribute: under an editable install, a
    # `runner/` folder in the working directory (a project copy holding runner/builtin/assets/tokenizer.json)
    # makes `runner` a namespace package whose __init__ never ran; then from this module's import.
    started = getattr(runner, "STARTED", _IMPORTED) if argv is None else time.perf_counter()
    if argv is None:  # a process started to run a command (not a host calling it): before torch's import
        from runner import bytecode  # noqa: PLC0415

        bytecode.settle()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or EXIT_OK)
        if code == EXIT_OK:
            _say_wall(args.command, started)
        return code
    except RunnerError as e:
        # Under torchrun every rank meets the same bad input: one line per node, not one per process
        # (a node-local problem, such as a shard missing on one node, is still said by that node).
        if os.environ.get("LOCAL_RANK", "0") == "0":
            for msg in str(e).splitlines():
                print(f"error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader closed the pipe (`runner show X | head -1`): it read what it wanted. Point stdout
        # at devnull, or the interpreter's last flush fails again and prints a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        # A path the system refused (a folder where a file goes, a file above a folder to make, no
        # permission) that no check of the verb named: one line naming the path, not a traceback.
        # An OSError naming no path is not a path the user gave: its traceback is kept. Said by every
        # rank (a path may fail on one process alone), naming the rank where there are several.
        if e.filename is None:
            raise
        other = f" -> {e.filename2}" if e.filename2 is not None else ""
        rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else ""
        print(f"error: {rank}{e.filename}{other}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
