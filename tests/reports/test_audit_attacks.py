"""Consistent forgeries of a published-style report: each FAILs (or is UNVERIFIED), never PASSes.

One real tiny run (3 domains, a theoretical CPU peak, MLflow on its SQLite store) is trained once per
module. Each attack edits a copy of its report folder the way a careful forger would: parquet and
CSV rewritten together, the fingerprint recomputed from the edited experiment.yaml into run.json and
the summary, evidence.json rewritten from the edited tables (`_reseal`), counters recounted with the
project's own replay where the mixture changes (`_recount`). The report copy lives outside its run
folder, as a published report does; its run.json still names the MLflow run.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from runfixtures import run_commands
from trainfixtures import launch, make_project

from runner.cli.report import register
from runner.config.load import experiment_from_dict
from runner.data.manifest import manifest_sha256, num_samples
from runner.errors import EXIT_DISCREPANCY, EXIT_OK, EXIT_UNVERIFIED, RunnerError
from runner.fsio import sha256_file
from runner.planning.flops import Convention, flops_per_token
from runner.reports import tables as rpt
from runner.reports.audit import evidence as ev
from runner.reports.audit.result import FAIL, PASS, UNVERIFIED
from runner.reports.audit.run import audit, replay
from runner.reports.audit.tracked import EVIDENCE, METRICS, PARAMS, TAGS
from runner.reports.publish import publish
from runner.reports.tables import _typed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS, L, B = 8, 16, 8
POOLS = {"a": (0.5, 4000, 400), "b": (0.25, 3000, 300), "c": (0.25, 3000, 0)}  # c: no validation split


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("attacks")
    # Logged every 3 steps of 8: MLflow's counters stop at step 6, the report's at 8.
    exp = make_project(
        root, steps=STEPS, eval_every=4, checkpoint_every=4, pools=POOLS, train_extra={"log_interval_steps": 3}
    )
    hw = root / "recipes" / "hardware" / "cpu.yaml"
    recipe = yaml.safe_load(hw.read_text())
    for key in ("peak_tflops", "peak_source"):
        recipe.pop(key)
    hw.write_text(yaml.safe_dump({**recipe, "cpu_peak": "theoretical"}))
    run = root / "runs" / "real"
    launch(root, exp, "--run-dir", run)
    return run


def _cli(argv):
    return run_commands(register, argv)


def _copy(run: Path, tmp_path: Path) -> Path:
    report = tmp_path / "published" / "report"
    shutil.copytree(run / "report", report)
    return report


# ---- a forger's tools ---------------------------------------------------------------------------


def _read(report: Path, name: str) -> pd.DataFrame:
    return pd.read_parquet(report / f"{name}.parquet")


def _write(report: Path, name: str, df: pd.DataFrame) -> None:
    df = _typed(name, df.reset_index(drop=True))
    df.to_parquet(report / f"{name}.parquet", index=False)
    df.to_csv(report / f"{name}.csv", index=False)


def _cfg(report: Path) -> dict:
    return yaml.safe_load((report / "experiment.yaml").read_text())


def _run_json(report: Path) -> dict:
    return json.loads((report / "run.json").read_text())


def _save_run_json(report: Path, info: dict) -> None:
    (report / "run.json").write_text(json.dumps(info, indent=1))


def _reseal(report: Path) -> None:
    """What a careful forger does last: the fingerprint of the edited experiment.yaml everywhere it is
    recorded, and evidence.json recomputed from the edited tables."""
    fp = experiment_from_dict(_cfg(report)).fingerprint
    info = _run_json(report)
    info["fingerprint"] = fp
    for seg in info["segments"]:
        seg["fingerprint"] = fp
    _save_run_json(report, info)
    s = _read(report, "run_summary")
    s["fingerprint"] = fp
    _write(report, "run_summary", s)
    found = json.loads((report / "evidence.json").read_text())
    tables = {n: _read(report, n) for n in found["tables"]}
    found["tables"] = {n: ev.table_sha256(n, df) for n, df in tables.items()}
    found["experiment_yaml_sha256"] = sha256_file(report / "experiment.yaml")
    found["validation"] = ev.final_validation(tables["validation"])
    found["record_figures_sha256"] = ev.record_figures_sha256(_run_json(report))
    (report / "evidence.json").write_text(json.dumps(found, indent=1))


def _recount(report: Path) -> None:
    """Accounting, histogram and totals recounted with the project's own replay from the edited
    experiment.yaml and manifest copies (this run lost no work and every target counted)."""
    cfg = _cfg(report)
    mix = cfg["mixture"]["domains"]
    manifests = {d: json.loads((report / "manifests" / f"{d}.json").read_text()) for d in sorted(mix)}
    samples = {d: num_samples(m["pool_tokens"], L) for d, m in manifests.items()}
    rep = replay(samples, {d: mix[d]["target_ratio"] for d in mix}, cfg["seed"], B, STEPS)
    total = sum(rep.exposure_samples.values()) * L
    rows, hist = [], []
    for d in sorted(mix):
        exposure, unique = rep.exposure_samples[d] * L, int((rep.seen[d] > 0).sum()) * L
        rows.append(
            {
                "domain": d,
                "target_ratio": mix[d]["target_ratio"],
                "realized_ratio": exposure / total,
                "pool_tokens": samples[d] * L,
                "processed_tokens": exposure,
                "exposure_tokens": exposure,
                "useful_tokens": exposure,
                "unique_tokens": unique,
                "lost_tokens": 0,
                "epochs": exposure / (samples[d] * L),
                "max_repetition_ratio": mix[d]["max_repetition_ratio"],
                "tail_tokens": max(manifests[d]["pool_tokens"] - samples[d] * L - 1, 0),
                "samples": samples[d],
            }
        )
        hist += [{"domain": d, "times_seen": k, "samples": n} for k, n in sorted(rep.histogram(d).items())]
    acct = pd.DataFrame(rows)
    _write(report, "accounting", acct)
    _write(report, "repetition", pd.DataFrame(hist))
    s = _read(report, "run_summary")
    for kind in ("pool", "processed", "exposure", "useful", "unique", "lost"):
        s[f"{kind}_tokens"] = int(acct[f"{kind}_tokens"].sum())
    _write(report, "run_summary", s)
    v = _read(report, "validation")
    _write(report, "validation", v[v["domain"].isin(list(mix))])


def _scale(report: Path, name: str, columns: dict[str, float]) -> None:
    df = _read(report, name)
    for col, factor in columns.items():
        df[col] = df[col] * factor
    _write(report, name, df)


def _edit_cfg(report: Path, edit) -> None:
    cfg = _cfg(report)
    edit(cfg)
    (report / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


# ---- the attacks --------------------------------------------------------------------------------


def validation_x08(report):
    _scale(report, "validation", {"loss_nats": 0.8, "bpb": 0.8})


def validation_domain_removed(report):
    v = _read(report, "validation")
    _write(report, "validation", v[v["domain"] != "b"])


def lr_x10(report):
    _edit_cfg(report, lambda c: c["optim"].update(lr=c["optim"]["lr"] * 10))


def mixture_forged(report):
    def edit(c):
        c["mixture"]["domains"]["a"]["target_ratio"] = 0.25
        c["mixture"]["domains"]["c"]["target_ratio"] = 0.5

    _edit_cfg(report, edit)
    _recount(report)


def domain_removed(report):
    def edit(c):
        del c["mixture"]["domains"]["c"], c["data"]["manifests"]["c"]
        c["mixture"]["domains"]["a"]["target_ratio"] = 2 / 3
        c["mixture"]["domains"]["b"]["target_ratio"] = 1 / 3

    _edit_cfg(report, edit)
    (report / "manifests" / "c.json").unlink()
    _recount(report)


def _halve_cpu_peak(report, source_edit):
    s = _read(report, "run_summary")
    peak, source = float(s["peak_tflops"].iloc[0]) / 2, source_edit(str(s["peak_source"].iloc[0]))
    s["peak_tflops"], s["peak_source"] = peak, source
    for col in ("mfu", "goodput_mfu"):
        s[col] *= 2
    _write(report, "run_summary", s)
    _scale(report, "throughput", {"mfu": 2, "goodput_mfu": 2})
    info = _run_json(report)
    for record in ("conventions", "conventions_goodput"):
        info[record].update(peak_tflops=peak, peak_source=source)
    info["mfu"], info["goodput_mfu"] = 2 * info["mfu"], 2 * info["goodput_mfu"]
    _save_run_json(report, info)


def cpu_peak_halved(report):
    # FLOP/cycle halved in the source too (AVX2's 32 claimed as AVX's 16, say): consistent with itself.
    def halve(src):
        return re.sub(r" x (\d+) fp32 FLOP/cycle", lambda m: f" x {int(m[1]) // 2} fp32 FLOP/cycle", src)

    _halve_cpu_peak(report, halve)


def cpu_peak_halved_source_as_written(report):
    _halve_cpu_peak(report, lambda src: src)


def exposure_moved(report):
    a = _read(report, "accounting").set_index("domain")
    for d, delta in (("a", L), ("b", -L)):
        for col in ("processed_tokens", "exposure_tokens", "useful_tokens"):
            a.loc[d, col] += delta
    a["realized_ratio"] = a["exposure_tokens"] / a["exposure_tokens"].sum()
    a["epochs"] = a["exposure_tokens"] / a["pool_tokens"]
    _write(report, "accounting", a.reset_index())


def useful_lowered(report):
    a = _read(report, "accounting")
    a.loc[a["domain"] == "a", "useful_tokens"] -= L
    _write(report, "accounting", a)
    s = _read(report, "run_summary")
    ratio = (s["useful_tokens"] - L) / s["useful_tokens"]
    s["useful_tokens"] -= L
    s["goodput_mfu"] *= ratio
    s["cost_per_billion_useful_tokens"] /= ratio
    _write(report, "run_summary", s)


def histogram_reshaped(report):
    # Two samples of a seen once become one never seen and one seen twice: exposure unchanged.
    h = _read(report, "repetition")
    a = h["domain"] == "a"
    h.loc[a & (h["times_seen"] == 1), "samples"] -= 2
    h = pd.concat([h, pd.DataFrame([{"domain": "a", "times_seen": 2, "samples": 1}])], ignore_index=True)
    h.loc[a & (h["times_seen"] == 0), "samples"] += 1
    _write(report, "repetition", h.sort_values(["domain", "times_seen"]))
    for name in ("accounting", "run_summary"):
        df = _read(report, name)
        rows = df["domain"] == "a" if name == "accounting" else slice(None)
        df.loc[rows, "unique_tokens"] -= L
        _write(report, name, df)


def step_time_halved(report):
    info = _run_json(report)
    for key in ("step_seconds_total", "device_step_seconds_total"):
        info[key] /= 2
    info["mfu"] *= 2
    _save_run_json(report, info)
    _scale(report, "run_summary", {"step_seconds_total": 0.5, "device_step_seconds": 0.5, "mfu": 2})


def manifest_copy_edited(report):
    path = report / "manifests" / "a.json"
    m = json.loads(path.read_text())
    m["pool_tokens"] += 20 * L
    m["shards"][0]["tokens"] += 20 * L
    m["manifest_sha256"] = manifest_sha256(m)
    path.write_text(json.dumps(m, indent=1))
    _edit_cfg(report, lambda c: c["data"]["manifests"]["a"].update(sha256=m["manifest_sha256"]))
    _recount(report)


def convention_6n(report):
    cfg = _cfg(report)
    s = _read(report, "run_summary")
    fpt = flops_per_token(experiment_from_dict(cfg).config, Convention(flops_formula="6N"), seq_len=L)
    ratio = fpt / float(s["flops_per_token"].iloc[0])
    s["flops_formula"], s["flops_per_token"] = "6N", fpt
    for col in ("mfu", "goodput_mfu"):
        s[col] *= ratio
    _write(report, "run_summary", s)
    _scale(report, "throughput", {"mfu": ratio, "goodput_mfu": ratio})
    info = _run_json(report)
    for record in ("conventions", "conventions_goodput"):
        info[record]["flops_formula"] = "6N"
    _save_run_json(report, info)


def wall_time_halved(report):
    info = _run_json(report)
    for key in ("wall_seconds", "device_wall_seconds"):
        info[key] /= 2
    _save_run_json(report, info)
    _scale(
        report,
        "run_summary",
        {"wall_seconds": 0.5, "device_wall_seconds": 0.5, "goodput_mfu": 2, "cost_per_billion_useful_tokens": 0.5},
    )


def price_cut(report):
    _edit_cfg(
        report,
        lambda c: c["hardware"].update(price_per_device_hour_usd=c["hardware"]["price_per_device_hour_usd"] / 10),
    )
    _scale(report, "run_summary", {"price_per_device_hour": 0.1, "cost_per_billion_useful_tokens": 0.1})


def throughput_inflated(report):
    _scale(report, "throughput", {"tokens_per_second": 1.5, "step_seconds": 1 / 1.5})


def run_relabelled(report):
    info = _run_json(report)
    info["run_id"] = "the-good-run"
    _save_run_json(report, info)
    s = _read(report, "run_summary")
    s["run_id"] = "the-good-run"
    _write(report, "run_summary", s)


def startup_shortened(report):
    # report.md's start-up and evaluation lines, from run.json's records: no table or MLflow metric states them
    info = _run_json(report)
    info["t_startup"]["seconds"] /= 10
    for attempt in info["t_startup"]["attempts"]:
        attempt["seconds"] /= 10
    info["t_eval"]["validation_seconds"] /= 10
    _save_run_json(report, info)


def run_json_removed(report):
    (report / "run.json").unlink()


def mlflow_run_unnamed(report):
    info = _run_json(report)
    info["mlflow"]["run_id"] = None
    _save_run_json(report, info)


ATTACKS = [
    # (attack, checks that must FAIL with the MLflow run at hand; empty: it must be UNVERIFIED)
    (validation_x08, {METRICS, EVIDENCE}),
    (validation_domain_removed, {"every mixture domain in every table", EVIDENCE}),
    (lr_x10, {PARAMS, TAGS, EVIDENCE}),
    (mixture_forged, {PARAMS, TAGS, METRICS, EVIDENCE}),
    (domain_removed, {PARAMS, TAGS, METRICS, EVIDENCE}),
    (cpu_peak_halved, {TAGS, METRICS, EVIDENCE}),
    (cpu_peak_halved_source_as_written, {"peak recomputed from cores x clock x FLOP/cycle"}),
    (exposure_moved, {"replay: exposure per domain", EVIDENCE}),
    (useful_lowered, {METRICS, EVIDENCE}),
    (histogram_reshaped, {"replay: repetition histogram", "replay: unique per domain"}),
    (step_time_halved, {METRICS, EVIDENCE}),
    (manifest_copy_edited, {PARAMS, TAGS, EVIDENCE}),
    (convention_6n, {TAGS, METRICS, EVIDENCE}),
    (wall_time_halved, {METRICS, EVIDENCE}),
    (price_cut, {PARAMS, TAGS, METRICS, EVIDENCE}),
    (throughput_inflated, {METRICS, EVIDENCE}),
    (run_relabelled, {TAGS}),
    (startup_shortened, {EVIDENCE}),
    (run_json_removed, set()),
    (mlflow_run_unnamed, set()),
]


def test_the_untouched_copy_passes_and_resealing_it_changes_nothing(real_run, tmp_path):
    report = _copy(real_run, tmp_path)
    _reseal(report)  # the forger's tools are faithful: whatever fails below, the edit made it fail
    result = audit(report)
    assert result.verdict == PASS, result.render()
    offline = audit(report, check_mlflow=False)
    assert offline.verdict == UNVERIFIED and offline.failed() == []


@pytest.mark.parametrize("attack,must_fail", ATTACKS, ids=[a.__name__ for a, _ in ATTACKS])
def test_consistent_forgery_never_passes(real_run, tmp_path, attack, must_fail):
    report = _copy(real_run, tmp_path)
    attack(report)
    if (report / "run.json").exists():
        _reseal(report)
    result = audit(report)
    if must_fail:
        assert result.verdict == FAIL and must_fail <= set(result.failed()), result.render()
    else:
        assert result.verdict == UNVERIFIED and result.failed() == [], result.render()
    assert audit(report, check_mlflow=False).verdict != PASS  # offline: at best UNVERIFIED


def test_an_edited_report_md_never_passes(real_run, tmp_path):
    """report.md, what a reader opens first, was never audited: its MFU line edited from the run's figure
    to 59.4% passed every check of the tables. Rendered again from the audited tables: identical is
    PASS; an edit is UNVERIFIED naming the line (an older runner's wording reads the same way), never
    FAIL. The shipped reports' report.md are this runner's rendering of their tables."""
    name = "report.md = its tables"
    report = _copy(real_run, tmp_path)
    clean = audit(report, check_mlflow=False)
    assert name not in clean.unverified() + clean.failed(), clean.render()
    assert re.search(r"report.md = its tables +PASS +rendered again from the tables: identical", clean.render())
    md = (report / "report.md").read_text()
    forged = re.sub(r"^- MFU [0-9.]+%", "- MFU 59.4%", md, count=1, flags=re.M)
    assert forged != md
    (report / "report.md").write_text(forged)
    result = audit(report, check_mlflow=False)
    assert name in result.unverified() and result.failed() == [], result.render()
    assert "reads '- MFU 59.4% (step time)" in result.render()
    # a report an older schema wrote (the shipped runner-report/3 one) renders with each newer column at
    # its meaning: its report.md, rendered again by this runner, is identical; edited, it is not
    shipped = tmp_path / "shipped"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", shipped)
    assert rpt.written_version(rpt.read_tables(shipped)) == "runner-report/3"
    older = audit(shipped, check_mlflow=False)
    assert name not in older.unverified() + older.failed(), older.render()
    (shipped / "report.md").write_text((shipped / "report.md").read_text().replace("- MFU 19.4%", "- MFU 59.4%"))
    assert name in audit(shipped, check_mlflow=False).unverified()


def test_a_swapped_plot_never_passes(real_run, tmp_path):
    """The plots, what a reader sees beside report.md, were never audited: loss_by_domain.png swapped for
    another picture (a better curve) passed every check. Drawn again from the audited tables: identical is
    PASS; a swapped one is UNVERIFIED naming the file (another matplotlib draws other bytes), never FAIL.
    training.png, drawn from the run folder's train.jsonl, is compared where the run folder is audited.
    The shipped reports' plots are this runner's drawing of their tables."""
    name = "plots = its tables"
    report = _copy(real_run, tmp_path)
    clean = audit(report, check_mlflow=False)
    assert name not in clean.unverified() + clean.failed(), clean.render()
    assert re.search(
        r"plots = its tables +PASS +loss_by_domain.png, mixture.png, .*drawn again: identical", clean.render()
    )
    assert "training.png not checked" in clean.render()  # a report folder alone: no train.jsonl to draw it from
    (report / "loss_by_domain.png").write_bytes((report / "mixture.png").read_bytes())
    result = audit(report, check_mlflow=False)
    assert name in result.unverified() and result.failed() == [], result.render()
    assert "loss_by_domain.png differs from what the tables draw with matplotlib" in result.render()
    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    assert name not in audit(run, check_mlflow=False).unverified()
    (run / "report" / "training.png").write_bytes((run / "report" / "mixture.png").read_bytes())
    assert "training.png differs" in audit(run, check_mlflow=False).render()
    shipped = tmp_path / "shipped"
    shutil.copytree(REPO / "reports" / "cpu-tiny-moe" / "20261201-crash-resume", shipped)  # its heat map too
    older = audit(shipped, check_mlflow=False)
    assert name not in older.unverified() + older.failed(), older.render()
    assert "throughput.png, expert_load_heatmap.png drawn again: identical" in older.render()


@pytest.mark.slow  # a report and three audits of a real run: ~7 s
def test_a_training_curve_redrawn_from_an_edited_train_jsonl_fails_against_mlflow(real_run, tmp_path):
    """metrics/train.jsonl's loss halved on every row and the report rebuilt (`runner report`): training.png,
    the curve report.md shows, drawn again from the same rows, was identical, and no table holds a step's loss,
    learning rate or gradient norm: the audit PASSed with MLflow at hand. The evidence logged at the run's end
    holds train.jsonl's sha256, and MLflow's loss, learning rate and gradient norm at each logged step are
    compared with the run folder's rows: both FAIL the edit."""
    run = tmp_path / "run"
    shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("lock"))
    clean = audit(run)
    assert clean.verdict == PASS, clean.render()
    assert re.search(r"MLflow evidence = the report +PASS +tables, .*, metrics/train\.jsonl", clean.render())
    train = run / "metrics" / "train.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    train.write_text("".join(json.dumps({**r, "loss": r["loss"] / 2}) + "\n" for r in rows))
    ev.write_report_with_evidence(run)  # what `runner report RUN` does: training.png and evidence.json redrawn
    result = audit(run)
    assert result.verdict == FAIL and set(result.failed()) == {METRICS, EVIDENCE}, result.render()
    assert "metrics/train.jsonl (the training curve's loss, learning rate, gradient norm and times): sha256" in (
        result.render()
    )
    # and at each step MLflow logged (every 3rd here): what vouches for an earlier segment's rows, which a
    # later segment's end hashes as they then were
    logged = [
        step for step in (3, 6) if f"loss at step {step}: MLflow {rows[step - 1]['loss']:.10g}" in result.render()
    ]
    assert logged == [3, 6], result.render()
    assert audit(run, check_mlflow=False).verdict != PASS  # offline: at best UNVERIFIED


