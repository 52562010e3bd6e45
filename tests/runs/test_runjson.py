"""run.json's typed record (runner.runs.runjson): published and old formats read, the one writer
refuses a key the record does not name, and unknown keys survive a read-modify-write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.errors import RunnerError
from runner.runs.folder import RunFolder
from runner.runs.recorded import conventions_of, device_seconds, devices_held
from runner.runs.runjson import RunJson

REPO = Path(__file__).resolve().parents[2]


def test_every_published_reports_run_json_reads_with_every_key_known():
    files = sorted((REPO / "reports").rglob("run.json"))
    assert files, "no published report"
    for f in files:
        data = json.loads(f.read_text())
        rec = RunJson.from_dict(data, file=str(f))
        assert rec.extra == {}, f
        assert rec.run_id == data["run_id"] and rec.committed_steps == data["committed_steps"]
        assert rec.current_fingerprint() == data["segments"][-1]["fingerprint"]


def test_an_old_run_json_gets_the_old_formats_defaults():
    old = {"run_id": "r", "fingerprint": "abc", "committed_steps": 4, "segments": None, "status": "finished"}
    rec = RunJson.from_dict(old)
    assert rec.segments == [] and rec.checkpoints == [] and rec.mlflow == {} and rec.runtime == {}
    assert rec.current_fingerprint() == "abc"  # before segments: the top-level fingerprint
    assert rec.devices is None and rec.device_wall_seconds is None and rec.conventions is None
    # a recorded 0 and a format without the key read alike as committed_steps; `has` tells them apart
    assert rec.has("committed_steps") and not rec.has("devices") and not rec.has("segments")
    assert not RunJson.from_dict({"run_id": "r"}).has("committed_steps")
    assert RunJson.from_dict({"committed_steps": 0}).has("committed_steps")
    with pytest.raises(RunnerError, match="expected a JSON object"):
        RunJson.from_dict([1, 2])


def test_readers_fall_back_as_the_old_formats_meant(tmp_path):
    from runner.config.load import load_experiment

    cfg = load_experiment(REPO / "experiments" / "cpu-tiny.yaml").config
    old = {"wall_seconds": 10.0, "step_seconds_total": 8.0, "conventions": {"devices_counted": 2, "peak_tflops": 1.0}}
    assert devices_held(old, cfg) == 2  # no `devices`: the convention's count
    assert device_seconds(old, cfg, 10.0, 8.0) == (20.0, 16.0)
    assert conventions_of(RunJson.from_dict(old), cfg)["time_basis"] == "step"
    assert conventions_of(old, cfg)["step_clock"] == "host"  # runs before the device clock


def test_the_writer_refuses_a_key_the_record_does_not_name_and_keeps_unknown_ones(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "from_a_newer_runner": 1}))
    folder = RunFolder(tmp_path)
    with pytest.raises(RunnerError, match="not a run.json field: comitted_steps") as err:
        folder.update(comitted_steps=3)
    assert str(tmp_path / "run.json") in str(err.value)
    folder.update(committed_steps=3, status="running")
    assert json.loads((tmp_path / "run.json").read_text()) == {
        "run_id": "r",
        "from_a_newer_runner": 1,
        "committed_steps": 3,
        "status": "running",
    }
    rec = folder.record()
    assert rec.committed_steps == 3 and rec.extra == {"from_a_newer_runner": 1}
