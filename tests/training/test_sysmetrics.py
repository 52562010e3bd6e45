"""System metrics beside MFU: what each reader measures, the run's device-busy figure, MLflow names.

The NVML and amdsmi readers are driven through stand-in modules with those libraries' API (this
machine has no GPU); the device check (bench/device_check.sh) reads a real one."""

from __future__ import annotations

import json
import platform
import sys
import time
import types

import pytest
from trainfixtures import launch, make_project

from runner.training import sysmetrics
from runner.training.sysmetrics import SystemMonitor, mlflow_metrics, summarize


def _fake_nvml(util=87, used=40 * 2**30, total=141 * 2**30, milliwatts=612_000, uuid_ok=False):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    m.opened = []
    m.nvmlInit = lambda: None

    def by_uuid(uuid):
        if not uuid_ok:
            raise NVMLError("not found")
        m.opened.append(("uuid", uuid))
        return "h"

    def by_index(i):
        m.opened.append(("index", i))
        return "h"

    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetHandleByIndex = by_index
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util, memory=30)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used, total=total)
    m.nvmlDeviceGetPowerUsage = lambda h: milliwatts
    return m


def test_nvml_reader_gives_utilisation_memory_and_power(monkeypatch):
    fake = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    row = SystemMonitor(1.0, "cuda", device_index=1).sample()
    assert fake.opened == [("index", 5)]  # torch's device 1 is physical GPU 5
    assert row["device_busy_percent"] == 87
    assert row["device_memory_used_gib"] == pytest.approx(40) and row["device_memory_total_gib"] == pytest.approx(141)
    assert row["device_power_watts"] == pytest.approx(612.0)
    assert {"node", "node_rank", "rank", "local_rank", "process_cpu_percent", "process_rss_gib"} <= set(row)


def test_amdsmi_reader_gives_activity_vram_and_power(monkeypatch):
    m = types.ModuleType("amdsmi")
    m.amdsmi_init = lambda: None
    m.amdsmi_get_processor_handles = lambda: ["gpu0", "gpu1"]
    m.amdsmi_get_gpu_activity = lambda h: {"gfx_activity": 64 if h == "gpu1" else 0, "umc_activity": 10}
    m.amdsmi_get_gpu_vram_usage = lambda h: {"vram_used": 1024, "vram_total": 196_608}  # MB
    m.amdsmi_get_power_info = lambda h: {"current_socket_power": 550, "power_limit": 750}
    monkeypatch.setitem(sys.modules, "amdsmi", m)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES", raising=False)
    row = SystemMonitor(1.0, "rocm", device_index=1).sample()
    assert row["device_busy_percent"] == 64
    assert row["device_memory_used_gib"] == pytest.approx(1.0) and row["device_memory_total_gib"] == pytest.approx(192)
    assert row["device_power_watts"] == 550