def test_a_report_cut_short_never_passes(real_run, tmp_path):
    """Issue 27 item 6: a SIGKILLed `runner report` left a report without plots or evidence.json that
    PASSed and published. Missing evidence is UNVERIFIED, a missing plot or table FAILs."""
    report = _copy(real_run, tmp_path)
    (report / "evidence.json").unlink()
    result = audit(report)
    assert result.verdict == UNVERIFIED and result.failed() == [], result.render()
    assert result.unverified() == ["evidence.json matches the report"]
    (report / "throughput.png").unlink()
    (report / "report.md").unlink()
    result = audit(report)
    assert result.failed() == ["report folder complete"], result.render()
    assert "report.md, throughput.png missing" in result.render()


def test_a_report_writer_killed_midway_leaves_the_previous_report_whole(real_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    before = {p.relative_to(run): p.read_bytes() for p in (run / "report").rglob("*") if p.is_file()}

    def killed(tables, out):
        raise KeyboardInterrupt  # the writer dies after its tables, before its plots and evidence

    monkeypatch.setattr(rpt, "write_plots", killed)
    with pytest.raises(KeyboardInterrupt):
        ev.write_report_with_evidence(run)
    after = {p.relative_to(run): p.read_bytes() for p in (run / "report").rglob("*") if p.is_file()}
    assert after == before  # the old report, whole; the half-built one is beside it, hidden
    monkeypatch.undo()
    out, evidence = ev.write_report_with_evidence(run)  # the next writer clears what the killed one left
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".report")) == []
    assert json.loads((out / "evidence.json").read_text()) == evidence
    assert audit(out).verdict == PASS


