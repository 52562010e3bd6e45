"""Audit a run's report against what the report cannot rewrite, and say what could not be checked.

Owns: the named checks a report must pass before anyone believes or publishes it, run in order:
the tables against their schemas and SPEC's invariants; every mixture domain in every table; the
manifest copies against their sha256 pins in experiment.yaml; the fingerprint recomputed from
experiment.yaml against run.json and the summary; exposure, unique and the repetition histogram
recounted by replaying the sampler from the recipe's ratios and the manifests' sample counts;
params, FLOPs per token, the peak (a datasheet figure, or a CPU's cores x clock x FLOP/cycle
recomputed) and from them MFU, goodput MFU, HFU and cost; the CSV copies against the parquet
tables; a run folder's raw files and final checkpoint against its report; then, through
runner.reports.audit.tracked, the run's MLflow run (params, tags, every logged metric, the evidence
logged at the end) and, when asked, the validation loss recomputed from the final checkpoint
(runner.reports.audit.recompute_eval). A check that cannot run is UNVERIFIED (runner.reports.audit.result), never
a pass.
Never: edits a report or a run, trains, or raises for a discrepancy (discrepancies are results;
only unusable input raises RunnerError).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from safetensors.numpy import load_file

from runner import progress
from runner.config.load import experiment_from_dict
from runner.config.rules import devices
from runner.data.manifest import MIN_VALIDATION_SAMPLES, manifest_sha256, num_samples
from runner.data.sampler import MixtureSampler
from runner.errors import RunnerError
from runner.fsio import read_json, read_jsonl, read_yaml
from runner.reports import markdown, targets
from runner.reports import tables as rpt
from runner.reports.audit import downstream as downstream_audit
from runner.reports.audit import evidence as ev
from runner.reports.audit import tracked as audit_tracked
from runner.reports.audit.compute import check_compute
from runner.reports.audit.experts import check_expert_load, checkpoint_load_problems
from runner.reports.audit.input import AuditInput, Replay
from runner.reports.audit.result import FAIL, INFO, PASS, UNVERIFIED, AuditResult, Check, close, first_difference
from runner.reports.audit.routing import check_routing, checkpoint_bias_problems
from runner.reports.downstream import targets as downstream_targets
from runner.runs.checkpoints import dirname, verified_state
from runner.runs.folder import is_reportable_run
from runner.runs.recorded import conventions_of, devices_held, read_manifest_copies
from runner.runs.runjson import RunJson
from schemas.report_tables import (
    ADDED_SINCE,
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    SCHEMAS,
    UNREADABLE,
    validate_tables,
)

__all__ = ["FAIL", "INFO", "PASS", "UNVERIFIED", "AuditInput", "AuditResult", "Check", "audit", "load_input", "replay"]

CSV_REL_TOL = 1e-9  # a CSV float is the parquet value written as text: only parse noise is tolerated
HISTOGRAM_CAP = 255  # the ledger's per-sample counters saturate here


def load_input(target: str | Path) -> AuditInput:
    """A run folder (its report/ if written), a report folder, or an MLflow run id."""
    path = Path(target)
    if path.is_dir():
        if rpt.is_report_dir(path):
            inp = _from_report_dir(path)
            if path.name == rpt.REPORT_DIR and is_reportable_run(path.parent):
                _attach_run_dir(inp, path.parent)  # a run folder's own report: its raw files are next to it
            return inp
        if is_reportable_run(path):
            if rpt.is_report_dir(path / rpt.REPORT_DIR):
                found = _from_report_dir(path / rpt.REPORT_DIR)
                _attach_run_dir(found, path)
                return found
            run = _run_json(path)  # before build_tables reads it
            rebuilt = rpt.build_tables(path)
            cfg = _read_cfg(path / "experiment.yaml")
            exp = experiment_from_dict(cfg, path=path / "experiment.yaml")
            return AuditInput(
                str(path),
                rebuilt,
                cfg,
                run,
                read_manifest_copies(path / "manifests", sorted(exp.config.mixture.domains)),
                exp=exp,
                run_dir=path,
                cfg_file=path / "experiment.yaml",
            )
        raise RunnerError(
            "neither a run folder (run.json, ledger.json) nor a report folder (run_summary.parquet)", file=str(path)
        )
    if rpt.MLFLOW_RUN_ID.match(str(target)):
        dst = Path(tempfile.mkdtemp(prefix="runner-audit-"))
        return load_input(rpt.fetch_mlflow_run(str(target), dst))
    raise RunnerError("no such folder, and not an MLflow run id", file=str(target))


def _read_cfg(path: Path) -> dict:
    """experiment.yaml as saved: the plain resolved config (its sha256 and fingerprint are checked)."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise RunnerError("expected a mapping (the resolved experiment config)", file=str(path))
    return data


