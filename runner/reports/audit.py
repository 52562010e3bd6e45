"""Audit a run's report against its own inputs: schemas, invariants, sampler replay, FLOPs and MFU.

Owns: the named checks a report must pass before anyone believes or publishes it. Every figure is
recounted from what the run was given, independently of what it logged: exposure, unique and the
repetition histogram by replaying the sampler (experiment.yaml + manifests' sample counts);
params and FLOPs per token from the model config; MFU, goodput MFU and cost from the recorded
convention, times, the devices the run held (run.json) and the device peak table; the CSV copies
of a report folder against its parquet tables (publish ships both); and, when the MLflow run is
reachable, its final metrics against the report.
Never: edits a report or a run, trains, or raises for a discrepancy (discrepancies are results;
only unusable input raises RunnerError).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from runner.config.rules import devices
from runner.data.manifest import manifest_sha256, num_samples
from runner.errors import RunnerError
from runner.fsio import read_json
from runner.planning.flops import Convention, flops_per_token, params_of_config
from runner.reports import tables as rpt
from runner.reports.expert_audit import check_expert_load
from schemas.report_tables import SCHEMA_VERSION, SCHEMAS, validate_tables

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
INFO = "INFO"  # a fact a reader should see next to the checks; never fails
REL_TOL = 1e-6
CSV_REL_TOL = 1e-9  # a CSV float is the parquet value written as text: only parse noise is tolerated


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


@dataclass
class AuditResult:
    source: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == FAIL]

    def add(self, name: str, problems: list[str], *, ok_detail: str = "") -> None:
        status = FAIL if problems else PASS
        self.checks.append(
            Check(
                name,
                status,
                "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
                if problems
                else ok_detail,
            )
        )

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "passed": self.passed, "checks": [asdict(c) for c in self.checks]}

    def render(self) -> str:
        width = max((len(c.name) for c in self.checks), default=5)
        lines = [f"audit of {self.source}", f"{'check':<{width}}  result  detail"]
        lines += [f"{c.name:<{width}}  {c.status:<6}  {c.detail}" for c in self.checks]
        lines.append(
            f"{'PASS' if self.passed else 'FAIL'}: {sum(c.status == PASS for c in self.checks)} passed, "
            f"{sum(c.status == FAIL for c in self.checks)} failed, "
            f"{sum(c.status == SKIP for c in self.checks)} skipped, "
            f"{sum(c.status == INFO for c in self.checks)} informational"
        )
        return "\n".join(lines)


@dataclass
class AuditInput:
    """What an audit reads: the report tables and the inputs needed to recount them."""

    source: str
    tables: dict[str, pd.DataFrame]
    cfg: dict
    run: dict
    manifests: dict[str, dict]
    rebuilt: dict[str, pd.DataFrame] | None = None  # tables rebuilt from a run folder's raw files
    report_dir: Path | None = None  # the report folder the tables were read from (holds the CSV copies)


def load_input(target: str | Path) -> AuditInput:
    """A run folder (its report/ if written), a report folder, or an MLflow run id."""
    path = Path(target)
    if path.is_dir():
        if rpt.is_report_dir(path):
            return _from_report_dir(path)
        if rpt.is_run_dir(path):
            rebuilt = rpt.build_tables(path)
            if rpt.is_report_dir(path / rpt.REPORT_DIR):
                found = _from_report_dir(path / rpt.REPORT_DIR)
                found.rebuilt = rebuilt
                return found
            cfg = rpt.read_experiment_yaml(path / "experiment.yaml")
            return AuditInput(
                str(path),
                rebuilt,
                cfg,
                read_json(path / "run.json"),
                rpt.load_manifests(path / "manifests", sorted(cfg["mixture"]["domains"])),
            )
        raise RunnerError(
            "neither a run folder (run.json, ledger.json) nor a report folder (run_summary.parquet)", file=str(path)
        )
    if rpt.MLFLOW_RUN_ID.match(str(target)):
        dst = Path(tempfile.mkdtemp(prefix="runner-audit-"))
        return load_input(rpt.fetch_mlflow_run(str(target), dst))
    raise RunnerError("no such folder, and not an MLflow run id", file=str(target))


def _from_report_dir(path: Path) -> AuditInput:
    cfg = rpt.read_experiment_yaml(path / "experiment.yaml")
    run = read_json(path / "run.json") if (path / "run.json").exists() else {}
    domains = sorted(rpt._get(cfg, "mixture.domains", str(path / "experiment.yaml")))
    return AuditInput(
        str(path), rpt.read_tables(path), cfg, run, rpt.load_manifests(path / "manifests", domains), report_dir=path
    )


# ---- replay -------------------------------------------------------------------------------------


@dataclass
class Replay:
    """Recount of the committed steps from the sampler alone."""

    domains: list[str]
    exposure_samples: dict[str, int]
    seen: dict[str, np.ndarray]  # times each sample was drawn
    mixture_violations: list[str]  # invariant 5 at every step

    def histogram(self, d: str) -> dict[int, int]:
        values, counts = np.unique(self.seen[d], return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}


def replay(
    samples: dict[str, int], ratios: dict[str, float], seed: int, global_batch_sequences: int, steps: int
) -> Replay:
    """Regenerate every committed step's (domain, sample) pairs and count them (SPEC invariant 6)."""
    from runner.data.sampler import MixtureSampler

    sampler = MixtureSampler(samples, ratios, seed, global_batch_sequences)
    domains = list(sampler.domains)
    seen = {d: np.zeros(samples[d], dtype=np.int64) for d in domains}
    drawn = np.zeros(len(domains), dtype=np.int64)
    target = np.array([ratios[d] for d in domains], dtype=float)
    violations: list[str] = []
    for step in range(steps):
        domain_ids, sample_idx = sampler.step_arrays(step)
        for i, d in enumerate(domains):
            np.add.at(seen[d], sample_idx[domain_ids == i], 1)
        drawn += np.bincount(domain_ids, minlength=len(domains))
        # In samples: |exposure_d - r_d * total| <= L  <=>  |n_d - r_d * n| <= 1.
        off = np.abs(drawn - target * drawn.sum())
        for i in np.nonzero(off > 1 + 1e-9)[0]:
            violations.append(
                f"step {step + 1}: {domains[i]} {drawn[i]} samples vs target {target[i] * drawn.sum():.2f}"
            )
    return Replay(domains, {d: int(seen[d].sum()) for d in domains}, seen, violations)