def test_recompute_eval_fails_edited_losses_with_no_mlflow_at_hand(real_run, tmp_path, capsys):
    report = _copy(real_run, tmp_path)
    validation_x08(report)
    _reseal(report)
    checkpoint = real_run / "checkpoints" / f"step-{STEPS:07d}"
    result = audit(report, check_mlflow=False, recompute_eval=True, checkpoint=checkpoint)
    check = next(c for c in result.checks if c.name == "validation loss recomputed from the final checkpoint")
    assert check.status == FAIL and "a.loss_nats: report " in check.detail, check.detail
    # --checkpoint naming no checkpoint at all (the run folder itself): the check could not run, no FAIL
    genuine = _copy(real_run, tmp_path / "genuine")
    (tmp_path / "empty").mkdir()
    for wrong in (real_run, tmp_path / "empty"):
        result = audit(genuine, check_mlflow=False, recompute_eval=True, checkpoint=wrong)
        check = next(c for c in result.checks if c.name == "validation loss recomputed from the final checkpoint")
        assert (
            check.status == UNVERIFIED
            and check.detail == f"{wrong} is not a checkpoint folder (no state.json, no COMPLETE)"
        )
    # The genuine run: its losses are what its checkpoint scores, to the bit on this CPU.
    code = _cli(["audit", str(real_run), "--recompute-eval", "--require-verified"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "validation loss recomputed from the final checkpoint  PASS" in out


def test_every_logged_counter_is_compared_at_its_own_step(real_run, tmp_path):
    # A store whose history says something else at step 3 (an intermediate step no table holds):
    # the audit recounts it by replay and names it.
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlflow.db"
    shutil.copy(real_run.parent.parent / "mlflow.db", store)
    info = json.loads((real_run / "run.json").read_text())
    client = MlflowClient(f"sqlite:///{store}")
    client.log_metric(info["mlflow"]["run_id"], "tokens.a.exposure", 9_999, step=3)
    client.log_metric(info["mlflow"]["run_id"], "realized_ratio.c", 0.9, step=6)
    result = audit(real_run, tracking_uri=f"sqlite:///{store}")
    check = next(c for c in result.checks if c.name == METRICS)
    assert check.status == FAIL
    assert "tokens.a.exposure at step 3: MLflow " in check.detail and "9999" in check.detail
    assert "realized_ratio.c at step 6: MLflow " in check.detail
    genuine = next(c for c in audit(real_run).checks if c.name == METRICS)
    assert genuine.status == PASS and "at steps the report does not state" in genuine.detail


def test_published_report_is_verified_where_its_store_is_and_unverified_elsewhere(real_run, tmp_path, capsys):
    reports = tmp_path / "reports"
    dest, result = publish(real_run, reports, require_verified=True)
    assert dest is not None and result.passed, result.render()
    assert (dest / "evidence.json").exists()
    store = Path(json.loads((real_run / "run.json").read_text())["mlflow"]["tracking_uri"][len("sqlite:///") :])
    # The published run.json names the store relative to the project (no machine paths); these
    # reports sit outside it, so the store is given.
    assert _cli(["audit-reports", str(reports), "--tracking-uri", f"sqlite:///{store}"]) == EXIT_OK
    # Elsewhere (CI): run.json names a store that is not there. Consistent, never PASS.
    info = json.loads((dest / "run.json").read_text())
    moved = tmp_path / "moved.db"
    info["mlflow"]["tracking_uri"] = f"sqlite:///{tmp_path / 'nowhere' / 'mlflow.db'}"
    (dest / "run.json").write_text(json.dumps(info, indent=1))
    capsys.readouterr()
    assert _cli(["audit-reports", str(reports)]) == EXIT_UNVERIFIED
    out = capsys.readouterr().out
    assert "UNVERIFIED" in out and "not verified: MLflow run reachable" in out
    assert _cli(["audit-reports", str(reports), "--require-verified"]) == EXIT_DISCREPANCY
    # Given the store that holds the run, the same published folder is verified.
    shutil.copy(store, moved)
    assert _cli(["audit-reports", str(reports), "--tracking-uri", f"sqlite:///{moved}"]) == EXIT_OK


def test_a_report_published_in_its_project_finds_the_store_its_run_json_names_relative(real_run, tmp_path):
    project = tmp_path / "checkout"
    shutil.copytree(real_run.parents[1], project, ignore=shutil.ignore_patterns("reports"))
    run = project / "runs" / real_run.name
    dest, result = publish(run, project / "reports")
    assert json.loads((dest / "run.json").read_text())["mlflow"]["tracking_uri"] == "sqlite:///mlflow.db"
    # resolved against the checkout that holds the report, not the current folder
    assert audit(dest).verdict == PASS
    (project / "mlflow.db").unlink()
    again = audit(dest)
    assert again.verdict == UNVERIFIED and not (project / "mlflow.db").exists()


def test_a_report_the_run_went_on_from_is_unverified_not_failed(real_run, tmp_path):
    # Published, then the run was extended: MLflow now describes a later state. The old report is
    # consistent up to its own last step but its run's record no longer vouches for it.
    root = tmp_path / "later"
    shutil.copytree(real_run.parent.parent, root)
    run = root / "runs" / "real"
    info = json.loads((run / "run.json").read_text())
    info["mlflow"]["tracking_uri"] = f"sqlite:///{root / 'mlflow.db'}"
    (run / "run.json").write_text(json.dumps(info, indent=1))
    published = _copy(run, tmp_path)
    launch(root, run, "--extend-to", (STEPS + 2) * B * L)
    result = audit(published, tracking_uri=info["mlflow"]["tracking_uri"])  # the copy's store
    assert result.verdict == UNVERIFIED and result.failed() == [], result.render()
    assert {TAGS, METRICS, EVIDENCE} <= set(result.unverified())
    assert "this report ends at step 8" in next(c.detail for c in result.checks if c.name == METRICS)
    extended = audit(run)
    assert extended.verdict == PASS, extended.render()


def test_what_runner_sync_sends_after_the_fact_never_passes(real_run, tmp_path):
    """A forger keeps MLflow away while the run trains (a dead or blocked server: every entry waits in
    journal/mlflow-pending.jsonl), rewrites the journal with the run folder, then `runner sync`s: MLflow,
    the record the audit trusts, then holds the forgery, and the audit PASSed it. What reached MLflow
    from an earlier process's journal is told in a `runner.replayed.*` tag, and every check it bears on
    is UNVERIFIED, never PASS, saying so; a figure that still disagrees FAILs as before."""
    from trackingfixtures import free_port

    from runner.cli import main

    root = real_run.parents[1]
    exp = next(p for p in (root / "experiments").glob("*.yaml"))
    run = root / "runs" / "offline"
    launch(root, exp, "--run-dir", run, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}")
    forged = tmp_path / "forged"
    shutil.copytree(run, forged)
    assert main(["sync", str(run), "--tracking-uri", f"sqlite:///{tmp_path / 'a.db'}"]) == 0
    result = audit(run)
    assert result.verdict == UNVERIFIED and result.failed() == [], result.render()
    assert sorted(result.unverified()) == sorted([PARAMS, TAGS, METRICS, EVIDENCE]), result.render()
    assert "reached MLflow from the run folder's journal after the process that journaled them had ended" in (
        result.render()
    )
    assert "(runner sync)" in result.render()
    journal = forged / "journal" / "mlflow-pending.jsonl"
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    for e in entries:  # only the journal: the folder's figures left as they are, so they disagree
        if e.get("kind") == "metrics":
            e["metrics"] = {k: v * 0.8 if k.startswith("val_loss.") else v for k, v in e["metrics"].items()}
    journal.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert main(["sync", str(forged), "--tracking-uri", f"sqlite:///{tmp_path / 'b.db'}"]) == 0
    assert METRICS in audit(forged).failed()


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        "[1]",
        '{"kinds": 5}',
        '{"kinds": {"start": "x"}}',
        '{"kinds": {"metrics": 1}, "metric_rows": -3}',
        '{"kinds": {"metrics": 1}, "metric_rows": 2, "steps": ["a", 1]}',
    ],
)
def test_an_unreadable_replay_tag_is_read_as_the_worst_it_could_say(value):
    """A replay tag the tracker did not write (edited in the store) was a ValueError or AttributeError
    traceback in the audit, or, as a list, said nothing: it now reads as the run itself arriving late."""
    from runner.reports.audit.result import AuditResult, Check
    from runner.reports.audit.tracked import Tracked, _late_entries

    res = AuditResult("run", [Check(name, PASS, "") for name in (PARAMS, TAGS, METRICS, EVIDENCE, "other")])
    _late_entries(res, Tracked("uri", "id", "name", {}, {"runner.replayed.abc": value}))
    assert [c.status for c in res.checks] == [UNVERIFIED] * 4 + [PASS]
    assert res.checks[0].detail.startswith("the MLflow run itself reached MLflow from the run folder's journal")
    assert "(an unreadable replay tag)" in res.checks[0].detail