def _run_json(folder: Path) -> dict:
    """folder/run.json as read ({} where there is none); not a JSON object, or a key of another shape
    (`committed_steps: "x"`), is one line naming the file and key (RunJson.from_dict), never a traceback
    where a check reads it."""
    path = folder / "run.json"
    if not path.exists():
        return {}
    run = read_json(path)
    RunJson.from_dict(run, file=str(path))
    return run


def _attach_run_dir(inp: AuditInput, run_dir: Path) -> None:
    """The run folder a report was written from: its tables rebuilt from the raw files, its checkpoints."""
    _run_json(run_dir)  # its record read by the checks of the run folder (checkpoint, MLflow): checked here
    inp.run_dir = run_dir
    try:
        inp.rebuilt = rpt.build_tables(run_dir)
    except RunnerError as err:  # the report can still be audited; that comparison cannot
        inp.rebuild_error = str(err)


def _from_report_dir(path: Path) -> AuditInput:
    cfg_file = path / "experiment.yaml"
    cfg = _read_cfg(cfg_file)
    run = _run_json(path)
    exp = experiment_from_dict(cfg, path=cfg_file)
    return AuditInput(
        str(path),
        rpt.read_tables(path),
        cfg,
        run,
        read_manifest_copies(path / "manifests", sorted(exp.config.mixture.domains)),
        exp=exp,
        report_dir=path,
        cfg_file=cfg_file,
    )


# ---- replay -------------------------------------------------------------------------------------


def replay(
    samples: dict[str, int],
    ratios: dict[str, float],
    seed: int,
    global_batch_sequences: int,
    steps: int,
    snapshot_steps: set[int] | frozenset[int] = frozenset(),
) -> Replay:
    """Regenerate every committed step's (domain, sample) pairs and count them (SPEC invariant 6),
    keeping the per-domain counts after each step in `snapshot_steps` (MLflow logs counters there)."""
    sampler = MixtureSampler(samples, ratios, seed, global_batch_sequences)
    domains = list(sampler.domains)
    seen = {d: np.zeros(samples[d], dtype=np.int64) for d in domains}
    drawn = np.zeros(len(domains), dtype=np.int64)
    distinct = np.zeros(len(domains), dtype=np.int64)
    target = np.array([ratios[d] for d in domains], dtype=float)
    violations: list[str] = []
    snapshots: dict[int, dict[str, tuple[int, int]]] = {}
    for step in progress.on_terminal(range(steps), "audit: replay", "step"):
        domain_ids, sample_idx = sampler.step_arrays(step)
        for i, d in enumerate(domains):
            idx = sample_idx[domain_ids == i]
            distinct[i] += np.unique(idx[seen[d][idx] == 0]).size
            np.add.at(seen[d], idx, 1)
        drawn += np.bincount(domain_ids, minlength=len(domains))
        # In samples: |exposure_d - r_d * total| <= L  <=>  |n_d - r_d * n| <= 1.
        off = np.abs(drawn - target * drawn.sum())
        for j in np.nonzero(off > 1 + 1e-9)[0]:
            violations.append(
                f"step {step + 1}: {domains[j]} {drawn[j]} samples vs target {target[j] * drawn.sum():.2f}"
            )
        if step + 1 in snapshot_steps:
            snapshots[step + 1] = {d: (int(drawn[i]), int(distinct[i])) for i, d in enumerate(domains)}
    return Replay(domains, {d: int(seen[d].sum()) for d in domains}, seen, violations, snapshots)


def replay_input(inp: AuditInput, snapshot_steps: set[int] | frozenset[int] = frozenset()) -> Replay:
    """The replay of the run an audit input describes (RunnerError when the sampler refuses it)."""
    cfg = inp.config
    seq_len = cfg.train.seq_len
    mix = cfg.mixture.domains
    samples = {d: num_samples(int(inp.manifests[d]["pool_tokens"]), seq_len) for d in sorted(mix)}
    ratios = {d: mix[d].target_ratio for d in sorted(mix)}
    return replay(samples, ratios, cfg.seed, cfg.train.global_batch_sequences, inp.steps(), snapshot_steps)


# ---- the checks that need nothing but the report (and its run folder, when present) --------------


