"""CLI for data: `runner tokenizer train`, `runner data prepare|verify|builtin`.

Owns: argument parsing and printing for the data commands; the work is in runner.data.tokenizer,
runner.data.prepare, runner.data.manifest and runner.data.builtin. Never holds logic of its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.cli.argtypes import fraction, positive_int
from runner.errors import EXIT_OK, RunnerError, display_path


def register(subparsers) -> None:
    tok = subparsers.add_parser("tokenizer", help="train and inspect tokenizers")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    train = tok_sub.add_parser("train", help="train a byte-level BPE and write tokenizer.json + a recipe")
    train.add_argument("--input", nargs="+", required=True, help="parquet/jsonl/text files or folders")
    train.add_argument("--vocab-size", type=int, required=True, help="ids including the EOS token")
    train.add_argument("--out", required=True, help="folder for tokenizer.json and <name>.yaml")
    train.add_argument("--name", default="bpe", help="recipe name (file <name>.yaml)")
    train.set_defaults(func=cmd_tokenizer_train)

    data = subparsers.add_parser("data", help="prepare, verify and build token pools")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare",
        help="tokenize sources into shards and a manifest: an experiment's fetched sources, or --input files",
    )
    prep.add_argument(
        "experiment",
        nargs="?",
        help="experiments/NAME.yaml: every domain with a Hub source, after `runner fetch` (else use the flags)",
    )
    prep.add_argument("--domain", help="domain name recorded in the manifest (with an experiment: only this one)")
    prep.add_argument("--tokenizer", help="tokenizer.json")
    prep.add_argument("--tokenizer-sha256", default=None, help="refuse any other tokenizer file")
    prep.add_argument("--out", help="output folder (shards + manifest.json)")
    prep.add_argument("--input", nargs="+", help="files or folders, in pool order")
    prep.add_argument(
        "--input-format",
        default="auto",
        choices=["auto", "nanogpt-bin"],
        help="auto: by extension (.parquet, .jsonl, else text); nanogpt-bin: uint16 tokens",
    )
    prep.add_argument("--validation-fraction", type=fraction, default=0.02, help="documents held out")
    prep.add_argument("--shard-tokens", type=positive_int, default=100_000_000, help="tokens per shard")
    prep.add_argument(
        "--workers", type=positive_int, default=None, help="tokenizer processes (default: cores; 1: in this process)"
    )
    prep.add_argument("--batch-docs", type=positive_int, default=256, help="documents per encode_batch call")
    prep.set_defaults(func=cmd_prepare)

    verify = data_sub.add_parser(
        "verify", help="check a manifest and every shard's sha256, or every manifest an experiment pins"
    )
    verify.add_argument("manifest", help="manifest.json, or experiments/NAME.yaml (each manifest at its pin)")
    verify.add_argument("--sha256", default=None, help="the manifest_sha256 a recipe pins")
    verify.set_defaults(func=cmd_verify)

    builtin = data_sub.add_parser("builtin", help="build the built-in three-domain corpus offline")
    builtin.add_argument("--out", default="data/builtin", help="output folder")
    builtin.set_defaults(func=cmd_builtin)


MAX_TRAINED_VOCAB = 2**24


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from runner.data.prepare import find_sources, iter_documents
    from runner.data.tokenizer import train_tokenizer, vocab_size_of, write_trained

    out = _trained_out(args.out, args.name)
    if args.vocab_size < 258:
        raise RunnerError(f"{args.vocab_size} is below the 256 bytes, EOS and one merge (258)", key="--vocab-size")
    if args.vocab_size > MAX_TRAINED_VOCAB:
        # tokenizers' trainer aborts the process (a Rust panic) from 2**30 up; the largest vocabularies
        # in use are ~262K (Gemma), and the pools' uint32 ids hold far more than this bound.
        raise RunnerError(f"{args.vocab_size:,} is above {MAX_TRAINED_VOCAB:,} ids (2**24)", key="--vocab-size")
    sources = find_sources(args.input)
    documents = (text for source in sources for _, text in iter_documents(source))
    tokenizer = train_tokenizer(documents, args.vocab_size)
    vocab_size = vocab_size_of(tokenizer)
    if vocab_size < 258:  # an empty corpus, or one without a pair of bytes to merge
        raise RunnerError(
            f"no pair of bytes to merge in {len(sources)} file(s): a tokenizer needs text to learn from; nothing written",
            key="--input",
        )
    names = ", ".join(s.name for s in sources[:3]) + (f" and {len(sources) - 3} more files" if len(sources) > 3 else "")
    tokenizer_path, recipe_path = write_trained(
        tokenizer, out, args.name, f"byte-level BPE, vocab {vocab_size}, trained on {names}"
    )
    print(f"tokenizer: {tokenizer_path}\nrecipe: {recipe_path}")
    if vocab_size < args.vocab_size:
        # BPE stops when no pair is left to merge: the recipe records the size actually reached,
        # and the token dtype follows it (a 70K request on a small corpus stays uint16).
        print(
            f"note: {recipe_path}: vocab_size: {vocab_size:,} ids, not the {args.vocab_size:,} asked: "
            f"the corpus ran out of pairs to merge (train on more text for a larger vocabulary)",
            file=sys.stderr,
        )
    return EXIT_OK


def _trained_out(out: str, name: str) -> Path:
    """--out and --name checked before the training: a recipe name (never a path outside --out), a
    folder, and no tokenizer.json or <name>.yaml there already (a pinned tokenizer is never replaced)."""
    from runner.config.load import RECIPE_NAME, RECIPE_NAME_RULE

    if not RECIPE_NAME.fullmatch(name):
        raise RunnerError(f"{name[:120]!r} is not a recipe name ({RECIPE_NAME_RULE})", key="--name")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise RunnerError("exists and is not a folder: give a folder for tokenizer.json and its recipe", key="--out")
    taken = [p for p in (folder / "tokenizer.json", folder / f"{name}.yaml") if p.exists()]
    if taken:
        raise RunnerError(
            f"{', '.join(display_path(p) for p in taken)} already there: a trained tokenizer is never written "
            "over (its sha256 may be pinned); give a new --out folder",
            key="--out",
        )
    return folder


def cmd_prepare(args: argparse.Namespace) -> int:
    from runner.data.prepare import prepare, prepare_experiment, usable_cores
    from runner.errors import RunnerError

    if args.workers is not None and args.workers > (cores := usable_cores()):
        print(f"note: --workers {args.workers:,} capped at {cores}: the cores this process may use", file=sys.stderr)
    options = dict(
        validation_fraction=args.validation_fraction,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        batch_docs=args.batch_docs,
    )
    if args.experiment is not None:
        from runner.planning.resources import load_experiment

        if args.tokenizer or args.input or args.out or args.input_format != "auto":
            raise RunnerError("an experiment names its tokenizer, inputs and output: drop --tokenizer/--input/--out")
        exp = load_experiment(args.experiment, check_files=False)  # the tokenizer may not be pinned yet
        for domain, path, sha256 in prepare_experiment(exp, [args.domain] if args.domain else None, **options):
            _say_manifest(domain, path, sha256, exp.config.train.seq_len, exp.config.eval.samples_per_domain)
        print(f"next: runner pin {args.experiment}")
        return EXIT_OK
    missing = [f"--{k}" for k in ("domain", "tokenizer", "out", "input") if not getattr(args, k)]
    if missing:
        raise RunnerError(f"without an experiment, prepare needs {', '.join(missing)}")
    path, sha256 = prepare(
        args.domain,
        args.tokenizer,
        args.out,
        args.input,
        tokenizer_sha256=args.tokenizer_sha256,
        input_format=args.input_format,
        **options,
    )
    _say_manifest(args.domain, path, sha256)
    return EXIT_OK


def _say_manifest(domain: str, path, sha256: str, seq_len: int | None = None, samples_asked: int | None = None) -> None:
    """The manifest line and its sizes (what `runner pin` writes), then any small-set warning."""
    from runner.data.manifest import load_manifest

    m = load_manifest(path)
    print(f"manifest: {path}\nmanifest_sha256: {sha256}")
    print(
        f"  pool_tokens: {m.pool_tokens}\n  validation_tokens: {m.validation_tokens} "
        f"({m.data['validation_documents']} documents)"
    )
    _warn_small_validation(domain, path, seq_len, samples_asked)


#: prepare alone does not know the sequence length: it warns when even sequences this short (the
#: shortest any shipped experiment uses) give too few validation samples
SHORTEST_SEQ_LEN = 128


def _warn_small_validation(domain: str, path, seq_len: int | None = None, samples_asked: int | None = None) -> None:
    """Warn (stderr) about a small validation set, at the experiment's sequence length when known."""
    from runner.data.manifest import MIN_VALIDATION_SAMPLES, load_manifest, small_validation_warning, validation_scored

    m = load_manifest(path)
    if seq_len is not None and samples_asked is not None:
        warning = small_validation_warning(
            domain, *validation_scored(m.validation_tokens, seq_len, samples_asked), samples_asked
        )
    else:
        samples, tokens = validation_scored(m.validation_tokens, SHORTEST_SEQ_LEN, MIN_VALIDATION_SAMPLES)
        warning = small_validation_warning(domain, samples, tokens)
        warning = warning and f"{warning} (counted at seq_len {SHORTEST_SEQ_LEN})"
    if warning:
        print(f"warning: {path}: {warning}", file=sys.stderr)