# ---- the checks ---------------------------------------------------------------------------------


def _close(a: float, b: float, rel: float = REL_TOL) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-12)


def _check_schemas(res: AuditResult, tables: dict[str, pd.DataFrame]) -> bool:
    summary = tables.get("run_summary")
    written = (
        sorted({str(v) for v in summary["schema_version"]})
        if summary is not None and "schema_version" in summary
        else ["none"]
    )
    if written != [SCHEMA_VERSION]:  # an older runner's report: recounting its columns would be guesswork
        res.add(
            "schema version",
            [
                f"report written under {', '.join(written)}, this runner audits {SCHEMA_VERSION}; "
                "rebuild it with `runner report RUN_DIR` (the run folder holds every input)"
            ],
        )
        return False
    failures = validate_tables(tables)
    for name in SCHEMAS:
        res.add(
            f"schema: {name}",
            [
                str(f)
                for f in failures
                if f.table == name and "sum of domains" not in f.check and not f.check.startswith("histogram")
            ],
        )
    res.add("invariant 2: totals = sum of domains", [str(f) for f in failures if "sum of domains" in f.check])
    res.add("histogram agrees with counters", [str(f) for f in failures if f.check.startswith("histogram")])
    usable = all(n in tables for n in SCHEMAS) and len(tables["run_summary"]) == 1
    return usable


def _check_manifests(res: AuditResult, inp: AuditInput) -> None:
    problems = []
    pinned = (inp.cfg.get("data") or {}).get("manifests") or {}
    for d, m in inp.manifests.items():
        recomputed = manifest_sha256(m)
        if recomputed != m.get("manifest_sha256"):
            problems.append(
                f"{d}: manifest content hashes to {recomputed[:12]}, says {str(m.get('manifest_sha256'))[:12]}"
            )
        want = (pinned.get(d) or {}).get("sha256")
        if want is not None and want != m.get("manifest_sha256"):
            problems.append(f"{d}: experiment pins {want[:12]}, manifest is {str(m.get('manifest_sha256'))[:12]}")
    res.add("manifests match the experiment's pins", problems)


