"""`runner fetch`, `runner data prepare EXPERIMENT` and `runner pin` against a loopback Hub: the real
huggingface_hub client (HF_ENDPOINT), a tiny FineWeb-Edu-layout parquet dataset and a tokenizer.json."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fakehub import FakeHub
from hubfixtures import DATA_REPO, SHARDS, TOKENIZER_REPO, _downloads, _exp, serving_hub, use_hub
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from runner.cli import main
from runner.config.load import load_experiment
from runner.data.fetch import fetch_experiment
from runner.data.manifest import load_experiment_manifests, load_manifest
from runner.data.pin import pin_experiment
from runner.data.prepare import prepare, prepare_experiment
from runner.errors import RunnerError

REPO = Path(__file__).resolve().parents[2]
RUNNER = shutil.which("runner", path=str(Path(sys.executable).parent)) or "runner"


@pytest.fixture()
def hub(tmp_path: Path):
    with serving_hub(tmp_path) as server:
        yield server


@pytest.fixture()
def hub_project(project: Path, hub: FakeHub, monkeypatch) -> Path:
    return use_hub(project, hub, monkeypatch)


def test_fetch_downloads_exactly_the_named_files_verified_at_the_resolved_commit(hub_project: Path, hub: FakeHub):
    records = fetch_experiment(_exp(hub_project), say=lambda _: None)

    assert [r["commit"] for r in records] == [hub.commits["tokenizer"], hub.commits["web"]]
    assert (hub_project / "data/tokenizers/tiny-hub/tokenizer.json").read_bytes() == hub.repos[
        ("model", TOKENIZER_REPO)
    ]["commits"][hub.commits["tokenizer"]]["tokenizer.json"]
    raw = hub_project / "data/raw/tiny-fineweb"
    assert sorted(p.relative_to(raw).as_posix() for p in raw.rglob("*") if p.is_file()) == [
        ".runner-fetch.json",
        *SHARDS,
    ]  # not the 100BT sample, not the README
    web = records[1]
    assert [f["path"] for f in web["files"]] == list(SHARDS) and web["revision"] == "main"
    assert all(f["lfs"] and f["sha256"] == hashlib.sha256(hub.files[f["path"]]).hexdigest() for f in web["files"])
    # `main` is asked once; every file is then read at the commit it resolved to
    assert all(f"/resolve/{hub.commits['web']}/" in p for p, _ in _downloads(hub) if DATA_REPO in p)

    hub.requests.clear()
    fetch_experiment(_exp(hub_project), say=lambda _: None)
    assert _downloads(hub) == []  # a second fetch finds everything verified in place


@pytest.mark.slow
def test_a_killed_fetch_resumes_from_its_partial_file(hub_project: Path, hub: FakeHub):
    # huggingface_hub writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB): a shard
    # larger than that, stalled after one chunk, leaves a partial file of one chunk when killed
    big = "sample/10BT/002_00000.parquet"
    data = os.urandom(DOWNLOAD_CHUNK_SIZE + (2 << 20))
    hub.add_repo("dataset", DATA_REPO, {**hub.files, big: data}, lfs=True)
    hub.stall_after[big] = DOWNLOAD_CHUNK_SIZE + (1 << 20)
    raw = hub_project / "data/raw/tiny-fineweb"
    dest = raw / big
    env = {**os.environ, "HF_HUB_DOWNLOAD_TIMEOUT": "3600"}  # the stalled read waits for the kill, not a timeout
    proc = subprocess.Popen([RUNNER, "fetch", "experiments/tiny-hub.yaml"], cwd=hub_project, env=env)
    try:
        while not [p for p in dest.parent.glob(".*.part") if p.stat().st_size >= DOWNLOAD_CHUNK_SIZE]:
            assert proc.poll() is None, "fetch ended before the stalled download"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    (part,) = dest.parent.glob(".*.part")
    have = part.stat().st_size
    assert 0 < have < len(data) and not dest.exists()
    assert not (raw / ".runner-fetch.json").exists()  # nothing recorded: nothing for prepare or pin

    hub.stall_after.clear()
    hub.requests.clear()
    fetch_experiment(_exp(hub_project), say=lambda _: None)
    resumed = [rng for path, rng in _downloads(hub) if path.endswith(big)]
    assert resumed == [f"bytes={have}-"]  # one request, for the missing bytes only
    assert dest.read_bytes() == data and not part.exists()


def test_a_wrong_sha256_from_the_hub_is_refused_and_nothing_is_pinned(hub_project: Path, hub: FakeHub):
    hub.lie_sha256.add(SHARDS[1])
    with pytest.raises(RunnerError) as err:
        fetch_experiment(_exp(hub_project), say=lambda _: None)
    msg = str(err.value)
    assert "recipes/mixture/tiny-web.yaml: domains.web.source.files: sample/10BT/001_00000.parquet" in msg
    assert f"the Hub's LFS sha256 is {'0' * 64}: refused" in msg
    raw = hub_project / "data/raw/tiny-fineweb"
    assert not (raw / SHARDS[1]).exists() and not list(raw.rglob("*.part"))
    assert not (raw / ".runner-fetch.json").exists()

    before = {p: p.read_text() for p in (hub_project / "recipes").rglob("*.yaml")}
    assert main(["pin", "experiments/tiny-hub.yaml"]) == 2  # the tokenizer was fetched, the data was not
    assert before == {p: p.read_text() for p in (hub_project / "recipes").rglob("*.yaml")}


def test_a_xet_backed_file_goes_through_hf_xet_and_over_http_when_that_fails(hub_project: Path, hub: FakeHub):
    hub.xet.add(SHARDS[0])
    said: list[str] = []
    fetch_experiment(_exp(hub_project), say=said.append)
    assert any(method == "GET" and "/xet-read-token/" in path for method, path, _ in hub.requests)  # hf_xet asked
    assert any("hf_xet failed" in line and f"downloading {SHARDS[0]} over HTTP instead" in line for line in said)
    assert (hub_project / "data/raw/tiny-fineweb" / SHARDS[0]).read_bytes() == hub.files[SHARDS[0]]


def test_a_fetch_the_disk_cannot_hold_is_refused_before_any_download(hub_project: Path, hub: FakeHub, monkeypatch):
    import runner.data.fetch as fetch

    real = shutil.disk_usage
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(
        RunnerError,
        match=r"tiny-hub.yaml: hub.files: the files to fetch need [0-9,]+ bytes \(0.0 GB\) more and .* has 1,000 bytes free",
    ):
        fetch_experiment(_exp(hub_project), say=lambda _: None)
    assert _downloads(hub) == []


def test_an_unknown_revision_is_one_line_naming_the_recipe(hub_project: Path, capsys):
    path = hub_project / "recipes/mixture/tiny-web.yaml"
    path.write_text(path.read_text().replace("revision: main ", "revision: v9.9 "))
    assert main(["fetch", "experiments/tiny-hub.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: recipes/mixture/tiny-web.yaml: domains.web.source.revision: {DATA_REPO} has no revision 'v9.9'"
    ]
    assert not (hub_project / "data").exists()  # every revision is resolved before anything is downloaded


def test_no_network_is_one_line_exit_2_without_a_retry_loop(hub_project: Path, monkeypatch, capsys):
    import socket

    import huggingface_hub.utils._http as hf_http

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    waits = []
    monkeypatch.setattr(hf_http.time, "sleep", waits.append)  # a backoff would sleep between retries
    assert main(["fetch", "experiments/tiny-hub.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(
        f"error: recipes/tokenizer/tiny-hub.yaml: hub.revision: cannot reach the Hub at http://127.0.0.1:{closed} (ConnectError"
    )
    assert waits == []


def test_offline_mode_is_said_not_waited_on(hub_project: Path, hub: FakeHub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["fetch", "experiments/tiny-hub.yaml"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: experiments/tiny-hub.yaml: HF_HUB_OFFLINE is set: `runner fetch` needs the Hub"
    )
    assert hub.requests == []


def test_prepare_reads_the_fetched_files_in_order_and_pin_writes_every_pin_once(hub_project: Path, hub: FakeHub):
    fetch_experiment(_exp(hub_project), say=lambda _: None)
    [(domain, path, sha256)] = prepare_experiment(_exp(hub_project), workers=1, progress=False)
    m = load_manifest(path)
    assert domain == "web" and m.sha256 == sha256
    assert [s["path"] for s in m.data["sources"]] == list(SHARDS)  # named by their repo paths, in that order

    result = pin_experiment(hub_project / "experiments/tiny-hub.yaml")
    tok = yaml.safe_load((hub_project / "recipes/tokenizer/tiny-hub.yaml").read_text())
    mix = yaml.safe_load((hub_project / "recipes/mixture/tiny-web.yaml").read_text())
    exp = yaml.safe_load((hub_project / "experiments/tiny-hub.yaml").read_text())
    assert tok["version"] == 2 and tok["hub"]["revision"] == hub.commits["tokenizer"]
    assert tok["sha256"] == hashlib.sha256((hub_project / tok["path"]).read_bytes()).hexdigest()
    assert mix["version"] == 2 and mix["domains"]["web"]["source"]["revision"] == hub.commits["web"]
    assert (
        exp["version"] == 2
        and exp["recipes"]["tokenizer"] == "tiny-hub@2"
        and exp["recipes"]["mixture"] == "tiny-web@2"
    )
    assert exp["data"]["manifests"]["web"] == {
        "path": "data/tiny-fineweb/web/manifest.json",
        "sha256": sha256,
        "pool_tokens": m.pool_tokens,
        "validation_tokens": m.validation_tokens,
    }
    text = (hub_project / "recipes/mixture/tiny-web.yaml").read_text()
    assert "# a stand-in dataset: small enough to repeat" in text  # comments and layout kept
    assert "a/recipes/tokenizer/tiny-hub.yaml" in result.diff() and "+sha256: " in result.diff()

    manifests, _ = load_experiment_manifests(_exp(hub_project))  # what launch checks now holds
    assert manifests["web"].sha256 == sha256
    assert not pin_experiment(hub_project / "experiments/tiny-hub.yaml").changes  # idempotent

    recipe = hub_project / "recipes/mixture/tiny-web.yaml"
    recipe.write_text(recipe.read_text().replace(hub.commits["web"], "main"))
    with pytest.raises(RunnerError, match="tiny-web.yaml: domains.web.source.revision: 'main' is a branch or tag"):
        load_experiment_manifests(_exp(hub_project))  # launch refuses a run that could not say what it read


def test_pin_of_a_derived_experiment_writes_its_own_manifest_pins_and_follows_its_base(hub_project: Path):
    derived = hub_project / "experiments/tiny-hub-long.yaml"
    derived.write_text(
        "name: tiny-hub-long\nversion: 1\ndescription: twice the budget, its own pool\nbase: tiny-hub@1\n"
        "train: {exposure_tokens: 51200}\n"
        "data:\n  manifests:\n    web:\n      path: data/tiny-fineweb-long/web/manifest.json   # its own pool\n"
    )
    exp = load_experiment(derived, check_files=False)
    fetch_experiment(exp, say=lambda _: None)
    [(_, path, sha256)] = prepare_experiment(exp, workers=1, progress=False)
    pin_experiment(derived)

    base = yaml.safe_load((hub_project / "experiments/tiny-hub.yaml").read_text())
    assert base["version"] == 2 and base["recipes"]["tokenizer"] == "tiny-hub@2"  # its recipes were pinned
    assert base["data"]["manifests"]["web"]["sha256"] is None  # not its pool: left alone
    mine = yaml.safe_load(derived.read_text())
    assert mine["version"] == 2 and mine["base"] == "tiny-hub@2"
    assert mine["data"]["manifests"]["web"]["sha256"] == sha256 == load_manifest(path).sha256
    assert "# its own pool" in derived.read_text()
    assert not pin_experiment(derived).changes


def test_pin_refuses_a_pool_prepared_from_other_files_than_were_fetched(hub_project: Path, tmp_path: Path):
    fetch_experiment(_exp(hub_project), say=lambda _: None)
    raw = hub_project / "data/raw/tiny-fineweb"
    prepare(
        "web",
        hub_project / "data/tokenizers/tiny-hub/tokenizer.json",
        hub_project / "data/tiny-fineweb/web",
        [raw / SHARDS[0]],  # one shard of the two
        workers=1,
        progress=False,
    )
    before = (hub_project / "experiments/tiny-hub.yaml").read_text()
    with pytest.raises(RunnerError, match="data.manifests.web: .* was prepared from other files than `runner fetch`"):
        pin_experiment(hub_project / "experiments/tiny-hub.yaml")
    assert (hub_project / "experiments/tiny-hub.yaml").read_text() == before


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _runner(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([RUNNER, *args], cwd=cwd, capture_output=True, text=True)
    assert "Traceback" not in out.stderr, out.stderr
    return out


@pytest.mark.slow
def test_readme_walkthrough_fetch_prepare_pin_validate_commit_check_pr_launch(hub_project: Path, hub: FakeHub):
    """The README's 1p3b flow, command for command, on a stand-in experiment that names Hub assets,
    with no hand edit between the commands."""
    (hub_project / ".gitignore").write_text("data/\nruns/\nmlflow.db\n")
    _git(hub_project, "init", "-q")
    _git(hub_project, "add", "-A")
    _git(hub_project, "commit", "-qm", "recipes that name Hub assets, nothing pinned")
    base = _git(hub_project, "rev-parse", "HEAD").strip()

    exp = "experiments/tiny-hub.yaml"
    out = _runner(hub_project, "launch", exp, "--no-tracking")
    assert out.returncode == 2 and "sha256: not pinned: `runner pin experiments/tiny-hub.yaml`" in out.stderr
    for step in (("fetch", exp), ("data", "prepare", exp), ("pin", exp), ("validate",)):
        out = _runner(hub_project, *step)
        assert out.returncode == 0, (step, out.stdout, out.stderr)
    assert "pins up to date" in _runner(hub_project, "pin", exp).stdout
    _git(hub_project, "add", "-A")
    _git(hub_project, "commit", "-qm", "pin the tokenizer, the data and their Hub commits")
    out = _runner(hub_project, "check-pr", "--base", base)
    assert out.returncode == 0 and "check-pr: PASS" in out.stdout, out.stdout + out.stderr
    out = _runner(hub_project, "launch", exp, "--no-tracking", "--run-name", "walkthrough")
    assert out.returncode == 0, out.stderr
    run_dir = hub_project / "runs/tiny-hub/walkthrough"
    config = yaml.safe_load((run_dir / "experiment.yaml").read_text())
    assert config["tokenizer"]["hub"]["revision"] == hub.commits["tokenizer"]  # the run says what it read
    assert config["mixture"]["domains"]["web"]["source"]["revision"] == hub.commits["web"]
    report = (run_dir / "report/report.md").read_text()
    assert f"from {TOKENIZER_REPO}@{hub.commits['tokenizer']} (tokenizer.json)" in report
    assert f"`web` from {DATA_REPO}@{hub.commits['web']} (sample/10BT/*.parquet)" in report
