"""`runner verify-export DIR --run RUN`: an exported folder checked after the fact against its run.

Owns: the record of each export kept in the run folder when it is written (`RUN/exports/
<checkpoint>-<id>.json`: the folder, step, dtype and every file's sha256; the anchor outside the
export, which a forger rewriting export.json with the card does not reach), and the verification: the
folder's files against that record; then every file regenerated from the run as `runner export`
writes it (the checkpoint's weights through transformers' own save_pretrained, config, generation
config, the pinned tokenizer, experiment.yaml) and compared: the weights tensor by tensor (exported
shards never hash-equal checkpoint files), the JSON files as data; the card (README.md) and
accounting.json re-rendered from the figures the run's report gives now, audited (only the audit's
date and the export's logit check are taken from the folder; the folder's own downstream scoring is
rescored on it), and compared line by line and key by key. Each check is a line: PASS, FAIL naming what differs, or UNVERIFIED saying why (an export
written before records were kept). Also: the check `runner sample` makes of an exported folder
(recorded hashes where the run folder is at hand, "unverified" where it is not), and the figures
check of a published card (reports/models/<name>/) against the published report it names.
Never: writes into the export, or into the run folder beyond its own record.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open

from runner.config.load import load_saved_experiment
from runner.errors import RunnerError, display_path
from runner.export import card, card_downstream, export_scoring, folder
from runner.export.source import Source, open_source, quiet_transformers
from runner.fsio import atomic_write_json, read_json, sha256_file
from runner.reports import tables as rpt
from runner.runs.recorded import number, whole

RECORDS = "exports"  #: RUN/exports/: one record per export written from the run
FORMAT = "runner-export-files/1"
EXPORT_RECORD = "export.json"
PASS, FAIL, UNVERIFIED = "PASS", "FAIL", "UNVERIFIED"
#: keys a reader of another transformers version writes differently: never a figure
VOLATILE_KEYS = ("transformers_version",)


@dataclass
class Check:
    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<10} {self.name}: {self.detail}"


# ---- the record kept in the run folder ------------------------------------------------------------


def file_hashes(path: Path) -> dict[str, str]:
    """sha256 of every file of an exported folder (a flat folder: subfolders are named as such)."""
    return {p.name: sha256_file(p) if p.is_file() else "not a file" for p in sorted(Path(path).iterdir())}


def record_export(run_dir: Path, out: Path, step: int, checkpoint: str, dtype: str) -> Path:
    """Write RUN/exports/<checkpoint>-<id>.json for the export just moved into place at `out`."""
    files = file_hashes(out)
    ident = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(run_dir) / RECORDS / f"{checkpoint}-{ident}.json"
    path.parent.mkdir(exist_ok=True)
    atomic_write_json(
        path,
        {
            "format": FORMAT,
            "out": str(Path(out).resolve()),
            "step": int(step),
            "checkpoint": checkpoint,
            "dtype": dtype,
            "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": files,
        },
    )
    return path


def _records(run_dir: Path) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted((Path(run_dir) / RECORDS).glob("*.json")):
        try:
            data = read_json(path)
        except RunnerError:
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("files"), dict):
            out.append((path, data))
    return out


def check_recorded_files(export_dir: Path, run_dir: Path) -> Check:
    """The folder's files against the run folder's records of its exports."""
    name = "files as recorded in the run folder when exported"
    got = file_hashes(export_dir)
    records = _records(run_dir)
    if not records:
        return Check(
            name,
            UNVERIFIED,
            f"{display_path(Path(run_dir) / RECORDS)} holds no export record (exported before "
            "records were kept): the files are checked against the run below, not against their hashes",
        )
    for path, rec in records:
        if rec["files"] == got:
            return Check(name, PASS, f"{len(got)} files, sha256 as {display_path(path)} records")
    here = str(Path(export_dir).resolve())
    if not any(r.get("out") == here for _, r in records) and "files" not in _listed(export_dir):
        return Check(
            name,
            UNVERIFIED,
            f"no record in {display_path(Path(run_dir) / RECORDS)} is of this folder, and its {EXPORT_RECORD} lists no "
            "files (exported before records were kept): checked against the run below, not against its hashes",
        )
    path, rec = max(
        records, key=lambda r: (r[1].get("out") == here, sum(got.get(k) == v for k, v in r[1]["files"].items()))
    )
    want = rec["files"]
    differ = [f for f in sorted(set(got) | set(want)) if got.get(f) != want.get(f)]
    said = [
        f"{f} ({'not in the export' if f not in got else 'not recorded' if f not in want else 'sha256 differs'})"
        for f in differ
    ]
    return Check(name, FAIL, f"against {display_path(path)}: {', '.join(said[:8])}{' ...' if len(said) > 8 else ''}")


def _listed(export_dir: Path) -> dict:
    """export.json as read ({} when unreadable: the checks below say so)."""
    try:
        data = read_json(Path(export_dir) / EXPORT_RECORD)
    except RunnerError:
        return {}
    return data if isinstance(data, dict) else {}


def sample_provenance(export_dir: Path) -> str:
    """What `runner sample` says of an exported folder's files: verified against the run folder's
    record, or unverified (and why); RunnerError when the record says the files were changed."""
    try:
        record = read_json(Path(export_dir) / EXPORT_RECORD)
        run_dir = Path(str(record["run_dir"]))
    except (RunnerError, KeyError, TypeError):
        return f"unverified: no readable {EXPORT_RECORD} names the run it came from"
    if not (run_dir / RECORDS).is_dir():
        return f"unverified: the run folder it names ({run_dir}) holds no export records here"
    check = check_recorded_files(export_dir, run_dir)
    if check.status == FAIL:
        raise RunnerError(
            f"the folder's files differ from the run's record of this export ({check.detail}): refusing to sample "
            "from it (`runner verify-export` says more)",
            file=str(export_dir),
        )
    return ("verified: " if check.status == PASS else "unverified: ") + check.detail


# ---- regenerate and compare ------------------------------------------------------------------------


def _json(path: Path) -> Any:
    data = read_json(path)
    if isinstance(data, dict):
        for key in VOLATILE_KEYS:
            data.pop(key, None)
    return data


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors, by name, whatever the sharding."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is no dict)
                out[key] = f.get_tensor(key)
    return out


def _check_weights(export_dir: Path, regenerated: Path, step: int) -> Check:
    name = f"weights = checkpoint step {step}'s"
    try:
        got = _tensors(export_dir)
    except Exception as e:  # a damaged shard: safetensors' own error kinds
        return Check(name, FAIL, f"unreadable safetensors ({type(e).__name__}: {str(e)[:80]})")
    want = _tensors(regenerated)
    problems = [f"{k}: not in the export" for k in sorted(set(want) - set(got))]
    problems += [f"{k}: not in the checkpoint" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{k}: {a.dtype} {tuple(a.shape)}, the checkpoint's {b.dtype} {tuple(b.shape)}")
        elif not torch.equal(a, b):
            diff = float((a.float() - b.float()).abs().max())
            problems.append(f"{k}: values differ (max {diff:.3g})")
    shown = "; ".join(problems[:5]) + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else "")
    ok = f"{len(want)} tensors equal, exactly, to the checkpoint's cast as exported"
    return Check(name, FAIL if problems else PASS, shown or ok)


def _first_diff(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb), 1):
        if x != y:
            return f"line {i}: {x.strip()[:100]!r}, recomputed {y.strip()[:100]!r}"
    return f"{len(la)} lines, recomputed {len(lb)}"


def _key_diffs(got: Any, want: Any, where: str = "") -> list[str]:
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for k in sorted(set(got) | set(want), key=str):
            at = f"{where}.{k}" if where else str(k)
            if k not in got or k not in want:
                out.append(f"{at}: {'missing' if k not in got else 'not recomputed'}")
            else:
                out += _key_diffs(got[k], want[k], at)
        return out
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return [d for i, (x, y) in enumerate(zip(got, want)) for d in _key_diffs(x, y, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {str(got)[:60]}, recomputed {str(want)[:60]}"]


def _compare_files(export_dir: Path, regenerated: Path, names: list[str], check: str) -> Check:
    problems = []
    for n in names:
        mine, theirs = export_dir / n, regenerated / n
        if not theirs.exists():
            continue
        if not mine.is_file():
            problems.append(f"{n}: missing")
        elif n.endswith(".json"):
            try:
                diffs = _key_diffs(_json(mine), _json(theirs))
            except RunnerError as e:
                diffs = [f"unreadable ({e.detail})"]
            problems += [f"{n}: {d}" for d in diffs[:3]]
        elif mine.read_bytes() != theirs.read_bytes():
            problems.append(f"{n}: {_first_diff(mine.read_text(errors='replace'), theirs.read_text(errors='replace'))}")
    ok = f"{', '.join(n for n in names if (regenerated / n).exists())} as `runner export` writes them from the run"
    return Check(check, FAIL if problems else PASS, "; ".join(problems[:6]) or ok)


def _claimed(export_dir: Path) -> dict:
    try:
        record = read_json(export_dir / EXPORT_RECORD)
        if not isinstance(record, dict):
            raise RunnerError("not a JSON object", file=str(export_dir / EXPORT_RECORD))
        if not whole(record["step"]):
            raise ValueError(f"step {json.dumps(record['step'])[:40]} is not a whole number >= 0")
        if record.get("dtype") not in folder.DTYPES:
            raise KeyError("dtype")
        return record
    except (KeyError, TypeError, ValueError) as e:
        raise RunnerError(f"lacks a step or dtype ({e}): not an export", file=str(export_dir / EXPORT_RECORD)) from None


def _verification(record: dict) -> tuple[dict, str]:
    """export.json's verification figures, which the card states, and what is wrong with them ("" if
    nothing): figures of another type were a traceback re-rendering the card; they render as NaN (the
    card's check then names the line) beside a FAIL saying so."""
    v = record.get("verification")
    model = v.get("model") if isinstance(v, dict) else None
    keys = ("tolerance", "max_abs_logit_diff", "greedy_tokens_compared")
    if isinstance(v, dict) and isinstance(model, dict):
        figures = [model.get("tolerance"), model.get("max_abs_logit_diff")]
        if all(map(number, figures)) and whole(model.get("greedy_tokens_compared")):
            return v, ""
    shown = json.dumps({k: model.get(k) for k in keys} if isinstance(model, dict) else v, default=str)
    nan = float("nan")
    return {"model": {"tolerance": nan, "max_abs_logit_diff": nan, "greedy_tokens_compared": "?"}}, (
        "verification.model must hold the numbers tolerance and max_abs_logit_diff and the whole number "
        f"greedy_tokens_compared, got {shown[:120]}{' ...' if len(shown) > 120 else ''}"
    )


def _source(run_dir: Path, record: dict) -> Source:
    """The run opened under the path export.json names when it is the same folder (the card's audit
    command names it as given), else as given here."""
    named = Path(str(record.get("run_dir", "")))
    as_named = named if named.is_dir() and named.resolve() == Path(run_dir).resolve() else Path(run_dir)
    return open_source(as_named, int(record["step"]))


def _card_figures(src: Source, export_dir: Path) -> dict:
    """The figures `runner export` would put on the card now (the run audited now), with the audit's
    date as the card records it (a date is not a figure to recompute)."""
    figures = card.figures(src)
    try:
        claimed = read_json(export_dir / card.ACCOUNTING)
        figures["audit"]["date"] = claimed["audit"]["date"]
    except (RunnerError, KeyError, TypeError):
        pass
    return figures


def _with_export_scoring(figures: dict, src: Source, export_dir: Path, dtype: str, record: dict) -> None:
    """The folder's own scoring in the regenerated figures: the card's where a rescoring of the folder
    agrees with it (its t_eval is not a figure), else the rescoring's (the comparison then names it);
    none for an export written before folders were scored (export.json lists no files)."""
    downstream = figures.get("downstream")
    if downstream is None:
        return
    try:
        claimed = (read_json(export_dir / card.ACCOUNTING).get("downstream") or {}).get("export_scoring")
    except (RunnerError, AttributeError):
        claimed = None
    if claimed is None and "files" not in record:
        return
    with quiet_transformers():
        rescored = export_scoring.score_folder(src, export_dir, dtype)
    if rescored is not None:
        downstream["export_scoring"] = claimed if export_scoring.agrees(claimed, rescored) else rescored


def verify_export(export_dir: str | Path, run_dir: str | Path) -> list[Check]:
    """Every check of an exported folder against the run it came from (see the module docstring)."""
    export_dir, run_dir = Path(export_dir), Path(run_dir)
    if not export_dir.is_dir():
        raise RunnerError("no such folder", file=str(export_dir))
    checks = [check_recorded_files(export_dir, run_dir)]
    try:
        record = _claimed(export_dir)
        src = _source(run_dir, record)
    except (RunnerError, OSError) as e:  # OSError: a step of 400 digits is a file name too long
        if checks[0].status != FAIL:
            raise  # not an export, or its checkpoint is gone: nothing here says it was edited
        # export.json edited after the export (its recorded sha256 differs): the forgery it is, not exit 2
        said = str(e) if len(str(e)) <= 240 else str(e)[:240] + " ..."
        return [*checks, Check("export.json names the run's checkpoint", FAIL, said)]
    dtype, step = str(record["dtype"]), int(record["step"])
    tmp = Path(tempfile.mkdtemp(prefix=".verify-export-"))
    try:
        with quiet_transformers():
            folder.write_folder(src, dtype, tmp, max_shard_size=1 << 62)
        checks.append(_check_weights(export_dir, tmp, step))
        checks.append(
            _compare_files(
                export_dir,
                tmp,
                ["config.json", "generation_config.json"],
                "config = the run's model",
            )
        )
        tokenizer_files = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))
        tok = _compare_files(export_dir, tmp, tokenizer_files, "tokenizer = the run's pinned one")
        checks.append(tok)
        figures = _card_figures(src, export_dir)
        _with_export_scoring(figures, src, export_dir, dtype, record)
        verification, unreadable = _verification(record)
        if unreadable:
            checks.append(Check("export.json's verification figures", FAIL, unreadable))
        card.write(src, tmp, figures, dtype, verification)
        checks.append(
            _compare_files(export_dir, tmp, [card.ACCOUNTING], "accounting.json = the audited report's figures")
        )
        checks.append(_compare_files(export_dir, tmp, ["README.md"], "model card = the audited report's figures"))
        checks.append(_compare_files(export_dir, tmp, [card.EXPERIMENT], "experiment.yaml = the checkpoint's"))
        regenerated = {p.name for p in tmp.iterdir()} | {EXPORT_RECORD, "model.safetensors.index.json"}
        extra = sorted(
            p.name for p in export_dir.iterdir() if p.name not in regenerated and not p.name.endswith(".safetensors")
        )
        checks.append(
            Check(
                "no other files",
                FAIL if extra else PASS,
                f"not written by runner export: {', '.join(extra)}"
                if extra
                else "every file is one runner export writes",
            )
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return checks


def verdict(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else UNVERIFIED if UNVERIFIED in statuses else PASS


def render(export_dir: Path, run_dir: Path, checks: list[Check]) -> str:
    lines = [f"verify-export {display_path(export_dir)} against {display_path(run_dir)}"]
    lines += [f"  {c.line()}" for c in checks]
    lines.append(f"verdict: {verdict(checks)}")
    return "\n".join(lines)


# ---- a published card against the published report ------------------------------------------------

_DTYPE_LINE = re.compile(r"weights in (fp32|bf16)\.")


def check_published_card(card_dir: Path, reports_dir: Path) -> list[Check]:
    """A published card (reports/models/<name>/: README.md, accounting.json, experiment.yaml) against
    the published report of its run: accounting.json's figures recomputed from the report's tables, and
    README.md re-rendered from them (the audit and logit-check lines, which need the run, aside)."""
    card_dir, reports_dir = Path(card_dir), Path(reports_dir)
    name = "published card = the published report's figures"
    try:
        claimed = read_json(card_dir / card.ACCOUNTING)
        exp = load_saved_experiment(card_dir / card.EXPERIMENT)
        run_id, step = str(claimed["run_id"]), int(claimed["checkpoint"]["step"])
    except (RunnerError, KeyError, TypeError, ValueError) as e:
        return [Check(name, FAIL, f"unreadable card ({e})")]
    report = reports_dir / exp.config.name / run_id
    if not rpt.is_report_dir(report):
        return [Check(name, FAIL, f"no published report of run {run_id} at {display_path(report)}")]
    tables = rpt.read_tables(report)
    run = read_json(report / "run.json")
    src: Any = SimpleNamespace(  # the fields of a Source the card reads, from the published report
        exp=exp,
        step=step,
        final=bool(claimed["checkpoint"].get("final")),
        run=run,
        run_dir=Path(run_id),
        checkpoint=SimpleNamespace(path=Path(f"step-{step:07d}")),
    )
    if not src.final:
        return [Check(name, UNVERIFIED, "the card is of an earlier checkpoint: its figures need the run's checkpoint")]
    want = json.loads(json.dumps(card._finite(claimed), default=card._plain))
    summary = tables["run_summary"].iloc[0]
    accounting = [
        {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
        for row in tables["accounting"][["domain", *card.COUNTERS, "epochs", "realized_ratio"]].to_dict("records")
    ]
    for row in accounting:
        row["manifest_sha256"] = exp.config.data.manifests[row["domain"]].sha256
    val_step, validation = card._report_validation(tables)
    want.update(
        experiment={"name": exp.config.name, "version": exp.config.version, "fingerprint": exp.fingerprint},
        accounting=accounting,
        downstream=card_downstream.downstream_figures(exp.config, tables, step),
        compute=card._compute(src, summary),
    )
    if want["downstream"] is not None and (claimed.get("downstream") or {}).get("export_scoring"):
        # scored on the weights, which a published card does not carry: taken as the card states it
        want["downstream"]["export_scoring"] = claimed["downstream"]["export_scoring"]
    want["validation"] = {**want.get("validation", {}), "step": val_step, "domains": validation}
    want["checkpoint"] = {
        **want.get("checkpoint", {}),
        "exposure_tokens": sum(int(r["exposure_tokens"]) for r in accounting),
    }
    want = json.loads(json.dumps(card._finite(want), default=card._plain))
    diffs = _key_diffs(json.loads(json.dumps(card._finite(claimed), default=card._plain)), want)
    checks = [
        Check(
            name,
            FAIL if diffs else PASS,
            "; ".join(diffs[:6]) or f"accounting.json's figures are {display_path(report)}'s",
        )
    ]
    text = (card_dir / "README.md").read_text(errors="replace") if (card_dir / "README.md").is_file() else ""
    m = _DTYPE_LINE.search(text)
    if not m:
        return [*checks, Check("published card text", FAIL, "README.md names no weights dtype: not a runner card")]
    placeholder = {"model": {"tolerance": 0.0, "max_abs_logit_diff": 0.0, "greedy_tokens_compared": 0}}
    tmp = Path(tempfile.mkdtemp(prefix=".verify-card-"))
    try:
        card.write(src, tmp, want, m.group(1), placeholder)
        mine = [line for line in text.splitlines() if not line.startswith("- export verified:")]
        theirs = [
            line for line in (tmp / "README.md").read_text().splitlines() if not line.startswith("- export verified:")
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    same = mine == theirs
    checks.append(
        Check(
            "published card text",
            PASS if same else FAIL,
            "README.md is the card of those figures"
            if same
            else f"README.md {_first_diff(chr(10).join(mine), chr(10).join(theirs))}",
        )
    )
    return checks