def _check_config_agreement(res: AuditResult, inp: AuditInput, seq_len: int) -> None:
    acct, s = inp.tables["accounting"], inp.tables["run_summary"].iloc[0]
    mix = inp.cfg["mixture"]["domains"]
    problems = []
    if sorted(acct["domain"]) != sorted(mix):
        problems.append(f"domains {sorted(acct['domain'])} != mixture {sorted(mix)}")
    for r in acct.itertuples(index=False):
        if r.domain not in mix:
            continue
        samples = num_samples(int(inp.manifests[r.domain]["pool_tokens"]), seq_len)
        expect = {
            "samples": samples,
            "pool_tokens": samples * seq_len,
            "tail_tokens": max(int(inp.manifests[r.domain]["pool_tokens"]) - samples * seq_len - 1, 0),
            "target_ratio": float(mix[r.domain]["target_ratio"]),
            "max_repetition_ratio": float(mix[r.domain].get("max_repetition_ratio", 1.0)),
        }
        for col, want in expect.items():
            if not _close(getattr(r, col), want, 1e-12):
                problems.append(f"{r.domain}.{col} = {getattr(r, col)}, manifest/mixture say {want}")
    res.add("accounting matches manifests and mixture", problems)

    hw = inp.cfg.get("hardware") or {}
    train = inp.cfg["train"]
    expect = {
        "experiment": inp.cfg.get("name"),
        "version": str(inp.cfg.get("version")),
        "seq_len": int(train["seq_len"]),
        "global_batch_sequences": int(train["global_batch_sequences"]),
        "devices": rpt.devices_held(inp.run, inp.cfg),
        "price_per_device_hour": float(hw.get("price_per_device_hour_usd") or 0.0),
    }
    if inp.run.get("fingerprint"):
        expect["fingerprint"] = inp.run["fingerprint"]
    problems = [
        f"{k} = {s[k]!r}, run/config say {v!r}"
        for k, v in expect.items()
        if (not _close(s[k], v, 1e-12) if isinstance(v, (int, float)) else str(s[k]) != str(v))
    ]
    res.add("summary matches experiment config", problems)

    # A launcher may start more processes than the recipe names (torchrun --nproc-per-node 2 on a
    # 1-device recipe): not an error, since MFU and cost are over what was held, but worth seeing.
    res.checks.append(
        Check("devices held vs recipe", INFO, f"held {rpt.devices_held(inp.run, inp.cfg)}, recipe {devices(inp.cfg)}")
    )


def _check_replay(res: AuditResult, inp: AuditInput, seq_len: int) -> None:
    s = inp.tables["run_summary"].iloc[0]
    acct = inp.tables["accounting"].set_index("domain")
    hist = inp.tables["repetition"]
    mix = inp.cfg["mixture"]["domains"]
    domains = sorted(mix)
    samples = {d: num_samples(int(inp.manifests[d]["pool_tokens"]), seq_len) for d in domains}
    ratios = {d: float(mix[d]["target_ratio"]) for d in domains}
    try:
        rep = replay(
            samples, ratios, int(inp.cfg["seed"]), int(inp.cfg["train"]["global_batch_sequences"]), int(s["steps"])
        )
    except RunnerError as err:
        res.add("replay: sampler", [f"sampler refused the recorded inputs: {err}"])
        return
    exposure, unique, histo = [], [], []
    for d in domains:
        want_exp = rep.exposure_samples[d] * seq_len
        want_unique = int((rep.seen[d] > 0).sum()) * seq_len
        got = acct.loc[d] if d in acct.index else None
        if got is None:
            exposure.append(f"{d}: missing from accounting")
            continue
        if int(got["exposure_tokens"]) != want_exp:
            exposure.append(f"{d}: report {int(got['exposure_tokens'])}, replay {want_exp}")
        if int(got["unique_tokens"]) != want_unique:
            unique.append(f"{d}: report {int(got['unique_tokens'])}, replay {want_unique}")
        # The ledger's counters saturate at 255, so the replay is clipped the same way.
        want_h = {}
        for k, n in rep.histogram(d).items():
            want_h[min(k, 255)] = want_h.get(min(k, 255), 0) + n
        g = hist[hist["domain"] == d]
        got_h = {int(k): int(n) for k, n in zip(g["times_seen"], g["samples"]) if int(n)}
        want_h = {k: n for k, n in want_h.items() if n}
        if got_h != want_h:
            histo.append(f"{d}: report {got_h}, replay {want_h}")
    res.add("replay: exposure per domain", exposure, ok_detail=f"{int(s['steps'])} steps regenerated")
    res.add("replay: unique per domain", unique)
    res.add("replay: repetition histogram", histo)
    res.add("replay: mixture exact at every step (invariant 5)", rep.mixture_violations)