def _check_schemas(res: AuditResult, tables: dict[str, pd.DataFrame]) -> bool:
    summary = tables.get("run_summary")
    written = (
        sorted({str(v) for v in summary["schema_version"]})
        if summary is not None and "schema_version" in summary
        else ["none"]
    )
    if len(written) != 1 or written[0] not in READABLE_VERSIONS:  # recounting its columns would be guesswork
        res.add(
            "schema version",
            [
                f"report written under {', '.join(written)}, this runner audits {', '.join(READABLE_VERSIONS)}; "
                "rebuild it with `runner report RUN_DIR` (the run folder holds every input)"
            ],
        )
        return False
    if written[0] != SCHEMA_VERSION:  # checked as written; what it predates reads as its default
        added = "; ".join(
            f"{t}.{c} reads as {v!r}" for t, cols in ADDED_SINCE[written[0]].items() for c, v in cols.items()
        )
        res.info("schema version", f"written under {written[0]} (this runner writes {SCHEMA_VERSION}): {added}")
    failures = validate_tables(tables, written[0])
    for name in SCHEMAS:
        res.add(
            f"schema: {name}",
            [
                str(f)
                for f in failures
                if f.table == name and "sum of domains" not in f.check and not f.check.startswith("histogram")
            ],
        )
    stopped = [str(f) for f in failures if f.table == "report"]  # the cross-table sums could not be computed
    res.add("invariant 2: totals = sum of domains", [str(f) for f in failures if "sum of domains" in f.check] + stopped)
    res.add("histogram agrees with counters", [str(f) for f in failures if f.check.startswith("histogram")] + stopped)
    usable = all(n in tables for n in SCHEMAS) and len(tables["run_summary"]) == 1
    return usable


def validation_samples(inp: AuditInput) -> dict[str, int]:
    """Validation samples the trainer scores per domain (runner.training.evaluate): the first
    eval.samples_per_domain windows of each validation pool, clipped to what the manifest holds."""
    cfg = inp.config
    out = {}
    for d in sorted(cfg.mixture.domains):
        m = inp.manifests[d]
        tokens = sum(int(s.get("tokens", 0)) for s in m.get("validation_shards") or [])
        n = min(cfg.eval.samples_per_domain, num_samples(tokens, cfg.train.seq_len)) if tokens else 0
        if n > 0:
            out[d] = n
    return out


def _check_domains(res: AuditResult, inp: AuditInput) -> None:
    """Every mixture domain in every table: a domain dropped from a table is not a smaller run."""
    cfg, t = inp.config, inp.tables
    mix = set(cfg.mixture.domains)
    problems = []
    for name in ("accounting", "repetition"):
        got = set(t[name]["domain"])
        if got != mix:
            problems.append(f"{name}: domains {sorted(got)}, mixture {sorted(mix)}")
    val = t["validation"]
    scored = set(validation_samples(inp))
    step_tokens = cfg.train.global_batch_sequences * cfg.train.seq_len
    for step, rows in val.groupby("step"):
        if set(rows["domain"]) != scored:
            problems.append(
                f"validation at step {int(step)}: domains {sorted(set(rows['domain']))}, "
                f"domains with validation samples {sorted(scored)}"
            )
        wrong = sorted({int(x) for x in rows["exposure_tokens"]} - {int(step) * step_tokens})
        if wrong:
            problems.append(
                f"validation at step {int(step)}: exposure {wrong}, {int(step)} steps are {int(step) * step_tokens}"
            )
    status = str(t["run_summary"].iloc[0]["status"])
    if scored and status == "finished" and (val.empty or int(val["step"].max()) != inp.steps()):
        last = "none" if val.empty else int(val["step"].max())
        problems.append(f"last evaluation at step {last}, the finished run ends at step {inp.steps()}")
    res.add("every mixture domain in every table", problems, ok_detail=f"{len(mix)} domains")


def _check_manifests(res: AuditResult, inp: AuditInput) -> None:
    problems = []
    pins = inp.config.data.manifests
    for d, m in inp.manifests.items():
        recomputed = manifest_sha256(m)
        if recomputed != m.get("manifest_sha256"):
            problems.append(
                f"{d}: manifest content hashes to {recomputed[:12]}, says {str(m.get('manifest_sha256'))[:12]}"
            )
        want = pins[d].sha256 if d in pins else None
        if want is None:
            problems.append(f"{d}: experiment.yaml pins no manifest sha256 for it")
        elif want != m.get("manifest_sha256"):
            problems.append(f"{d}: experiment pins {want[:12]}, manifest is {str(m.get('manifest_sha256'))[:12]}")
    res.add("manifests match the experiment's pins", problems)


def _check_fingerprint(res: AuditResult, inp: AuditInput) -> None:
    """The fingerprint experiment.yaml resolves to, against every record of it the audit can see."""
    fp = inp.exp.fingerprint
    found = {"run_summary": str(inp.tables["run_summary"].iloc[0]["fingerprint"])}
    if inp.has_run_json:
        found["run.json"] = str(inp.record.fingerprint)
        segments = inp.record.segments
        if segments:
            found["run.json current segment"] = str(segments[-1].get("fingerprint"))
    if inp.run_dir is not None and (inp.run_dir / "fingerprint.txt").exists():
        found["fingerprint.txt"] = (inp.run_dir / "fingerprint.txt").read_text().strip()
    problems = [
        f"{where} says {value[:12]}, experiment.yaml resolves to {fp[:12]}"
        for where, value in found.items()
        if value != fp
    ]
    res.add("fingerprint recomputed from experiment.yaml", problems, ok_detail=f"{fp[:12]} = {', '.join(found)}")
    if not inp.has_run_json:
        res.could_not(
            "run.json",
            "missing: the fingerprint, committed steps, devices held and device-seconds it records, and the "
            "MLflow run it names, cannot be checked",
        )