def test_a_missing_device_library_is_said_once_and_busy_is_not_invented(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    said = []
    mon = SystemMonitor(1.0, "cuda", report=said.append)
    row = mon.sample()
    assert "device_busy_percent" not in row and "process_cpu_percent" in row
    assert len(said) == 1 and "nvidia-ml-py (pynvml) unavailable" in said[0]
    assert mon.busy_source.startswith("nvidia-ml-py (pynvml) unavailable")


def test_cpu_busy_is_process_cpu_time_over_wall_time_times_threads(monkeypatch):
    reader = sysmetrics._CpuReader(threads=2)
    monkeypatch.setattr(sysmetrics.time, "monotonic", lambda: 102.0)
    monkeypatch.setattr(reader, "_cpu_seconds", lambda: 13.0)
    reader.last = (100.0, 10.0)
    out = reader.read()  # 3 s of CPU in 2 s of wall on 2 threads
    assert out["process_cpu_percent"] == pytest.approx(150.0) and out["busy_percent"] == pytest.approx(75.0)


def test_the_sampler_thread_samples_and_stop_takes_a_last_one():
    mon = SystemMonitor(0.05, "cpu", torch_threads=1).start()
    deadline = time.monotonic() + 0.4
    while time.monotonic() < deadline:
        sum(i * i for i in range(20_000))  # some CPU work to measure
    rows = mon.drain() + mon.stop()
    assert len(rows) >= 2 and all(r["device_busy_percent"] >= 0 for r in rows)
    assert rows[-1]["elapsed_seconds"] >= 0.4 and mon._thread is None
    assert mon.stop() == []  # idempotent


def test_device_busy_is_the_mean_over_every_rank_and_attempt(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    rank0 = [
        {"node": "a", "node_rank": 0, "rank": 0, "device_busy_percent": b, "device_power_watts": 500} for b in (90, 100)
    ]
    rank1 = [{"node": "b", "node_rank": 1, "rank": 1, "device_busy_percent": 20, "device_memory_used_gib": 70.5}]
    (metrics / "system-rank00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rank0) + '{"torn')
    (metrics / "system-rank00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rank1))
    out = summarize(tmp_path, "cuda", "nvml")
    assert out["device_busy"] == pytest.approx((90 + 100 + 20) / 3 / 100)
    assert out["nodes"] == {"a#0": [0], "b#1": [1]} and out["samples"] == 3
    assert out["device_power_mean_watts"] == 500 and out["device_memory_used_peak_gib"] == 70.5


def test_a_sample_of_another_shape_is_left_out_and_counted_not_a_traceback_at_the_runs_end(tmp_path):
    """A system-rank file's line edited or damaged (`"device_busy_percent": "x"`, a rank of text, a list,
    a null RSS) was float()'s or int()'s traceback in the summary at the end of the attempt: a run that
    trained ended failed, without its report, and so did every later attempt (the file stays). It is left
    out of the means and counted in run.json's `system` and the report's device-busy line."""
    from runner.reports.markdown import device_busy_line

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    good = {"node": "a", "node_rank": 0, "rank": 0, "device_busy_percent": 90, "process_rss_gib": 1.5}
    bad = [
        {**good, "device_busy_percent": "x"},
        {**good, "rank": "a"},
        {**good, "device_busy_percent": float("inf")},
        [1, 2],
    ]
    rows = [good, *bad, {**good, "process_rss_gib": None}]
    (metrics / "system-rank00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = summarize(tmp_path, "cuda", "nvml")
    assert out["samples_unreadable"] == 4 and out["samples"] == 2 and out["device_busy"] == pytest.approx(0.9)
    assert out["process_rss_peak_gib"] == 1.5 and out["nodes"] == {"a#0": [0]}
    line = device_busy_line({"system": out}, 0.5)
    assert "mean of 2 samples of nvml (4 unreadable samples left out)." in line
    (metrics / "system-rank00000.jsonl").write_text(json.dumps(good) + "\n")
    assert "samples_unreadable" not in summarize(tmp_path, "cuda", "nvml")  # said only where there are some


def test_mlflow_names_follow_mlflows_system_metrics():
    rows = [{"device_busy_percent": 80, "device_memory_used_gib": 1.0, "process_cpu_percent": 100}] * 2
    gpu = mlflow_metrics(rows, "cuda")
    assert gpu["system/gpu_0_utilization_percentage"] == 80 == gpu["system/device_busy_percentage"]
    assert gpu["system/gpu_0_memory_usage_megabytes"] == 1024.0
    cpu = mlflow_metrics(rows, "cpu")
    assert "system/gpu_0_utilization_percentage" not in cpu and cpu["system/device_busy_percentage"] == 80


@pytest.mark.slow
def test_a_run_records_device_busy_beside_mfu_in_run_json_mlflow_and_the_report(tmp_path):
    exp = make_project(tmp_path, steps=6, train_extra={"system_metrics_interval_seconds": 0.1})
    run = tmp_path / "runs" / "s"
    launch(tmp_path, exp, "--run-dir", run)
    info = json.loads((run / "run.json").read_text())
    system = info["system"]
    assert 0 <= info["device_busy"] == system["device_busy"] and system["device_busy_samples"] >= 1
    assert info["conventions"]["device_busy_source"].startswith("process CPU time")
    assert system["nodes"] == {f"{platform.node()}#0": [0]}
    rows = [json.loads(x) for x in (run / "metrics" / "system-rank00000.jsonl").read_text().splitlines()]
    assert len(rows) == system["samples"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    ml = client.get_run(info["mlflow"]["run_id"])
    assert "system/device_busy_percentage" in ml.data.metrics and "device_busy" in ml.data.metrics
    assert ml.data.tags["mfu.device_busy_source"] == info["conventions"]["device_busy_source"]
    report = (run / "report" / "report.md").read_text()
    assert f"Device busy {100 * system['device_busy']:.3g}% beside MFU" in report