def _dense_peak(inp: AuditInput, device_name: str) -> tuple[float | None, str]:
    from runner.planning.hardware import PEAKS, canonical_device

    key = canonical_device(device_name)
    if key is not None:
        return PEAKS[key].dense_bf16_tflops, f"{key} dense bf16 from the peak table"
    stated = (inp.cfg.get("hardware") or {}).get("peak_tflops")
    if stated is not None:
        return float(stated), "stated in the hardware recipe (device not in the table)"
    return None, "not in the table and not stated in the recipe"


def _check_compute(res: AuditResult, inp: AuditInput, seq_len: int) -> None:
    s = inp.tables["run_summary"].iloc[0]
    conv = Convention.from_dict(
        {k: s[k] for k in ("flops_formula", "params_counted", "attention_causal_half", "recompute_counted")}
    )
    n_params = params_of_config(inp.cfg).get(conv.params_counted)
    fpt = flops_per_token(inp.cfg, conv, seq_len=seq_len)
    problems = []
    if int(s["params"]) != n_params:
        problems.append(f"params = {int(s['params'])}, model config gives {n_params} ({conv.params_counted})")
    if not _close(s["flops_per_token"], fpt):
        problems.append(
            f"flops_per_token = {s['flops_per_token']:.6g}, model config gives {fpt:.6g} ({conv.flops_formula})"
        )
    res.add("params and FLOPs per token from the model config", problems)

    recorded = float(s["peak_tflops"])
    dense, where = _dense_peak(inp, str(s["device_name"]))
    problems = []
    source = str(s["peak_source"])
    measured = source.startswith("measured")
    # A device without a datasheet row (a CPU) may carry a peak derived on the machine that ran:
    # cores x clock x FLOP/cycle (runner.planning.hardware's "theoretical: ...") or a timed matmul
    # ("measured: ..."). The audit may run elsewhere, so it cannot rederive it; it takes the record.
    derived = measured or (dense is None and source.startswith("theoretical"))
    if dense is None and not derived:
        problems.append(f"device {s['device_name']!r}: {where}")
    elif dense is not None and not measured:
        if _close(recorded, 2 * dense):
            problems.append(
                f"peak {recorded} TFLOP/s is the sparse figure of {s['device_name']} "
                f"(dense {dense}); sparse peaks are never a denominator"
            )
        elif not _close(recorded, dense):
            problems.append(f"peak {recorded} TFLOP/s is not the dense peak {dense} of {s['device_name']} ({where})")
    res.add(
        "peak is the device's dense peak",
        problems,
        ok_detail=f"{recorded} TFLOP/s ({source.split(':')[0] if derived else where})",
    )

    peak = (dense if dense is not None and not measured else recorded) * 1e12
    # The devices the run held, from run.json, not the summary's own column: the recount must not
    # trust the figure it is checking.
    # Device-seconds likewise from run.json (each attempt with the devices it held).
    device_wall, device_step = rpt.device_seconds(
        inp.run, inp.cfg, float(s["wall_seconds"]), float(s["step_seconds_total"])
    )
    want = {
        "device_wall_seconds": device_wall,
        "device_step_seconds": device_step,
        "mfu": fpt * int(s["processed_tokens"]) / (device_step * peak),
        "goodput_mfu": fpt * int(s["useful_tokens"]) / (device_wall * peak),
        "hfu": rpt.hfu_flops_per_token_or_nan(inp.cfg, conv, seq_len)
        * int(s["processed_tokens"])
        / (device_step * peak),
        "cost_per_billion_useful_tokens": float(s["price_per_device_hour"])
        * device_wall
        / 3600.0
        / (int(s["useful_tokens"]) / 1e9)
        if int(s["useful_tokens"])
        else 0.0,
    }
    for key, value in want.items():
        ok = _close(s[key], value) or (math.isnan(float(s[key])) and math.isnan(value))  # hfu: both empty
        res.add(
            f"{key} recomputed",
            [] if ok else [f"report {float(s[key]):.6g}, recomputed {value:.6g}"],
            ok_detail=f"{value:.6g}",
        )