def _check_config_agreement(res: AuditResult, inp: AuditInput) -> None:
    cfg = inp.config
    seq_len = cfg.train.seq_len
    acct, s = inp.tables["accounting"], inp.tables["run_summary"].iloc[0]
    mix = cfg.mixture.domains
    problems = []
    for r in acct.itertuples(index=False):
        if r.domain not in mix:
            continue
        samples = num_samples(int(inp.manifests[r.domain]["pool_tokens"]), seq_len)
        per_domain: dict[str, float] = {
            "samples": samples,
            "pool_tokens": samples * seq_len,
            "tail_tokens": max(int(inp.manifests[r.domain]["pool_tokens"]) - samples * seq_len - 1, 0),
            "target_ratio": mix[r.domain].target_ratio,
            "max_repetition_ratio": mix[r.domain].max_repetition_ratio,
        }
        for col, want in per_domain.items():
            if not close(getattr(r, col), want, 1e-12):
                problems.append(f"{r.domain}.{col} = {getattr(r, col)}, manifest/mixture say {want}")
    res.add("accounting matches manifests and mixture", problems)

    expect: dict[str, Any] = {
        "experiment": cfg.name,
        "version": str(cfg.version),
        "seq_len": seq_len,
        "global_batch_sequences": cfg.train.global_batch_sequences,
        "devices": devices_held(inp.run, inp.config),
        "price_per_device_hour": cfg.hardware.price_per_device_hour_usd or 0.0,
    }
    if inp.has_run_json:
        expect.update(
            {
                "steps": inp.steps(),
                "status": str(inp.record.status or "finished"),  # runs before run.json kept a status
                "run_id": str(inp.record.run_id or s["run_id"]),
            }
        )
        if "step_clock" in s:  # what timed the steps is what the run recorded (host before issue 28)
            expect["step_clock"] = conventions_of(inp.record, cfg).get("step_clock", "host")
    problems = [
        f"{k} = {s[k]!r}, run/config say {v!r}"
        for k, v in expect.items()
        if (not close(s[k], v, 1e-12) if isinstance(v, (int, float)) else str(s[k]) != str(v))
    ]
    res.add("summary matches experiment config", problems)

    # A launcher may start more processes than the recipe names (torchrun --nproc-per-node 2 on a
    # 1-device recipe): not an error, since MFU and cost are over what was held, but worth seeing.
    res.info("devices held vs recipe", f"held {devices_held(inp.run, inp.config)}, recipe {devices(inp.config)}")


def _check_replay(res: AuditResult, inp: AuditInput, rep: Replay) -> None:
    seq_len = inp.config.train.seq_len
    acct = inp.tables["accounting"].set_index("domain")
    hist = inp.tables["repetition"]
    exposure, unique, histo = [], [], []
    for d in rep.domains:
        want_exp = rep.exposure_samples[d] * seq_len
        want_unique = int((rep.seen[d] > 0).sum()) * seq_len
        if d not in acct.index:
            exposure.append(f"{d}: missing from accounting")
            continue
        got = acct.loc[d]
        if int(got["exposure_tokens"]) != want_exp:
            exposure.append(f"{d}: report {int(got['exposure_tokens'])}, replay {want_exp}")
        if int(got["unique_tokens"]) != want_unique:
            unique.append(f"{d}: report {int(got['unique_tokens'])}, replay {want_unique}")
        want_h: dict[int, int] = {}
        for k, n in rep.histogram(d).items():
            want_h[min(k, HISTOGRAM_CAP)] = want_h.get(min(k, HISTOGRAM_CAP), 0) + n
        g = hist[hist["domain"] == d]
        got_h = {int(k): int(n) for k, n in zip(g["times_seen"], g["samples"]) if int(n)}
        want_h = {k: n for k, n in want_h.items() if n}
        if got_h != want_h:
            histo.append(f"{d}: report {got_h}, replay {want_h}")
    res.add("replay: exposure per domain", exposure, ok_detail=f"{inp.steps()} steps regenerated")
    res.add("replay: unique per domain", unique)
    res.add("replay: repetition histogram", histo)
    res.add("replay: mixture exact at every step (invariant 5)", rep.mixture_violations)


