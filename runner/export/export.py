"""`runner export`: one checkpoint of a run to a verified Hugging Face folder, moved into place last.

Owns the order of the act: the checkpoint chosen and verified (runner.export.source), the folder
written beside its destination under a temporary name (runner.export.folder), loaded back and
compared (runner.export.verify), its card and accounting written (runner.export.card), and only
then renamed to `--out`. Any failure removes the temporary folder: no folder is left that did
not pass. Never changes the run folder, and never writes over an existing non-empty `--out`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers.utils import logging as hf_logging

from runner.config.load import Experiment
from runner.errors import RunnerError
from runner.export import DEFAULT_MAX_SHARD_SIZE, card, folder, verify
from runner.export.push import Pushed, check_token, push_folder
from runner.export.source import Source, open_source
from runner.fsio import fsync_dir, fsync_file

#: the export's own record in the folder: which checkpoint, which runner, what was verified
RECORD = "export.json"


@dataclass
class Exported:
    out: Path
    source: Source
    dtype: str
    verification: dict
    seconds: float
    files: list[str] = field(default_factory=list)
    pushed: Pushed | None = None


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunnerError("already exists and is not an empty folder: remove it or give another --out", file=str(out))


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    dtype: str = "bf16",
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
    push: str | None = None,
    revision: str | None = None,
    private: bool = False,
    say: Callable[[str], None] = lambda line: None,
) -> Exported:
    """Export the checkpoint at `step` (default: the last) of the run at `run_dir` into `out`;
    with `push`, then commit the verified folder to that Hub repository (runner.export.push)."""
    if dtype not in folder.DTYPES:
        raise RunnerError(f"unknown dtype {dtype!r}; one of {', '.join(folder.DTYPES)}", key="--dtype")
    if (revision or private) and not push:
        raise RunnerError("--revision and --private go with --push REPO", key="--revision" if revision else "--private")
    if push:
        check_token()  # before an export of minutes: a push that cannot happen is said now
    start = time.monotonic()
    out = Path(out)
    _check_out(out)
    src = open_source(run_dir, step)
    say(f"export: {src.checkpoint.path} (verified) -> {out} ({dtype})")
    figures = card.figures(src)  # before any file is written: a run whose report does not audit is refused
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with quiet_transformers():
            verification = _write_and_verify(src, tmp, dtype, max_shard_size, figures, say)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in out.iterdir())
    done = Exported(out, src, dtype, verification, time.monotonic() - start, files)
    if push:
        exposure = int(src.checkpoint.ledger_state()["exposure.total"][0])
        say(f"push: {out} -> {push} (the folder stays, verified, whatever the Hub answers)")
        done.pushed = push_folder(
            out, push, step=src.step, exposure_tokens=exposure, revision=revision, private=private
        )
    return done


@contextlib.contextmanager
def quiet_transformers():
    """transformers' progress bars and load reports are not ours to print (and a verification
    window may be longer than model_max_length, which transformers warns of)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def _write_and_verify(src: Source, tmp: Path, dtype: str, max_shard_size: str, figures: dict, say) -> dict:
    """Every file of the export into `tmp`, and the folder verified, in that order."""
    folder.write_folder(src, dtype, tmp, max_shard_size)
    domains, ids = verify.fixed_inputs(src)
    verification = {"tokenizer": verify.check_tokenizer(src, tmp, domains, ids)}
    verification["model"] = verify.check_model(src, tmp, dtype, ids)
    say(
        f"verified: logits within {verification['model']['tolerance']:.3g} "
        f"(max diff {verification['model']['max_abs_logit_diff']:.3g}), "
        f"{verification['model']['greedy_tokens_compared']} greedy tokens identical, tokenizer ids identical"
    )
    card.write(src, tmp, figures, dtype, verification)
    (tmp / RECORD).write_text(json.dumps(card.export_record(src, dtype, verification), indent=1) + "\n")
    for path in tmp.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; a shared model folder is read by others
        fsync_file(path)
    fsync_dir(tmp)
    return verification


def at_end_folder(run_dir: Path, exp: Experiment) -> Path | None:
    """Where a finished run exports itself (`export.at_end`/<run id>), or None when the key is off.
    Refused inside the run folder: export never changes a run folder."""
    at_end = exp.config.export.at_end
    if not at_end:
        return None
    out = exp.resolve_path(at_end) / run_dir.name
    if out.resolve().is_relative_to(run_dir.resolve()):
        raise RunnerError(f"{out} is inside the run folder; name a folder outside it", key="export.at_end")
    return out


def export_at_end(run_dir: Path, exp: Experiment, say: Callable[[str], None] = lambda line: None) -> Exported | None:
    """The export a finished run's `export.at_end` asks for (its final checkpoint, `export.dtype`)."""
    out = at_end_folder(run_dir, exp)
    if out is None:
        return None
    return export_run(run_dir, out, dtype=exp.config.export.dtype, say=say)