def cmd_verify(args: argparse.Namespace) -> int:
    from runner.data.manifest import load_experiment_manifests, load_manifest

    if Path(args.manifest).suffix in (".yaml", ".yml"):  # an experiment: every manifest it pins, at its pin
        from runner.planning.resources import load_experiment

        if args.sha256 is not None:
            raise RunnerError(
                "is for one manifest.json: an experiment pins each of its own", file=args.manifest, key="--sha256"
            )
        manifests, _ = load_experiment_manifests(load_experiment(args.manifest), verify="full")
        found = list(manifests.values())
    else:
        found = [load_manifest(args.manifest, args.sha256, verify="full")]
    for m in found:
        print(
            f"ok: {display_path(m.path)} domain={m.domain} pool_tokens={m.pool_tokens} "
            f"validation_tokens={m.validation_tokens} shards={len(m.shards) + len(m.validation_shards)} "
            f"manifest_sha256={m.sha256}"
        )
    return EXIT_OK


def cmd_builtin(args: argparse.Namespace) -> int:
    from runner.data.builtin.build import TOKENIZER_PATH, build_builtin
    from runner.fsio import sha256_file

    print(f"tokenizer: {TOKENIZER_PATH} sha256={sha256_file(TOKENIZER_PATH)}")
    for domain, (path, sha256) in build_builtin(Path(args.out), progress=None).items():
        print(f"{domain}: {path} manifest_sha256={sha256}")
    # No small-validation warning here: the built-in `legal` domain is small by design (22 licence
    # texts), and the launch that trains on it says so, once, at the experiment's sequence length.
    return EXIT_OK