def _check_rebuilt(res: AuditResult, inp: AuditInput) -> None:
    if inp.rebuild_error:
        res.could_not("report matches the run folder", f"the run folder cannot be rebuilt: {inp.rebuild_error}")
        return
    if inp.rebuilt is None:
        return
    problems = []
    version = rpt.written_version(inp.tables)
    for name in SCHEMAS:
        a = inp.tables[name].reset_index(drop=True)
        b = rpt._typed(name, inp.rebuilt[name]).reset_index(drop=True)
        if version != SCHEMA_VERSION and version in ADDED_SINCE:  # rebuilt as the older version wrote it
            b = b.drop(columns=[c for c in ADDED_SINCE[version].get(name, {}) if c in b])
            if "schema_version" in b:
                b["schema_version"] = version
        if name == "downstream":  # runner eval scorings made after the report are not in it yet
            b = downstream_audit.as_reported(a, b)
        try:
            pd.testing.assert_frame_equal(a, b, check_dtype=False, check_exact=False, rtol=1e-9)
        except AssertionError as err:
            problems.append(f"{name}: {str(err).splitlines()[0] if str(err) else 'differs'}")
    res.add("report matches the run folder", problems)


def _csv_cell_mismatch(csv: pd.Series, parquet: pd.Series) -> np.ndarray:
    """Per row: does the CSV text differ from the parquet value (typed by the parquet column)?"""
    text = csv.to_numpy(dtype=object)
    if pd.api.types.is_bool_dtype(parquet):
        return np.array([t != str(bool(v)) for t, v in zip(text, parquet)], dtype=bool)
    if pd.api.types.is_integer_dtype(parquet):

        def differs_int(t, v):
            try:
                return int(t) != int(v)
            except ValueError:
                return True

        return np.array([differs_int(t, v) for t, v in zip(text, parquet)], dtype=bool)
    if pd.api.types.is_float_dtype(parquet):

        def differs_float(t, v):
            try:
                a = float(t) if t != "" else math.nan  # pandas writes NaN as an empty field
            except ValueError:
                return True
            if math.isnan(a) or math.isnan(v):
                return not (math.isnan(a) and math.isnan(v))
            return not (a == v or abs(a - v) <= CSV_REL_TOL * max(abs(a), abs(v)))

        return np.array([differs_float(t, float(v)) for t, v in zip(text, parquet)], dtype=bool)
    return np.array([t != str(v) for t, v in zip(text, parquet)], dtype=bool)


def csv_differences(report_dir: Path, tables: dict[str, pd.DataFrame]) -> list[str]:
    """Where each table's CSV copy differs from its parquet table: one line per table, naming the
    first differing cell (row-major), or the columns or row count when those already differ."""
    problems = []
    predated = rpt.predated_tables(report_dir)
    for name in [n for n in SCHEMAS if n not in predated]:
        path = report_dir / f"{name}.csv"
        if not path.exists():
            problems.append(f"{name}: {name}.csv missing")
            continue
        try:
            csv = pd.read_csv(path, dtype=str, keep_default_na=False)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
            problems.append(f"{name}: {name}.csv unreadable ({type(err).__name__})")
            continue
        parquet = tables[name].reset_index(drop=True)
        if list(csv.columns) != list(parquet.columns):
            problems.append(f"{name}: csv columns {list(csv.columns)}, parquet {list(parquet.columns)}")
            continue
        if len(csv) != len(parquet):
            problems.append(f"{name}: csv has {len(csv)} rows, parquet {len(parquet)}")
            continue
        if not len(parquet):
            continue
        mismatch = np.column_stack([_csv_cell_mismatch(csv[c], parquet[c]) for c in parquet.columns])
        if mismatch.any():
            row, col = np.argwhere(mismatch)[0]  # argwhere is row-major: the first cell a reader meets
            value = parquet.iat[row, col]
            value = value.item() if isinstance(value, np.generic) else value  # 10240, not np.int64(10240)
            problems.append(f"{name}: row {row}, {parquet.columns[col]}: csv {csv.iat[row, col]!r}, parquet {value!r}")
    return problems


def _check_csv_copies(res: AuditResult, inp: AuditInput) -> None:
    name = "csv copies equal the parquet tables"
    if inp.report_dir is None:
        res.info(name, "no report folder: the tables were built from the run folder")
        return
    res.add(name, csv_differences(inp.report_dir, inp.tables), ok_detail=f"{len(SCHEMAS)} tables compared")


def _check_complete(res: AuditResult, inp: AuditInput) -> None:
    """Every file a report is written with (a killed writer or an edit can leave fewer); run.json and
    evidence.json are their own checks (UNVERIFIED when missing)."""
    if inp.report_dir is None:
        return
    missing = [
        f for f in rpt.missing_report_files(inp.report_dir, sorted(inp.config.mixture.domains)) if f != "run.json"
    ]
    res.add("report folder complete", [f"{', '.join(missing)} missing"] if missing else [])


