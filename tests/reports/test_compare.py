"""`runner compare`: runs side by side from run folders, report folders and MLflow run ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml
from runfixtures import make_run

from runner.config.fingerprint import fingerprint
from runner.fsio import read_jsonl
from runner.reports.audit.run import audit
from runner.reports.tables import read_tables, write_report

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "reports" / "comparisons" / "cpu-tiny-lr"


@dataclass
class Out:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture()
def cli(capsys):
    """`runner ARGS` in this process (as the CLI's main runs it), with what it printed."""
    from runner.cli import main

    def run(*args) -> Out:
        code = main([str(a) for a in args])
        printed = capsys.readouterr()
        return Out(code, printed.out, printed.err)

    return run


def _edit_run(run: Path, *, lr: float | None = None, loss_shift: float = 0.0, conventions: dict | None = None) -> None:
    """Make a fabricated run differ: another learning rate (a new fingerprint), lower losses, or
    another MFU convention (the report's MFU is recomputed under it)."""
    info = json.loads((run / "run.json").read_text())
    if lr is not None:
        cfg = yaml.safe_load((run / "experiment.yaml").read_text())
        cfg["optim"]["lr"] = lr
        (run / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        info["fingerprint"] = info["segments"][0]["fingerprint"] = fingerprint(cfg)
    if loss_shift:
        rows = read_jsonl(run / "metrics" / "eval.jsonl")
        for r in rows:
            r["loss_nats"] += loss_shift
            r["bpb"] = r["loss_nats"] / 0.6931471805599453 / 3.2
        (run / "metrics" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if conventions:
        info["conventions"].update(conventions)
    (run / "run.json").write_text(json.dumps(info, indent=1))


def _json(cli, *args) -> dict:
    out = cli("compare", *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _row(records: list[dict], **match) -> dict:
    return next(r for r in records if all(r[k] == v for k, v in match.items()))


@pytest.mark.slow
def test_mfu_under_different_conventions_is_shown_but_marked_not_comparable(tmp_path, cli):
    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b")
    same = _json(cli, a, b)
    assert same["mfu_comparable"] is True and same["mfu_convention_differences"] == []
    _edit_run(b, conventions={"flops_formula": "6N"})
    out = cli("compare", a, b)
    assert out.returncode == 0, out.stderr
    assert (
        "**MFU figures NOT comparable**: the conventions differ (flops_formula: 6N+attn (fixture/a) vs 6N (fixture/b))"
        in out.stdout
    )
    data = _json(cli, a, b)
    assert data["mfu_comparable"] is False
    mfu = _row(data["speed"], quantity="mfu")
    sa, sb = (read_tables_of(r)["run_summary"].iloc[0] for r in (a, b))
    assert mfu["fixture/a"] == pytest.approx(sa["mfu"]) and mfu["fixture/b"] == pytest.approx(sb["mfu"])
    assert mfu["fixture/a"] != pytest.approx(mfu["fixture/b"])  # the same work, counted two ways
    assert _row(data["speed"], quantity="flops_formula") == {
        "quantity": "flops_formula",
        "fixture/a": "6N+attn",
        "fixture/b": "6N",
    }
    # the step's clock is part of the convention too (a report written under runner-report/3 reads host)
    _edit_run(b, conventions={"flops_formula": "6N+attn", "step_clock": "device"})
    clocks = _json(cli, a, b)
    assert clocks["mfu_comparable"] is False
    assert clocks["mfu_convention_differences"] == ["step_clock: host (fixture/a) vs device (fixture/b)"]


def read_tables_of(run: Path) -> dict:
    from runner.reports.tables import build_tables

    return build_tables(run)


def test_config_differences_targets_accounting_and_quality_side_by_side(tmp_path, cli):
    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b", lost_step=None)
    _edit_run(b, lr=3e-3, loss_shift=-0.5)
    data = _json(cli, a, b, "--labels", "base,fast")
    assert data["labels"] == ["base", "fast"]
    assert data["config_differences"] == [{"key": "optim.lr", "base": 0.001, "fast": 0.003}]
    # code-5 (code loss <= 5): base meets it at step 6, fast already at step 3 (4.65): fewer tokens,
    # seconds and dollars.
    code = {r["run"]: r for r in data["targets"] if r["target"] == "code-5"}
    assert (code["base"]["step"], code["fast"]["step"]) == (6, 3)
    assert (code["base"]["before_step"], code["fast"]["before_step"]) == (3, None)
    assert code["fast"]["first_in_exposure_tokens"] and code["fast"]["first_in_wall_seconds"]
    assert code["fast"]["first_in_cost_usd"] and not code["base"]["first_in_cost_usd"]
    never = {r["run"]: r for r in data["targets"] if r["target"] == "web-never"}
    assert not never["base"]["met"] and never["fast"]["met"] is False and never["fast"]["value"] == pytest.approx(4.4)
    lost = _row(data["accounting"], domain="total", quantity="lost_tokens")
    assert lost["base"] > 0 and lost["fast"] == 0
    loss = _row(data["quality"], domain="code", metric="loss_nats")
    assert loss["fast"] == pytest.approx(loss["base"] - 0.5)
    out = cli("compare", a, b, "--labels", "base,fast")
    assert "| `optim.lr` | 0.001 | 0.003 |" in out.stdout
    assert "| `code-5` (code loss_nats <= 5) | step 6: 768 tokens," in out.stdout
    assert out.stdout.count("| fast | fast | fast |") >= 2  # code-5 and mean-bpb: first by every measure


@pytest.mark.slow
def test_runs_reports_and_mlflow_run_ids_compare_alike(tmp_path, monkeypatch, cli):
    from mlflow.tracking import MlflowClient

    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b", lost_step=None)
    report = write_report(b)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("cmp", artifact_location=(tmp_path / "artifacts").as_uri())
    ml_run = client.create_run(exp_id).info.run_id
    client.log_artifacts(ml_run, str(report), artifact_path="report")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out = cli("compare", a, report, ml_run, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["labels"] == ["fixture/a", "fixture/b#1", "fixture/b#2"]
    origin = _row(data["runs"], field="origin")
    assert origin["fixture/b#2"] == ml_run
    for table in ("targets", "quality", "accounting"):
        for r in data[table]:
            if "run" in r:
                continue
            assert r["fixture/b#1"] == r["fixture/b#2"], (table, r)  # the report and its MLflow copy agree


@pytest.mark.slow
def test_a_comparison_folder_carries_audited_reports_and_remakes_itself(tmp_path, cli):
    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b", lost_step=None)
    _edit_run(b, loss_shift=-0.5)
    out_dir, md = tmp_path / "cmp", tmp_path / "notes" / "cmp.md"
    out = cli("compare", a, b, "--out", out_dir, "--markdown", md)
    assert out.returncode == 0, out.stderr
    names = {p.name for p in out_dir.iterdir()}
    assert {
        "comparison.md",
        "comparison.json",
        "targets.csv",
        "speed.csv",
        "loss_vs_tokens.png",
        "loss_vs_dollars.png",
    } <= names
    copies = sorted((out_dir / "runs").iterdir())
    assert [p.name for p in copies] == ["fixture_a", "fixture_b"]
    assert all(audit(p, check_mlflow=False).consistent for p in copies)  # offline: UNVERIFIED, never FAIL
    assert "](../cmp/loss_vs_tokens.png)" in md.read_text()
    assert "![loss_vs_dollars](loss_vs_dollars.png)" in (out_dir / "comparison.md").read_text()
    shipped = json.loads((out_dir / "comparison.json").read_text())
    remade = _json(cli, *copies)
    for d in (shipped, remade):
        d["runs"] = [r for r in d["runs"] if r["field"] != "origin"]
    assert remade == shipped
    csv = pd.read_csv(out_dir / "targets.csv")
    assert set(csv["run"]) == {"fixture/a", "fixture/b"}


@pytest.mark.slow
def test_unusable_input_is_one_line_and_exit_2(tmp_path, cli):
    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b")

    def refused(*args) -> str:
        out = cli("compare", *args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr.strip()

    assert refused(a) == "error: compare needs at least two runs, got 1"
    assert "neither a run folder" in refused(a, tmp_path)
    assert "no such folder, and not an MLflow run id" in refused(a, tmp_path / "nope")
    assert "--labels: give 2 distinct labels" in refused(a, b, "--labels", "x")
    report = write_report(b)
    summary = pd.read_parquet(report / "run_summary.parquet")
    summary["schema_version"] = "runner-report/2"
    summary.to_parquet(report / "run_summary.parquet", index=False)
    assert "report written under runner-report/2, this runner compares runner-report/3, runner-report/4" in refused(
        a, report
    )
    cfg = yaml.safe_load((b / "experiment.yaml").read_text())
    cfg["eval"]["targets"]["code-5"]["loss_nats"] = 4.0
    (b / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    line = refused(a, b)
    assert "target 'code-5' is code loss_nats <= 5 in fixture/a but code loss_nats <= 4 in fixture/b" in line


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_compare_never_writes_over_what_is_not_a_comparison(tmp_path, cli):
    """--out replaces its folder whole: `--out RUN` replaced a compared run folder by the comparison
    (checkpoints, ledger, metrics gone), `--out FILE` replaced a file, `--out .` or any folder lost its
    subfolders. Each is refused in one line before anything is written; a comparison folder is remade with
    the user's own files and folders kept; labels that break a table or share a runs/<label> folder are refused."""
    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b")
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "sub" / "keep.txt").write_text("mine")
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    before = {p: _tree(p) for p in (a, b, other)}

    def refused(*args) -> str:
        out = cli("compare", a, b, *args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr.strip()

    assert f"--out: {a} is inside a compared folder" in refused("--out", a)
    assert "is inside a compared folder" in refused("--out", b / "cmp")
    assert "is inside a compared folder" in refused("--markdown", a / "run.json")
    assert f"--out: {other} holds other things and no comparison" in refused("--out", other)
    assert f"--out: {afile} exists and is not a folder" in refused("--out", afile)
    assert f"--markdown: {tmp_path} is a folder" in refused("--markdown", tmp_path)
    assert "--labels: 'x|y' is not a label" in refused("--labels", "x|y,z")
    assert "--labels: '' is not a label" in refused("--labels", ",z")
    assert "name the same folder runs/<label>" in refused("--labels", "a b,a_b")
    assert {p: _tree(p) for p in (a, b, other)} == before and afile.read_text() == "mine"
    out_dir = tmp_path / "cmp"  # an earlier comparison, with a folder of the user's own in it
    (out_dir / "notes").mkdir(parents=True)
    (out_dir / "notes" / "why.md").write_text("mine")
    (out_dir / "comparison.json").write_text("{}")
    remade = cli("compare", a, b, "--out", out_dir, "--labels", "lr=3e-4,base")
    assert remade.returncode == 0, remade.stderr
    assert (out_dir / "notes" / "why.md").read_text() == "mine" and (out_dir / "runs" / "lr_3e-4").is_dir()


@pytest.mark.slow
def test_a_report_failing_its_audit_is_not_put_in_a_comparison_folder(tmp_path, cli):
    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b")
    report = write_report(b)
    t = read_tables(report)["targets"]
    t.loc[0, "useful_tokens"] = 1
    t.to_parquet(report / "targets.parquet", index=False)
    t.to_csv(report / "targets.csv", index=False)
    out = cli("compare", a, report, "--out", tmp_path / "cmp")
    assert out.returncode == 2
    assert "its report fails the audit (quality targets recounted from the evaluations" in out.stderr
    assert not (tmp_path / "cmp" / "comparison.json").exists()


def test_the_published_comparison_is_audited_and_reproducible(cli):
    shipped = json.loads((PUBLISHED / "comparison.json").read_text())
    copies = [PUBLISHED / "runs" / name for name in ("cpu-tiny", "cpu-tiny-lr")]
    for copy in copies:
        result = audit(copy, check_mlflow=False)
        assert result.consistent, result.render()  # offline: UNVERIFIED at best (its MLflow store is not here)
    remade = _json(cli, *copies)
    for d in (shipped, remade):
        d["runs"] = [r for r in d["runs"] if r["field"] != "origin"]
    assert remade == shipped
    assert [d["key"] for d in shipped["config_differences"]] == ["optim.lr"]
    assert {t["name"] for t in shipped["target_definitions"]} == {"code-6p2", "mean-6p2", "prose-bpb-2p3", "code-5p9"}
    # the shipped claim (its README): the higher learning rate meets every target, each at the first
    # evaluation in exposure tokens (prose-bpb-2p3 at the same one as lr 3e-3), code-5p9 alone
    for r in shipped["targets"]:
        if r["run"] == "cpu-tiny-lr":
            assert r["met"] and r["first_in_exposure_tokens"], r
    assert not next(r for r in shipped["targets"] if r["run"] == "cpu-tiny" and r["target"] == "code-5p9")["met"]


@pytest.mark.slow  # audits both copies (about 4 s)
def test_audit_reports_counts_a_published_comparison_as_one_not_as_a_report(tmp_path, cli):
    """`runner audit-reports` on the repository's reports/ said "5 published reports" for 4 reports and
    the published comparison: each kind is counted as what it is."""
    import shutil

    reports = tmp_path / "reports"
    shutil.copytree(PUBLISHED, reports / "comparisons" / PUBLISHED.name)
    out = cli("audit-reports", reports)
    assert out.returncode == 5, out.stdout + out.stderr  # offline: the copies' MLflow checks UNVERIFIED
    assert out.stdout.strip().splitlines()[-1] == "0 published reports, 1 comparison: 0 PASS, 1 UNVERIFIED, 0 FAIL"


@pytest.mark.slow  # each look audits both copies (about 4 s)
def test_a_published_comparison_is_audited_against_its_report_copies(tmp_path, cli):
    """A published comparison was only checked for its files' presence: comparison.json's winner swapped,
    comparison.md edited, or a copy's tables forged all passed audit-reports. It is remade from its
    report copies: comparison.json saying other figures FAILs naming the key; a rendering (md, CSV, plot)
    that differs is UNVERIFIED naming the file; a copy failing its own audit FAILs; clean, it is as the
    copies are (offline: UNVERIFIED, never PASS). `runner audit COMPARISON_DIR` runs the same."""
    import shutil

    from runner.reports.compare.verify import COPIES, DATA, RENDERED

    folder = tmp_path / "cpu-tiny-lr"
    shutil.copytree(PUBLISHED, folder)

    def looked() -> tuple[int, dict[str, str], str]:
        out = cli("audit", folder, "--json")
        checks = json.loads(out.stdout)["checks"]
        return out.returncode, {c["name"]: c["status"] for c in checks}, out.stdout

    code, status, _ = looked()
    assert code == 5 and status == {COPIES: "UNVERIFIED", DATA: "PASS", RENDERED: "PASS"}, status  # no MLflow here
    refused = cli("audit", folder, "--recompute-eval")  # one run's checkpoint: never silently ignored
    assert refused.returncode == 2 and "--recompute-eval rescores one run's checkpoint" in refused.stderr

    recorded = json.loads((folder / "comparison.json").read_text())
    forged = json.loads(json.dumps(recorded))
    row = next(r for r in forged["targets"] if r["run"] == "cpu-tiny" and r["target"] == "code-5p9")
    row["met"] = True  # lr 3e-3 never met it
    (folder / "comparison.json").write_text(json.dumps(forged, indent=1) + "\n")
    code, status, out = looked()
    assert code == 1 and status[DATA] == "FAIL" and "targets[" in out and ".met: recorded true" in out, out
    (folder / "comparison.json").write_text(json.dumps(recorded, indent=1) + "\n")

    md = (folder / "comparison.md").read_text()
    (folder / "comparison.md").write_text(md.replace("5.855", "5.555", 1))
    (folder / "loss_vs_tokens.png").write_bytes((folder / "loss_vs_dollars.png").read_bytes())
    code, status, out = looked()
    assert code == 5 and status[RENDERED] == "UNVERIFIED" and "FAIL" not in status.values(), out
    assert "comparison.md differs (line " in out and "5.555" in out and "loss_vs_tokens.png differs" in out
    shutil.copy2(PUBLISHED / "comparison.md", folder / "comparison.md")
    shutil.copy2(PUBLISHED / "loss_vs_tokens.png", folder / "loss_vs_tokens.png")

    validation = folder / "runs" / "cpu-tiny-lr" / "validation.parquet"
    table = pd.read_parquet(validation)
    table.assign(loss_nats=table["loss_nats"] * 0.8).to_parquet(validation, index=False)  # a copy forged
    code, status, out = looked()
    assert code == 1 and status[COPIES] == "FAIL" and "runs/cpu-tiny-lr: " in out, out


def test_runs_under_different_hardware_settings_crown_no_winner_in_seconds_or_dollars(tmp_path, cli):
    """Issue 38, item 5: a CPU's peak follows its threads (1 vs 2: 0.166 vs 0.333 TFLOP/s); a run on
    another setting is not cheaper because of its experiment. The difference is named first, MFU
    under another peak is not comparable, and no run is first in seconds or dollars."""
    from runner.reports.compare.hardware import hardware_differences, settings_of

    one, two = ({"device_name": "cpu", "peak_tflops": p} for p in (0.1664, 0.3328))
    settings = [settings_of(one, {"threads": 1}), settings_of(two, {"threads": 2})]
    assert settings[0] == {"device_name": "cpu", "threads": "1", "peak_tflops": "0.1664"}
    assert list(hardware_differences(["a", "b"], settings).values()) == [
        "threads: 1 (a) vs 2 (b)",
        "peak_tflops: 0.1664 (a) vs 0.3328 (b)",
    ]
    assert settings_of(one, {})["threads"] == "not recorded"  # a run from before threads were recorded
    assert "threads" not in settings_of({"device_name": "H200 SXM", "peak_tflops": 989.4}, {"threads": 1})

    a = make_run(tmp_path, run_id="a")
    b = make_run(tmp_path, run_id="b")
    same = _json(cli, a, b)
    assert "speed_and_cost_not_comparable" not in same
    assert any(r["first_in_wall_seconds"] for r in same["targets"])  # equal runs: both first
    _edit_run(b, conventions={"peak_tflops": 2 * 989.4})
    data = _json(cli, a, b)
    assert data["speed_and_cost_not_comparable"] == ["peak_tflops: 989.4 (fixture/a) vs 1979 (fixture/b)"]
    assert data["mfu_comparable"] is False and data["mfu_convention_differences"] == []
    assert data["targets"] and not any(r["first_in_wall_seconds"] or r["first_in_cost_usd"] for r in data["targets"])
    md = cli("compare", a, b).stdout
    speed = md.split("## Speed and cost", 1)[1]
    assert speed.lstrip().startswith("**Speed and cost NOT comparable**: the runs ran under different hardware")
    assert "**MFU figures NOT comparable**: the conventions differ (peaks of different hardware settings" in md
    assert "not comparable (hardware settings differ)" in md.split("## Quality targets", 1)[1].split("##", 1)[0]


@pytest.mark.slow  # audits the two copies (about 3 s)
def test_a_malformed_comparison_json_is_a_fail_not_a_traceback(tmp_path, cli):
    """comparison.json with `runs: 5` was a TypeError traceback in `runner audit` of the folder, one nested
    200,000 deep a RecursionError; either is a FAIL of the comparison's data, and `compare --out` over
    the deep one is refused as a folder it did not write. A copy missing its experiment.yaml FAILs."""
    import shutil

    from runner.reports.compare.render import is_comparison_folder
    from runner.reports.compare.verify import COPIES, DATA, check_comparison

    for name, text in (("runs5", None), ("deep", "[" * 200_000 + "]" * 200_000)):
        folder = tmp_path / name
        shutil.copytree(PUBLISHED, folder)
        if text is None:
            data = json.loads((folder / "comparison.json").read_text())
            text = json.dumps(data | {"runs": 5})
        (folder / "comparison.json").write_text(text)
        result = check_comparison(folder, check_mlflow=False)
        data_check = next(c for c in result.checks if c.name == DATA)
        assert result.verdict == "FAIL" and data_check.status == "FAIL", result.render()
        assert ("runs: recorded 5" if name == "runs5" else "nested too deeply") in data_check.detail
    assert not is_comparison_folder(tmp_path / "deep")
    assert cli("audit", tmp_path / "deep").returncode == 1
    # a copy that cannot be audited at all (its experiment.yaml gone) stopped audit-reports whole (exit 2)
    folder = tmp_path / "noexp"
    shutil.copytree(PUBLISHED, folder)
    (folder / "runs" / "cpu-tiny" / "experiment.yaml").unlink()
    result = check_comparison(folder, check_mlflow=False)
    assert result.failed() == [COPIES, DATA] and "runs/cpu-tiny: cannot be audited: " in result.render()
