"""`runner export`: one checkpoint of a run to a verified Hugging Face folder, moved into place last.

Owns the order of the act: the checkpoint chosen and verified (runner.export.source), the folder
written beside its destination under a temporary name (runner.export.folder), loaded back and
compared (runner.export.verify), its card and accounting written (runner.export.card), and only
then renamed to `--out`. Any failure removes the temporary folder (and the parents it made): no
folder is left that did not pass. Before any of it, the options are checked (dtype, shard size,
the push's repository id and token) and `--out` too: never inside the run folder (export never
changes a run folder, but for its record in RUN/exports/, written last), never an existing non-empty folder or file (nothing is written over, an
earlier export included), never a symbolic link, and somewhere a folder can be made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runner.config.load import Experiment
from runner.errors import RunnerError, display_path
from runner.export import DEFAULT_MAX_SHARD_SIZE, card, export_scoring, folder, verify, verify_export
from runner.export.push import Pushed, check_repo_id, check_token, push_folder
from runner.export.source import Source, open_source, quiet_transformers
from runner.export.stale import check_report_current
from runner.fsio import existing_ancestor, fsync_dir, fsync_file, new_or_empty_folder

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


def _check_out(out: Path, run_dir: Path) -> None:
    """Refuse, before any work, an `--out` the export may not or cannot write (one line each)."""
    if out.is_symlink():  # named as given: a file= would show the link resolved
        raise RunnerError(
            f"{out} is a symbolic link (to {os.readlink(out)}): give the folder itself, or another --out",
            key="--out",
        )
    if out.resolve().is_relative_to(run_dir.resolve()):
        raise RunnerError(
            f"is inside the run folder {run_dir}: export never changes a run folder; name a folder outside it",
            file=str(out),
            key="--out",
        )
    try:
        taken = not new_or_empty_folder(out)
    except OSError as e:
        raise RunnerError(f"cannot be read ({e.strerror or e})", file=str(out), key="--out") from None
    if taken:
        raise RunnerError(_taken(out), file=str(out), key="--out")
    ancestor = existing_ancestor(out)
    if not ancestor.is_dir():
        raise RunnerError(f"{display_path(ancestor)} is not a folder", file=str(out), key="--out")
    try:  # a folder can be made there (a read-only or virtual file system cannot take one)
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=ancestor))
    except OSError as e:
        raise RunnerError(
            f"no folder can be made in {display_path(ancestor)} ({e.strerror or e})", file=str(out), key="--out"
        ) from None


def _taken(out: Path) -> str:
    """Why an existing `--out` is not written to (it is never removed: it may be the user's)."""
    record = out / RECORD
    if out.is_dir() and record.is_file():
        with contextlib.suppress(OSError, ValueError):
            was = json.loads(record.read_text())
            return (
                f"holds an earlier export (step {was.get('step')} of {was.get('run_dir')}): an export is never "
                "written over; remove it or give another --out"
            )
    return "already exists and is not an empty folder: remove it or give another --out"


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
    shard_bytes = folder.shard_size_bytes(max_shard_size)
    if push:  # before an export of minutes: a push that cannot happen is said now
        check_repo_id(push)
        check_token()
    start = time.monotonic()
    out, run_dir = Path(out), Path(run_dir)
    _check_out(out, run_dir)
    check_report_current(run_dir)  # a `runner eval` scoring after the report would miss the card
    src = open_source(run_dir, step)
    say(f"export: {src.checkpoint.path} (verified) -> {out} ({dtype})")
    figures = card.figures(src)  # before any file is written: a run whose report does not audit is refused
    made = [p for p in reversed(out.absolute().parents) if not os.path.lexists(p)]  # outermost first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # never an existing folder
        tmp.chmod(0o755)  # mkdtemp's 0700; a shared model folder is read by others
    except OSError as e:
        _remove_empty(made)
        raise RunnerError(f"cannot make the folder ({e.strerror or e})", file=str(out), key="--out") from None
    try:
        with quiet_transformers():
            verification = _write_and_verify(src, tmp, dtype, shard_bytes, figures, say)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        raise
    # the anchor outside the export (runner verify-export): every file's sha256, in the run folder
    recorded = verify_export.record_export(run_dir, out, src.step, src.checkpoint.path.name, dtype)
    say(f"recorded: {display_path(recorded)} (the export's file hashes, for runner verify-export)")
    files = sorted(p.name for p in out.iterdir())
    done = Exported(out, src, dtype, verification, time.monotonic() - start, files)
    if push:
        exposure = int(src.checkpoint.ledger_state()["exposure.total"][0])
        say(f"push: {out} -> {push} (the folder stays, verified, whatever the Hub answers)")
        done.pushed = push_folder(
            out, push, step=src.step, exposure_tokens=exposure, revision=revision, private=private
        )
    return done


def _move_into_place(tmp: Path, out: Path) -> None:
    """The verified folder renamed to `out`, which is still absent or empty (as checked before)."""
    try:
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            out.rmdir()
        os.rename(tmp, out)
    except OSError as e:
        raise RunnerError(
            f"appeared or changed while the export ran ({e.strerror or e}): left as it is, nothing moved there",
            file=str(out),
            key="--out",
        ) from None
    fsync_dir(out.parent)


def _remove_empty(folders: list[Path]) -> None:
    """The parents an export made, innermost first, where they are still empty."""
    for path in reversed(folders):
        with contextlib.suppress(OSError):
            path.rmdir()


def _write_and_verify(src: Source, tmp: Path, dtype: str, max_shard_size: int, figures: dict, say) -> dict:
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
    scoring = export_scoring.score_folder(src, tmp, dtype)  # the folder's own figures, in its dtype
    if scoring is not None and figures.get("downstream") is not None:
        figures["downstream"]["export_scoring"] = scoring
        say(f"scored on the folder ({scoring['dtype']}): {len(scoring['figures'])} figures")
    card.write(src, tmp, figures, dtype, verification)
    record = card.export_record(src, dtype, verification)
    record["files"] = verify_export.file_hashes(tmp)  # every file written before this one
    (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
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