def _check_report_md(res: AuditResult, inp: AuditInput) -> None:
    """report.md, what a reader opens first, against what this runner renders from the audited tables:
    an edit of its figures (MFU 19.4% made 59.4%) passed every check of the tables. Identical: PASS.
    Otherwise never PASS, never FAIL: an older runner wrote other words from the same tables, and only
    today's renderer is here to compare with."""
    name = "report.md = its tables"
    if inp.report_dir is None:
        res.info(name, "no report folder: the tables were built from the run folder")
        return
    md = inp.report_dir / "report.md"
    if not md.is_file():  # `report folder complete` names it
        return
    redo = "`runner report RUN_DIR` writes it again from the run"
    try:
        rendered = rpt.report_markdown(inp.report_dir, inp.tables)  # the report folder's tables, read once
    except Exception as err:  # tables the schemas passed that today's renderer still cannot word
        res.could_not(name, f"this runner cannot render these tables ({type(err).__name__}: {err}); {redo}")
        return
    written = md.read_text(encoding="utf-8", errors="replace")
    if rendered == written:
        res.add(name, [], ok_detail="rendered again from the tables: identical")
        return
    where = first_difference(written, rendered, "the tables render")
    res.could_not(name, f"{where}: an edit, or an older runner's wording; {redo}")


# the plots of tables already drawn in this process, by the sha256 of what they are drawn from: an audit
# of many reports of one run (audit-reports, a forgery's tables beside the clean ones) draws each once
_DRAWN: dict[str, dict[str, bytes]] = {}
_DRAWN_KEPT = 16


def _drawn_plots(tables: dict[str, pd.DataFrame], train: Path | None) -> dict[str, bytes]:
    """name -> PNG bytes of the report plots `tables` draw (and training.png of `train`, a train.jsonl)."""
    from runner.reports import curves  # noqa: PLC0415

    digest = hashlib.sha256(pickle.dumps(sorted(tables.items())))
    digest.update(train.read_bytes() if train is not None else b"")
    key = digest.hexdigest()
    if key not in _DRAWN:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), np.errstate(all="ignore"):
            # Tables under audit may be forged (a log axis of no positive value, an infinite bar): their
            # checks name what is wrong; matplotlib's warnings on drawing them are not the audit's output.
            warnings.simplefilter("ignore")
            paths = rpt.draw_plots(tables, Path(tmp))
            if train is not None:
                paths += [p for p in [curves.write_training_curves(read_jsonl(train), Path(tmp))] if p]
            while len(_DRAWN) >= _DRAWN_KEPT:
                _DRAWN.pop(next(iter(_DRAWN)))
            _DRAWN[key] = {p.name: p.read_bytes() for p in paths}
    return _DRAWN[key]


def _check_plots(res: AuditResult, inp: AuditInput) -> None:
    """The report's plots, what a reader sees beside report.md, drawn again from the audited tables: a
    loss_by_domain.png swapped for a better curve passed every check. Identical bytes: PASS; otherwise
    never PASS, never FAIL (another runner's or matplotlib's drawing of the same tables differs too).
    training.png is drawn from the run folder's train.jsonl: compared where the run folder is audited."""
    name = "plots = its tables"
    if inp.report_dir is None:
        res.info(name, "no report folder: the tables were built from the run folder")
        return
    import matplotlib  # noqa: PLC0415  (drawing imports it anyway; its version is named below)

    from runner.reports import curves  # noqa: PLC0415

    redo = "`runner report RUN_DIR` draws them again from the run"
    train = inp.run_dir / "metrics" / "train.jsonl" if inp.run_dir is not None else None
    if train is not None and not (train.is_file() and (inp.report_dir / curves.PLOT).is_file()):
        train = None
    try:
        drawn = _drawn_plots(inp.tables, train)
    except Exception as err:  # tables the schemas passed that today's plotting still cannot draw
        res.could_not(name, f"this runner cannot draw these tables ({type(err).__name__}: {err}); {redo}")
        return
    present = [n for n in drawn if (inp.report_dir / n).is_file()]  # a missing one: `report folder complete`
    differ = [f"{n} differs" for n in present if (inp.report_dir / n).read_bytes() != drawn[n]]
    if differ:
        res.could_not(
            name,
            f"{', '.join(differ)} from what the tables draw with matplotlib {matplotlib.__version__}: an edit, "
            f"or another runner's or matplotlib's drawing; {redo}",
        )
        return
    unchecked = (
        f"; {curves.PLOT} not checked (drawn from the run folder's train.jsonl, not in a report folder)"
        if curves.PLOT not in drawn and (inp.report_dir / curves.PLOT).is_file()
        else ""
    )
    res.add(name, [], ok_detail=f"{', '.join(present)} drawn again: identical{unchecked}")