@pytest.mark.parametrize(
    "how",
    [
        "a column dropped",
        "text in a number's place",
        "the domain column dropped",
        "infinity in a count",
        "infinite steps",
        "validation tokens null",
    ],
)
def test_a_table_failing_its_schema_fails_the_audit_not_as_an_unusable_report(tmp_path, capsys, how):
    """A published report whose accounting table lost its target_ratio column (or holds text there)
    failed its schema check, then a later check read the column: AttributeError, and the audit as a
    whole was 'error: unusable report or config' (exit 2), no verdict. It is a FAIL (exit 1) naming
    both the schema check and where the checks after it stopped. The schema check's own cross-table
    sums read the same columns: without `domain` (AttributeError) or with an infinite pool_tokens
    (OverflowError, a raw traceback) they stopped the audit too; they FAIL as not computable. An
    infinite run_summary.steps, or a validation table without its token counts (ZeroDivisionError),
    stopped the checks after the schema with a traceback."""
    from runner.cli import main

    copy = tmp_path / "report"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", copy)
    name = {"infinite steps": "run_summary", "validation tokens null": "validation"}.get(how, "accounting")
    table = pd.read_parquet(copy / f"{name}.parquet")
    if how == "a column dropped":
        table = table.drop(columns=["target_ratio"])
    elif how == "the domain column dropped":
        table = table.drop(columns=["domain"])
    elif how == "infinity in a count":
        table = table.assign(pool_tokens=[float("inf")] + list(table["pool_tokens"].iloc[1:]))
    elif how == "infinite steps":
        table = table.assign(steps=float("inf"))
    elif how == "validation tokens null":
        table = table.assign(tokens=None)
    else:
        table = table.assign(target_ratio=table["target_ratio"].map(lambda v: f"{v:.0%}"))
    table.to_parquet(copy / f"{name}.parquet", index=False)
    result = audit(copy, check_mlflow=False)
    statuses = {c.name: c.status for c in result.checks}
    assert result.verdict == FAIL and statuses[f"schema: {name}"] == FAIL, result.render()
    if how in ("infinite steps", "validation tokens null"):
        assert statuses["checks after the schema"] == FAIL, result.render()
    if how in ("the domain column dropped", "infinity in a count"):  # said where it stopped, not a silent PASS
        sums = [
            c
            for c in result.checks
            if c.name in ("invariant 2: totals = sum of domains", "histogram agrees with counters")
        ]
        assert [c.status for c in sums] == [FAIL, FAIL] and all("cross-table sums computable" in c.detail for c in sums)
    assert main(["audit", str(copy), "--no-mlflow"]) == EXIT_DISCREPANCY
    assert "error:" not in capsys.readouterr().err


