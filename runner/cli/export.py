"""CLI verbs `export`, `verify-export` and `sample`: parsing and printing only (the work is in runner.export)."""

from __future__ import annotations

import argparse
import sys

from runner.cli.argtypes import positive_int
from runner.errors import EXIT_DISCREPANCY, EXIT_OK, EXIT_UNVERIFIED
from runner.export import DEFAULT_MAX_SHARD_SIZE


def _step(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a committed step >= 1, got {text}")
    return value


def cmd_export(args: argparse.Namespace) -> int:
    from runner.export.export import export_run

    done = export_run(
        args.run,
        args.out,
        step=args.step,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        push=args.push,
        revision=args.revision,
        private=args.private,
        say=lambda line: print(line, file=sys.stderr),
    )
    audit = done.verification
    print(
        f"exported {done.source.checkpoint.path.name} of {args.run} to {done.out} ({done.dtype}, "
        f"{len(done.files)} files, {done.seconds:.1f} s); verified: logits within "
        f"{audit['model']['tolerance']:.3g}, tokenizer ids identical"
    )
    print(f"load it: AutoModelForCausalLM.from_pretrained({str(done.out)!r}); card: {done.out / 'README.md'}")
    if done.pushed is not None:
        p = done.pushed
        print(f"pushed: {p.repo} branch {p.branch} commit {p.commit} ({p.url})")
    return EXIT_OK


def cmd_verify_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from runner.export.verify_export import FAIL, UNVERIFIED, render, verdict, verify_export

    checks = verify_export(Path(args.dir), Path(args.run))
    print(render(Path(args.dir), Path(args.run), checks))
    return {FAIL: EXIT_DISCREPANCY, UNVERIFIED: EXIT_UNVERIFIED}.get(verdict(checks), EXIT_OK)


def cmd_sample(args: argparse.Namespace) -> int:
    from runner.export.sample import sample

    got = sample(
        args.target,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        step=args.step,
    )
    print(f"{got.prompt}{got.text}")
    if got.provenance:
        print(got.provenance, file=sys.stderr)
    if got.note:
        print(f"note: {got.note}", file=sys.stderr)
    print(
        f"({got.new_tokens} new tokens from {got.source}, temperature {args.temperature:g}, seed {args.seed})",
        file=sys.stderr,
    )
    return EXIT_OK


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:  # torch.manual_seed's range
        raise argparse.ArgumentTypeError(f"an integer from 0 to 2**64 - 1, got {text}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="one verified checkpoint of a run to a Hugging Face folder (weights, tokenizer, model card)",
        description="Write a checkpoint of a run as a folder transformers loads with no code of ours, load it back "
        "and compare it with the run's model on fixed validation inputs, then move it into place. The card's figures "
        "are the audited report's (with --step, that checkpoint's own ledger and replayed evaluation).",
    )
    p.add_argument("run", metavar="RUN_DIR", help="run folder (runs/EXPERIMENT/RUN_ID)")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the folder to write (new, or empty; outside the run folder, not a symbolic link)",
    )
    p.add_argument("--step", type=_step, default=None, metavar="N", help="the checkpoint of step N (default: the last)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"safetensors shards above this size are split, with an index (KB, MB, GB, TB; default "
        f"{DEFAULT_MAX_SHARD_SIZE})",
    )
    p.add_argument(
        "--push", default=None, metavar="REPO", help="then commit the folder to this Hub repository (HF_TOKEN)"
    )
    p.add_argument(
        "--revision",
        default=None,
        metavar="BRANCH",
        help="the branch to commit to (default: step-NNNNNNN-exposure-TOKENS, the checkpoint's own)",
    )
    p.add_argument("--private", action="store_true", help="create the repository private (when it is new)")
    p.set_defaults(func=cmd_export)

    p = subparsers.add_parser(
        "verify-export",
        help="check an exported folder against its run: recorded hashes, weights, config, tokenizer, card figures",
        description="Check an exported folder after the fact against the run it came from: its files against the "
        "hashes recorded in RUN/exports/ when it was written, the weights tensor by tensor against the checkpoint "
        "they came from, config and tokenizer against the run's, and the card's and accounting.json's figures "
        "recomputed from the run's audited report. Exit 0 PASS, 1 FAIL (naming what differs), 5 UNVERIFIED.",
    )
    p.add_argument("dir", metavar="DIR", help="the exported folder")
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="the run folder it was exported from")
    p.set_defaults(func=cmd_verify_export)

    p = subparsers.add_parser(
        "sample",
        help="text from a run's checkpoint or an exported folder (transformers' generate, one process)",
    )
    p.add_argument(
        "target", metavar="RUN_OR_DIR", help="a run folder (its last checkpoint, or --step) or an exported folder"
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=32,
        metavar="N",
        help="tokens to generate (default 32; at most what the model's context leaves after the prompt)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 = greedy (default); above 0 (finite), sampled at T",
    )
    p.add_argument("--seed", type=_seed, default=0, metavar="S", help="the sampling seed (default 0)")
    p.add_argument("--step", type=_step, default=None, metavar="N", help="a run folder's checkpoint of step N")
    p.set_defaults(func=cmd_sample)