def _check_evidence_file(res: AuditResult, inp: AuditInput) -> None:
    name = "evidence.json matches the report"
    if inp.report_dir is None:
        res.info(name, "no report folder: the tables were built from the run folder")
        return
    try:
        found = ev.read_evidence_file(inp.report_dir)
    except RunnerError as err:  # not valid JSON, another format, or a key of another shape: a forgery's or damage's
        res.add(name, [str(err)])
        return
    if found is None:  # never a PASS: a report without it was cut short, or written before evidence existed
        res.could_not(name, "no evidence.json next to the tables: rebuild the report (`runner report RUN_DIR`)")
        return
    problems = ev.evidence_differences(found, inp, checkpoint=True)
    if found.get("schema_version") != rpt.written_version(inp.tables):
        problems.append(
            f"evidence is for schema {found.get('schema_version')}, the tables are {rpt.written_version(inp.tables)}"
        )
    # Only a sloppy forgery fails here: the same hand can rewrite evidence.json. MLflow's copy is the proof.
    res.add(name, problems, ok_detail="tables, experiment.yaml and validation (the MLflow copy is the one that proves)")


def _check_checkpoint(res: AuditResult, inp: AuditInput) -> None:
    """A run folder's final checkpoint: it verifies, it was written under this fingerprint, and its
    ledger (per-sample counts, a record apart from ledger.json) recounts to the report."""
    name = "final checkpoint agrees with the report"
    if inp.run_dir is None:
        return
    step = inp.steps()
    folder = inp.run_dir / "checkpoints"
    if not any(folder.glob("step-*")):  # a fabricated or pruned run has none
        res.could_not(name, f"no checkpoint at the last committed step {step} in {folder}")
        return
    path = folder / dirname(step)
    if not path.exists():
        res.could_not(name, f"no checkpoint at the last committed step {step} in {folder}")
        return
    state, problem = verified_state(path)
    if state is None:
        res.add(name, [str(problem)])
        return
    problems = []
    if state.get("fingerprint") != inp.exp.fingerprint:
        problems.append(
            f"written under fingerprint {str(state.get('fingerprint'))[:12]}, not {inp.exp.fingerprint[:12]}"
        )
    ledger = load_file(str(path / "ledger.safetensors"))
    acct = inp.tables["accounting"].set_index("domain")
    seq_len = inp.config.train.seq_len
    for i, d in enumerate(sorted(inp.config.mixture.domains)):
        if d not in acct.index or f"seen.{d}" not in ledger:
            problems.append(f"{d}: not in both the report and the checkpoint's ledger")
            continue
        counts = {k: int(ledger[f"{k}.by_domain"][i]) for k in ("processed", "exposure", "useful", "unique")}
        counts["lost"] = counts["processed"] - counts["exposure"]
        for kind, got in counts.items():
            if got != int(acct.loc[d, f"{kind}_tokens"]):
                problems.append(f"{d}.{kind}: checkpoint ledger {got}, report {int(acct.loc[d, f'{kind}_tokens'])}")
        seen = ledger[f"seen.{d}"]
        if int((seen > 0).sum()) * seq_len != int(acct.loc[d, "unique_tokens"]):
            problems.append(f"{d}: checkpoint ledger has {int((seen > 0).sum())} samples seen")
    problems += checkpoint_load_problems(ledger, inp)
    problems += checkpoint_bias_problems(path, inp)
    res.add(name, problems, ok_detail=f"{path.name} verifies; its ledger (and expert load) recounts to the report")


def _check_targets(res: AuditResult, inp: AuditInput) -> None:
    """Time- and cost-to-target recounted from the evaluations and run.json (runner.reports.targets), and
    of downstream targets from the loop's scorings (runner.reports.downstream.targets)."""
    for name, problems, ok_detail in targets.audit_checks(inp.tables, inp.config, inp.run):
        res.add(name, problems, ok_detail=ok_detail)
    for name, problems, ok_detail in downstream_targets.audit_checks(inp.tables, inp.config, inp.run):
        res.add(name, problems, ok_detail=ok_detail)


def _check_downstream(res: AuditResult, inp: AuditInput) -> None:
    """A run's downstream figures recomputed from its per-request files (runner.reports.audit.downstream)."""
    for name, problems, detail in downstream_audit.audit_checks(inp.run_dir, inp.tables.get("downstream")):
        if problems is None:
            res.info(name, detail)
        else:
            res.add(name, problems, ok_detail=detail)


def _check_runner_eval_figures(res: AuditResult, inp: AuditInput, rescored: set[int] | None = None) -> None:
    """The report's `runner eval` figures not rescored (all but those of the steps in `rescored`):
    vouched for by MLflow's evidence (INFO), or UNVERIFIED naming --recompute-eval
    (runner.reports.audit.downstream.runner_eval_check)."""
    evidence = next((c.status for c in res.checks if c.name == audit_tracked.EVIDENCE), None)
    table = inp.tables.get("downstream")
    if table is not None and rescored:
        table = table[~((table["source"] == "runner eval") & table["step"].isin(sorted(rescored)))]
    found = downstream_audit.runner_eval_check(table, evidence == PASS)
    if found is not None:
        name, vouched, detail = found
        (res.info if vouched else res.could_not)(name, detail)