def _check_rebuilt(res: AuditResult, inp: AuditInput) -> None:
    if inp.rebuilt is None:
        return
    problems = []
    for name in SCHEMAS:
        a = inp.tables[name].reset_index(drop=True)
        b = rpt._typed(name, inp.rebuilt[name]).reset_index(drop=True)
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
    for name in SCHEMAS:
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
        res.checks.append(Check(name, SKIP, "no report folder (tables built from the run folder)"))
        return
    res.add(name, csv_differences(inp.report_dir, inp.tables), ok_detail=f"{len(SCHEMAS)} tables compared")


def _check_mlflow(res: AuditResult, inp: AuditInput) -> None:
    ml = inp.run.get("mlflow") or {}
    uri, run_id = ml.get("tracking_uri"), ml.get("run_id")
    name = "MLflow final metrics agree"
    if not uri or not run_id:
        res.checks.append(Check(name, SKIP, "run.json names no MLflow run"))
        return
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    try:
        from mlflow.tracking import MlflowClient

        metrics = MlflowClient(tracking_uri=uri).get_run(run_id).data.metrics
    except Exception as err:  # unreachable server, missing run, bad URI: the check cannot run
        res.checks.append(Check(name, SKIP, f"unreachable ({type(err).__name__})"))
        return
    s = inp.tables["run_summary"].iloc[0]
    losses = rpt.final_losses(inp.tables["validation"])
    compared, problems = 0, []
    for key, value in metrics.items():
        leaf = key.rsplit("/", 1)[-1]
        want = None
        if (
            leaf in s.index
            and isinstance(s[leaf], (int, float, np.integer, np.floating))
            and not isinstance(s[leaf], (bool, np.bool_))
            and leaf not in ("mfu", "goodput_mfu", "hfu")
        ):
            want = float(s[leaf])
        elif leaf == "loss_nats":
            dom = [d for d in losses if f"/{d}/" in f"/{key}/"]
            want = losses[dom[0]] if dom else None
        if want is None:
            continue
        compared += 1
        if not _close(value, want, 1e-6):
            problems.append(f"{key}: MLflow {value:.6g}, report {want:.6g}")
    if not compared:
        res.checks.append(Check(name, SKIP, "no MLflow metric shares a name with the report"))
        return
    res.add(name, problems, ok_detail=f"{compared} metrics compared")


def audit_input(inp: AuditInput, *, check_mlflow: bool = True) -> AuditResult:
    res = AuditResult(inp.source)
    if not _check_schemas(res, inp.tables):
        return res
    seq_len = int(inp.cfg["train"]["seq_len"])
    _check_manifests(res, inp)
    _check_config_agreement(res, inp, seq_len)
    _check_replay(res, inp, seq_len)
    _check_compute(res, inp, seq_len)
    check_expert_load(res, inp)
    _check_rebuilt(res, inp)
    _check_csv_copies(res, inp)
    if check_mlflow:
        _check_mlflow(res, inp)
    return res


def audit(target: str | Path, *, check_mlflow: bool = True) -> AuditResult:
    """Audit a run folder, report folder or MLflow run id; RunnerError only for unusable input."""
    inp = load_input(target)
    try:
        return audit_input(inp, check_mlflow=check_mlflow)
    except (KeyError, TypeError, ValueError) as err:
        raise RunnerError(f"unusable report or config: {type(err).__name__}: {err}", file=inp.source) from None
