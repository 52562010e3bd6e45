"""CLI for downstream tasks: `runner eval RUN_OR_CHECKPOINT [--tasks ...]`.

Owns the verb's arguments only; scoring and what it writes are runner.training.downstream.posthoc's,
the MLflow evidence vouching for the scoring runner.reports.audit.evidence's.
"""

from __future__ import annotations

from pathlib import Path

from runner.errors import EXIT_OK, RunnerError


def _eval(args) -> int:
    names = [n.strip() for part in args.tasks for n in part.split(",") if n.strip()] if args.tasks else None
    if args.tasks is not None and not names:
        raise RunnerError(
            f"names no task ({' '.join(map(repr, args.tasks))}): give task names of the eval recipe, or builtin",
            key="--tasks",
        )
    if args.micro_batch is not None and args.micro_batch < 1:  # the flags first, as run_eval checks them
        raise RunnerError(f"must be >= 1, got {args.micro_batch}", key="--micro-batch")
    target = Path(args.target)
    if not ((target / "state.json").is_file() or (target / "run.json").is_file()):  # before seconds of imports
        raise RunnerError("neither a run folder (run.json, experiment.yaml) nor a checkpoint folder", file=args.target)
    from runner.reports.audit.evidence import vouch_for_runner_eval
    from runner.training.downstream.posthoc import run_eval

    record = run_eval(Path(args.target), names, args.micro_batch, args.limit)
    print(vouch_for_runner_eval(record.parents[1], record))
    if (record.parents[1] / "report").is_dir():  # export takes the report's figures, and refuses until then
        print(
            f"report: not rebuilt; `runner report {record.parents[1]}` adds this scoring to it (and to an export's card)"
        )
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="score a checkpoint's downstream tasks after the fact (appends to the run's record)",
        description="Score the eval recipe's downstream tasks (SPEC 'Downstream evaluation') on a checkpoint, in fp32 "
        "on this machine. Writes RUN/downstream/eval-step-NNNNNNN.json (figures, convention records, t_eval) and "
        "the per-request log-likelihoods beside it; never changes run.json, the ledger or a checkpoint.",
    )
    p.add_argument(
        "target",
        metavar="RUN_OR_CHECKPOINT",
        help="a run folder (its newest valid checkpoint) or RUN/checkpoints/step-NNNNNNN",
    )
    p.add_argument(
        "--tasks",
        action="append",
        metavar="NAME[,NAME]",
        help="only these of the recipe's tasks (default all); `builtin` is always available",
    )
    p.add_argument(
        "--micro-batch", type=int, default=None, help="rows per forward (default eval.downstream_micro_batch)"
    )
    p.add_argument(
        "--limit", type=int, default=None, help="documents per task instead of each task's own limit (recorded)"
    )
    p.set_defaults(func=_eval)