def audit_input(
    inp: AuditInput,
    *,
    check_mlflow: bool = True,
    tracking_uri: str | None = None,
    recompute_eval: bool = False,
    checkpoint: Path | None = None,
    progress=None,
) -> AuditResult:
    res = AuditResult(inp.source)
    if not _check_schemas(res, inp.tables):
        return res
    try:
        return _audit_checked_tables(res, inp, check_mlflow, tracking_uri, recompute_eval, checkpoint, progress)
    except UNREADABLE as err:
        if not res.failed():  # nothing explains it: unusable input (audit() says so in one line)
            raise
        # A table that fails its schema (a column dropped, text, null or infinity in a number's place) or a
        # manifest copy that fails its pin is read by the checks after it: what stopped them is the FAIL
        # above, not a report too broken to audit (exit 2).
        res.add(
            "checks after the schema",
            [f"stopped at {type(err).__name__}: {err}, reading input that FAILs above: {', '.join(res.failed())}"],
        )
        return res


def _audit_checked_tables(
    res: AuditResult,
    inp: AuditInput,
    check_mlflow: bool,
    tracking_uri: str | None,
    recompute_eval: bool,
    checkpoint: Path | None,
    progress,
) -> AuditResult:
    tracked, why = audit_tracked.locate(inp, enabled=check_mlflow, tracking_uri=tracking_uri)
    _check_manifests(res, inp)  # first: a forged manifest copy FAILs here before the checks that read it
    _check_domains(res, inp)
    _check_fingerprint(res, inp)
    _check_config_agreement(res, inp)
    try:
        rep = replay_input(inp, audit_tracked.replay_steps(tracked, inp.steps()))
    except RunnerError as err:
        res.add("replay: sampler", [f"sampler refused the recorded inputs: {err}"])
        rep = None
    if rep is not None:
        _check_replay(res, inp, rep)
    check_compute(res, inp)
    _check_targets(res, inp)
    _check_downstream(res, inp)
    check_expert_load(res, inp)
    check_routing(res, inp)
    _check_rebuilt(res, inp)
    _check_csv_copies(res, inp)
    _check_complete(res, inp)
    _check_report_md(res, inp)
    _check_plots(res, inp)
    _check_evidence_file(res, inp)
    _note_small_validation(res, inp)
    _check_checkpoint(res, inp)
    audit_tracked.check(res, inp, tracked, why, rep)
    rescored: set[int] = set()
    if recompute_eval:
        from runner.reports.audit.recompute_eval import check_recomputed_eval  # noqa: PLC0415  (imports torch)

        check_recomputed_eval(res, inp, checkpoint=checkpoint, progress=progress)
        from runner.reports.audit.recompute_downstream import check_recomputed_downstream  # noqa: PLC0415  (torch)

        rescored = check_recomputed_downstream(res, inp, progress=progress)
    # what was not rescored (a pruned checkpoint, no --recompute-eval) rests on MLflow's evidence
    _check_runner_eval_figures(res, inp, rescored)
    return res


def _note_small_validation(res: AuditResult, inp: AuditInput) -> None:
    """A note, never a failure: domains whose validation loss rests on too few samples."""
    asked = inp.config.eval.samples_per_domain
    if inp.tables["validation"].empty:  # a run stopped before its first evaluation: no domain was measured
        res.info("validation set sizes", "no evaluation was recorded: the sizes are not known from the report")
        return
    small = markdown.small_validation_sets(inp.tables["validation"], markdown.domains_of(inp.tables), asked)
    res.info("validation set sizes", "; ".join(small) or f"every domain >= {MIN_VALIDATION_SAMPLES} samples")


def audit(
    target: str | Path,
    *,
    check_mlflow: bool = True,
    tracking_uri: str | None = None,
    recompute_eval: bool = False,
    checkpoint: str | Path | None = None,
    progress=None,
) -> AuditResult:
    """Audit a run folder, report folder or MLflow run id; RunnerError only for unusable input."""
    inp = load_input(target)
    try:
        return audit_input(
            inp,
            check_mlflow=check_mlflow,
            tracking_uri=tracking_uri,
            recompute_eval=recompute_eval,
            checkpoint=Path(checkpoint) if checkpoint else None,
            progress=progress,
        )
    except UNREADABLE as err:  # nothing FAILed before it (audit_input): input no audit can read, exit 2
        raise RunnerError(f"unusable report or config: {type(err).__name__}: {err}", file=inp.source) from None