@pytest.mark.parametrize("how", ["a count null", "an infinite ratio", "negative histogram samples"])
def test_a_forged_table_is_audited_and_compared_without_warnings_on_stderr(tmp_path, capsys, how):
    """A null count made pandera's comparisons print numpy's `RuntimeWarning: invalid value encountered
    in less` (and the source line) to stderr, three times, before the audit's verdict and before compare's
    one error line; redrawing an infinite ratio or negated histogram counts to compare the plots printed
    matplotlib's warnings. The checks say what is wrong; stderr holds nothing else."""
    import warnings

    from runner.cli import main

    copy = tmp_path / "report"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", copy)
    name = "repetition" if how == "negative histogram samples" else "accounting"
    table = pd.read_parquet(copy / f"{name}.parquet")
    if how == "a count null":
        table = table.assign(pool_tokens=None)
    elif how == "an infinite ratio":
        table = table.assign(target_ratio=[float("inf")] + list(table["target_ratio"].iloc[1:]))
    else:
        table = table.assign(samples=-table["samples"])
    table.to_parquet(copy / f"{name}.parquet", index=False)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["audit", str(copy), "--no-mlflow"]) == EXIT_DISCREPANCY
        compared = main(["compare", str(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume"), str(copy), "--json"])
    shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in seen]
    assert not [w for w in seen if issubclass(w.category, (RuntimeWarning, UserWarning))], shown
    err = capsys.readouterr().err.strip().splitlines()
    assert compared == 2 and len(err) == 1 and err[0].startswith(f"error: {copy}: its tables fail their schemas"), err


@pytest.mark.parametrize(
    "file, key, value, says",
    [
        ("run.json", "committed_steps", "x", 'committed_steps: must be a whole number, got "x"'),
        ("run.json", "segments", {"a": 1}, 'segments: must be a list of JSON objects, got {"a": 1}'),
        ("evidence.json", "tables", -1, "tables: must map each table to its sha256"),
        ("evidence.json", "tables", [1], "tables: must map each table to its sha256"),
        ("evidence.json", "checkpoint", 5, "checkpoint: must be a JSON object or null"),
        ("evidence.json", "train_jsonl_sha256", 5, "train_jsonl_sha256: must be a sha256 (text) or null"),
        ("evidence.json", "record_figures_sha256", [1], "record_figures_sha256: must be a sha256 (text) or null"),
    ],
)
def test_a_record_key_of_another_shape_is_named_not_a_traceback(tmp_path, capsys, file, key, value, says):
    """A report's run.json or evidence.json with a key of another type (a forgery's or damage's) was a
    TypeError traceback (evidence.json's tables: -1) or 'unusable report or config: AttributeError ...'
    naming no key. run.json, which every check reads, is one line naming the file and key (exit 2);
    evidence.json, one check's input, FAILs that check naming the key (exit 1)."""
    from runner.cli import main

    copy = tmp_path / "report"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", copy)
    data = json.loads((copy / file).read_text())
    (copy / file).write_text(json.dumps(data | {key: value}))
    code = main(["audit", str(copy), "--no-mlflow"])
    out, err = capsys.readouterr()
    if file == "run.json":
        assert code == 2 and err.strip() == f"error: {copy / file}: {says}", err
    else:
        assert code == EXIT_DISCREPANCY and "Traceback" not in err, err
        line = next(l for l in out.splitlines() if l.startswith("evidence.json matches the report"))
        assert " FAIL " in line and says in line, out


def test_a_manifest_copy_of_another_shape_fails_its_pin_check_not_as_an_unusable_report(tmp_path, capsys):
    """A report's manifests/code.json with `validation_shards: "x"` was read by the domain check before
    the pin check: 'unusable report or config: AttributeError' (exit 2). The pin check runs first and
    FAILs it; the checks after it stop, saying so (exit 1)."""
    from runner.cli import main

    copy = tmp_path / "report"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", copy)
    manifest = copy / "manifests" / "code.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"validation_shards": "x"}))
    result = audit(copy, check_mlflow=False)
    statuses = {c.name: c.status for c in result.checks}
    assert statuses["manifests match the experiment's pins"] == FAIL, result.render()
    assert statuses["checks after the schema"] == FAIL, result.render()
    assert main(["audit", str(copy), "--no-mlflow"]) == EXIT_DISCREPANCY
    assert "error:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "where, value, says",
    [
        (("optim", "betas"), {"a": 1}, "optim.betas: does not fit this runner's experiment schema: Cannot merge"),
        (("eval", "targets", "code-6p2", "loss_nats"), None, "eval.targets.code-6p2: give exactly one of loss_nats"),
    ],
)
def test_a_saved_config_the_runner_cannot_read_is_one_line_naming_its_key(tmp_path, capsys, where, value, says):
    """A report's (or run folder's) experiment.yaml with a mapping where betas' list belongs was an
    OmegaConf TypeError traceback, and a validation target with no threshold a StopIteration traceback
    (every reader of a target takes its one metric). Each is one line naming the file and key (exit 2),
    as any other config that does not fit the schema is. (A fuzz of every key of the published
    cpu-tiny report's experiment.yaml set to 7 bad values, 910 audits, found these two.)"""
    from runner.cli import main

    copy = tmp_path / "report"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", copy)
    doc = yaml.safe_load((copy / "experiment.yaml").read_text())
    node = doc
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    (copy / "experiment.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    assert main(["audit", str(copy), "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {copy / 'experiment.yaml'}: {says}") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "file, where, value, says",
    [
        ("ledger.json", ("counters", "a", "exposure"), "x", "ledger.json: counters.a.exposure: must be a whole number"),
        ("ledger.json", ("histogram", "b", "1"), -3, "ledger.json: histogram.b.1: must be a whole number >= 0"),
        ("metrics/eval.jsonl", "samples", None, "eval.jsonl: samples: line 1: must be a whole number >= 0, got null"),
        ("metrics/train.jsonl", "step_seconds", [1], "train.jsonl: step_seconds: line 1: must be a number, got [1]"),
        ("metrics/eval.jsonl", "step", "<delete>", "eval.jsonl: step: line 1: missing"),  # was a KeyError
        # slow: each a whole audit (~2 s), as the fast subset's 2 minutes allow
        pytest.param(
            "metrics/eval.jsonl",
            "loss_nats",
            "<delete>",
            "eval.jsonl: loss_nats: line 1: missing",  # a KeyError too
            marks=pytest.mark.slow,
        ),
        # beyond int64: pandas' OverflowError traceback in runner report
        pytest.param(
            "metrics/eval.jsonl",
            "tokens",
            10**30,
            "eval.jsonl: tokens: line 1: must be a whole number >= 0 up to 2**63 - 1",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "metrics/train.jsonl",
            "tokens_useful",
            2**63,
            "train.jsonl: tokens_useful: line 1: must be a whole number >= 0 up",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_run_folders_raw_record_of_another_shape_is_named_not_a_traceback(
    real_run, tmp_path, file, where, value, says
):
    """A run folder's ledger.json or metrics rows with a count of another type (text, null, a list) were a
    ValueError / TypeError traceback in `runner report` and in the audit of the run folder (a fuzz of
    every ledger key and every field of the last train and eval rows, 7 bad values each: 195 of 406
    audits). They are one line naming the file, key and line (`runner plan --calibrate` and `runner fit`
    read the rows through the same check); the audit says the run folder cannot be
    rebuilt (UNVERIFIED, never PASS) and audits the report as it is."""
    run = tmp_path / "run"
    shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("lock"))
    path = run / file
    if file == "ledger.json":
        doc = json.loads(path.read_text())
        doc[where[0]][where[1]][where[2]] = value
        path.write_text(json.dumps(doc))
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if value == "<delete>":
            del rows[0][where]
        else:
            rows[0][where] = value
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RunnerError, match=re.escape(says)):
        rpt.build_tables(run)
    if file != "ledger.json":  # the planner's calibration and the scaling fit read the same rows
        from runner.config.load import load_saved_experiment
        from runner.reports.planning_inputs import read_calibration, read_point

        with pytest.raises(RunnerError, match=re.escape(says)):
            if file == "metrics/train.jsonl":
                read_calibration(run, load_saved_experiment(run / "experiment.yaml").config)
            else:
                read_point(run)
    result = audit(run, check_mlflow=False)
    check = next(c for c in result.checks if c.name == "report matches the run folder")
    assert check.status == UNVERIFIED and says in check.detail, check.detail
    assert result.verdict != PASS


@pytest.mark.slow  # a report and an audit of a real run: ~4 s
def test_a_train_row_without_a_throughput_figure_or_with_an_undrawable_curve_is_not_a_traceback(
    real_run, tmp_path, capsys
):
    """A train.jsonl row without step_seconds, tokens_per_second, mfu or goodput_mfu was a KeyError
    traceback in `runner report`; a loss or learning rate of 1e308 matplotlib's OverflowError drawing
    training.png. The first is one line naming file, field and line; the second a report without the
    curve, said in one warning (the audit's redraw leaves it out alike)."""
    from runner.cli import main

    run = tmp_path / "run"
    shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("lock"))
    train = run / "metrics/train.jsonl"
    honest = train.read_text()
    rows = [json.loads(line) for line in honest.splitlines()]
    for field in ("step_seconds", "tokens_per_second", "mfu", "goodput_mfu"):
        train.write_text(
            "".join(json.dumps({k: v for k, v in r.items() if k != field or r is not rows[1]}) + "\n" for r in rows)
        )
        with pytest.raises(RunnerError, match=re.escape(f"train.jsonl: {field}: line 2: missing")):
            rpt.build_tables(run)
    rows[1]["lr"] = 1e308
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["report", str(run)]) == EXIT_OK
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("runner report: ")]
    assert len(err) == 1 and err[0].startswith("warning: training.png not drawn: matplotlib cannot draw"), err
    assert not (run / "report/training.png").exists() and "training.png" not in (run / "report/report.md").read_text()
    plots = next(c for c in audit(run, check_mlflow=False).checks if c.name == "plots = its tables")
    assert plots.status == PASS and "training.png" not in plots.detail, plots
    assert capsys.readouterr().err == ""  # the audit's redraw says nothing


def test_a_mixture_of_experts_raw_record_of_another_shape_is_named_not_a_traceback(tmp_path):
    """A mixture of experts' run folder: a router figure of another type in train.jsonl (null, text)
    was a float() traceback in `runner report` and the audit; a count of 1e308 in expert_load.json an
    OverflowError traceback (a fuzz of expert_load.json's keys and the router fields, 180 audits).
    Each is one line naming the file (and the field and line)."""
    from runner.runs.recorded import TRAIN_FIELDS, checked_rows
    from runner.training.expert_load import ExpertLoad, read_expert_load

    for field in (
        "router_aux_loss",
        "router_z_loss",
        "expert_load_imbalance",
        "expert_load_cv",
        "expert_idle_capacity",
    ):
        with pytest.raises(RunnerError, match=f"{field}: line 2: must be a number, got null"):
            checked_rows([{"step": 1, field: 0.5}, {"step": 2, field: None}], TRAIN_FIELDS, tmp_path / "train.jsonl")
    load = ExpertLoad(["a"], 1, 2, 1)
    load.write_json(tmp_path, 3)
    assert read_expert_load(tmp_path / "expert_load.json")[1] == 3
    doc = json.loads((tmp_path / "expert_load.json").read_text())
    doc["routed_tokens"]["a"] = 1e308
    (tmp_path / "expert_load.json").write_text(json.dumps(doc))
    with pytest.raises(RunnerError, match="expert_load.json: not an expert load record: .*too large"):
        read_expert_load(tmp_path / "expert_load.json")
    doc["routed_tokens"]["a"] = [[1, 2]]
    doc["experts_per_token"] = 1e308  # was read as it is, and the expert table built from it failed to cast
    (tmp_path / "expert_load.json").write_text(json.dumps(doc))
    with pytest.raises(RunnerError, match="experts_per_token: must be a whole number, got 1e"):
        read_expert_load(tmp_path / "expert_load.json")
