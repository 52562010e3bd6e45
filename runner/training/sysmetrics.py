"""System metrics beside MFU: how busy the device was, its memory and power, the host's CPU and RAM.

Owns a sampler thread that reads, every `interval_seconds`, for the device this process computes on:
- CUDA: nvidia-ml-py (`pynvml`): utilization.gpu (% of the sample period in which a kernel ran),
  memory used and total, power draw;
- ROCm: `amdsmi` when installed: gfx activity %, VRAM used and total, socket power;
- CPU: psutil: this process's CPU time over (wall time x torch's threads, the cores the CPU peak
  counts), which is what `device busy` means for a CPU run;
and, on every device, this process's CPU %, resident memory and the host's RAM use, tagged with the
node (host name, NODE_RANK) and rank of the process, so a multi-node run says which node was idle.
`device_busy` of a run is the mean of the samples' device utilisation, every rank's samples
(metrics/system-rank*.jsonl) of every attempt counted.
A busy device is not an efficient one: MFU says how much of the peak the model's FLOPs used,
device busy only that a kernel was running. Both are reported side by side.
Never blocks the training loop (the loop takes the samples when it logs), never raises into it (a
reader that fails is reported once and skipped), never sends anything itself.

Why not MLflow's own system-metrics monitor: it sends from its own thread with its own client, for
runs started through `mlflow.start_run`, so what a dead tracking server misses is lost (the runner's
Tracker journals it) and a run without tracking (or a device without mlflow) would have none. The
samples here go where every other metric goes, under MLflow's own `system/...` names.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

from runner.fsio import read_jsonl, repair_jsonl_tail
from runner.runs.recorded import number, whole
from runner.training.callbacks import Callback

GIB = 2.0**30
BUSY_SOURCE = {
    "cuda": "nvml utilization.gpu: share of each sample period in which a kernel ran on the GPU (not how much of it)",
    "rocm": "amdsmi gfx_activity: share of each sample period the GPU's graphics/compute engine was active",
    "cpu": "process CPU time / (wall time x torch threads): the CPU run's cores counted by its peak",
}


def node_identity() -> dict[str, Any]:
    """Which host and process these samples come from (torchrun/accelerate variables when set)."""
    env = os.environ
    return {
        "node": platform.node(),
        "node_rank": int(env.get("NODE_RANK", env.get("GROUP_RANK", "0")) or 0),
        "rank": int(env.get("RANK", "0") or 0),
        "local_rank": int(env.get("LOCAL_RANK", "0") or 0),
    }


class _CpuReader:
    """This process's CPU utilisation per torch thread since the last read."""

    def __init__(self, threads: int):
        import psutil  # noqa: PLC0415  (a dependency; imported here so that a broken install costs the metrics, not the run)

        self.proc = psutil.Process()
        self.threads = max(1, int(threads))
        self.last = (time.monotonic(), self._cpu_seconds())

    def _cpu_seconds(self) -> float:
        t = self.proc.cpu_times()
        return float(t.user + t.system)

    def read(self) -> dict[str, float]:
        now, cpu = time.monotonic(), self._cpu_seconds()
        wall = max(now - self.last[0], 1e-9)
        percent = 100.0 * (cpu - self.last[1]) / wall
        self.last = (now, cpu)
        return {"process_cpu_percent": percent, "busy_percent": percent / self.threads}


class _NvmlReader:
    """One CUDA device through NVML, found by the UUID torch reports (CUDA_VISIBLE_DEVICES safe)."""

    def __init__(self, index: int):
        import pynvml  # noqa: PLC0415  (optional: a missing package costs the metrics, not the run)

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = None
        uuid = _torch_uuid(index)
        if uuid:
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError:
                self.handle = None
        if self.handle is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            physical = int(ids[index]) if index < len(ids) and ids[index].isdigit() else index
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(physical)

    def read(self) -> dict[str, float]:
        n, h = self.nvml, self.handle
        util = n.nvmlDeviceGetUtilizationRates(h)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        out = {
            "busy_percent": float(util.gpu),
            "device_memory_used_gib": mem.used / GIB,
            "device_memory_total_gib": mem.total / GIB,
        }
        with contextlib.suppress(n.NVMLError):  # some parts (and virtualised ones) do not report power
            out["device_power_watts"] = n.nvmlDeviceGetPowerUsage(h) / 1000.0
        return out


class _AmdSmiReader:
    """One ROCm device through amdsmi (the index in amdsmi's processor handle list)."""

    def __init__(self, index: int):
        import amdsmi  # noqa: PLC0415  (optional: a missing package costs the metrics, not the run)

        self.smi = amdsmi
        amdsmi.amdsmi_init()
        handles = amdsmi.amdsmi_get_processor_handles()
        visible = os.environ.get("HIP_VISIBLE_DEVICES", os.environ.get("ROCR_VISIBLE_DEVICES", ""))
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        physical = int(ids[index]) if index < len(ids) and ids[index].isdigit() else index
        self.handle = handles[physical]

    def read(self) -> dict[str, float]:
        s, h = self.smi, self.handle
        out = {"busy_percent": float(s.amdsmi_get_gpu_activity(h)["gfx_activity"])}
        vram = s.amdsmi_get_gpu_vram_usage(h)  # MB
        out["device_memory_used_gib"] = float(vram["vram_used"]) * 2**20 / GIB
        out["device_memory_total_gib"] = float(vram["vram_total"]) * 2**20 / GIB
        power = s.amdsmi_get_power_info(h)
        watts = power.get("current_socket_power", power.get("average_socket_power"))
        if isinstance(watts, (int, float)):
            out["device_power_watts"] = float(watts)
        return out


def _torch_uuid(index: int) -> str | None:
    try:
        import torch  # noqa: PLC0415  (torch: only when a GPU is sampled)

        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # no CUDA build, no device: fall back to the index
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


class SystemMonitor:
    """Samples in a daemon thread; `drain()` hands them to the loop; `stop()` takes a last one."""

    def __init__(
        self,
        interval_seconds: float,
        accelerator: str,
        *,
        device_index: int = 0,
        torch_threads: int = 1,
        report=print,
    ):
        import psutil  # noqa: PLC0415  (optional: a missing package costs the metrics, not the run)

        self._psutil = psutil
        self.interval = float(interval_seconds)
        self.accelerator = accelerator
        self.identity = node_identity()
        self.report = report
        self._proc = psutil.Process()
        self._cpu = _CpuReader(torch_threads)
        self._device = None
        self.device_error: str | None = None
        if accelerator in ("cuda", "rocm"):
            try:
                self._device = (_NvmlReader if accelerator == "cuda" else _AmdSmiReader)(device_index)
            except Exception as exc:  # library missing, no permission, no device: say so once
                tool = "nvidia-ml-py (pynvml)" if accelerator == "cuda" else "amdsmi"
                self.device_error = f"{tool} unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                report(f"system metrics: {self.device_error}; device busy not measured")
        self._t0 = time.monotonic()
        self._samples: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def busy_source(self) -> str:
        if self.accelerator == "cpu":
            return BUSY_SOURCE["cpu"]
        return self.device_error or BUSY_SOURCE[self.accelerator]

    def sample(self) -> dict[str, Any]:
        """One reading of everything; a reader that fails leaves its fields out."""
        row: dict[str, Any] = {"time": time.time(), "elapsed_seconds": time.monotonic() - self._t0, **self.identity}
        cpu = self._cpu.read()
        row["process_cpu_percent"] = cpu["process_cpu_percent"]
        row["process_rss_gib"] = self._proc.memory_info().rss / GIB
        row["host_ram_used_percent"] = float(self._psutil.virtual_memory().percent)
        if self.accelerator == "cpu":
            row["device_busy_percent"] = cpu["busy_percent"]
        elif self._device is not None:
            try:
                device = self._device.read()
            except Exception as exc:  # a transient driver error costs this sample, not the run
                device = {}
                if self.device_error is None:
                    self.device_error = f"read failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    self.report(f"system metrics: {self.device_error}")
            if "busy_percent" in device:
                row["device_busy_percent"] = device.pop("busy_percent")
            row.update(device)
        return row

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            row = self.sample()
            with self._lock:
                self._samples.append(row)

    def start(self) -> SystemMonitor:
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="runner-system-metrics", daemon=True)
            self._thread.start()
        return self

    def drain(self) -> list[dict]:
        with self._lock:
            out, self._samples = self._samples, []
        return out

    def stop(self) -> list[dict]:
        """Stop the thread; the samples not drained yet, plus one covering the last partial period."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            with self._lock:
                self._samples.append(self.sample())
        return self.drain()


def mlflow_metrics(rows: list[dict], accelerator: str) -> dict[str, float]:
    """Means over `rows`, under MLflow's own system-metric names where one exists (its UI's System
    metrics tab); `system/device_busy_percentage` is the run's device-busy figure on any device."""
    names = {
        "device_busy_percent": ["system/device_busy_percentage"],
        "device_memory_used_gib": ["system/gpu_0_memory_usage_megabytes"],
        "device_power_watts": ["system/gpu_0_power_usage_watts"],
        "process_cpu_percent": ["system/cpu_utilization_percentage"],
        "process_rss_gib": ["system/process_memory_usage_megabytes"],
        "host_ram_used_percent": ["system/system_memory_usage_percentage"],
    }
    if accelerator != "cpu":
        names["device_busy_percent"].append("system/gpu_0_utilization_percentage")
    out = {}
    for key, metric_names in names.items():
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        if values:
            mean = sum(values) / len(values)
            for name in metric_names:
                out[name] = mean * 1024.0 if name.endswith("megabytes") else mean
    return out


def system_files(run_dir: Path) -> list[Path]:
    return sorted((Path(run_dir) / "metrics").glob("system-rank*.jsonl"))


#: the sample's figures the summary reads: numbers where present
_SUMMED = ("device_busy_percent", "device_power_watts", "device_memory_used_gib", "process_rss_gib")


def _readable(rows: list) -> tuple[list[dict], int]:
    """The samples of the shape the sampler writes, and how many are not: a line edited or damaged in a
    file (`"device_busy_percent": "x"`, a rank of text) is left out of the summary and counted, instead
    of a traceback at the end of every later attempt of a run that trained."""

    def readable(v: Any) -> bool:
        return v is None or (number(v) and math.isfinite(v))

    good = [
        r
        for r in rows
        if isinstance(r, dict)
        and all(readable(r.get(k)) for k in _SUMMED)
        and whole(r.get("rank", 0))
        and whole(r.get("node_rank", 0))
    ]
    return good, len(rows) - len(good)


def summarize(run_dir: Path, accelerator: str, busy_source: str) -> dict[str, Any]:
    """The run's system record from every rank's samples of every attempt (run.json `system`); samples
    of another shape are left out and counted (`samples_unreadable`, only where there are some)."""
    rows, unreadable = _readable([r for path in system_files(run_dir) for r in read_jsonl(path, skip_torn=True)])
    busy = [float(r["device_busy_percent"]) for r in rows if r.get("device_busy_percent") is not None]
    power = [float(r["device_power_watts"]) for r in rows if r.get("device_power_watts") is not None]
    memory = [float(r["device_memory_used_gib"]) for r in rows if r.get("device_memory_used_gib") is not None]
    nodes: dict[str, list[int]] = {}
    for r in rows:
        ranks = nodes.setdefault(f"{r.get('node')}#{r.get('node_rank', 0)}", [])
        if int(r.get("rank", 0)) not in ranks:
            ranks.append(int(r.get("rank", 0)))
    return {
        "device_busy": sum(busy) / len(busy) / 100.0 if busy else None,
        "device_busy_source": busy_source,
        "accelerator": accelerator,
        "samples": len(rows),
        "device_busy_samples": len(busy),
        "device_memory_used_peak_gib": max(memory) if memory else None,
        "device_power_mean_watts": sum(power) / len(power) if power else None,
        "process_rss_peak_gib": max(
            (float(r["process_rss_gib"]) for r in rows if r.get("process_rss_gib") is not None), default=None
        ),
        "nodes": {k: sorted(v) for k, v in sorted(nodes.items())},
    } | ({"samples_unreadable": unreadable} if unreadable else {})


class SystemMetricsCallback(Callback):
    """Writes each rank's samples to metrics/system-rank<R>.jsonl and logs the main process's means to
    MLflow at the step cadence of the other metrics. `close()` (before the attempt's summary) stops
    the sampler and writes what is left; `on_end` logs it."""

    def __init__(self, monitor: SystemMonitor, run_dir: Path, rank: int, tracker, log_interval_steps: int):
        self.monitor = monitor
        self.path = Path(run_dir) / "metrics" / f"system-rank{rank:05d}.jsonl"
        self.tracker = tracker
        self.every = max(1, int(log_interval_steps))
        self._unlogged: list[dict] = []
        repair_jsonl_tail(self.path)  # a SIGKILL may have torn the last line of an earlier attempt

    def _write(self, rows: list[dict]) -> None:
        if not rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        self._unlogged += rows

    def _log(self, step: int) -> None:
        metrics = mlflow_metrics(self._unlogged, self.monitor.accelerator)
        if self.tracker is not None and metrics:
            self.tracker.log_metrics(metrics, step=step)
        self._unlogged = []

    def on_step(self, record, counters, ratios):
        self._write(self.monitor.drain())
        if record.step % self.every == 0:
            self._log(record.step)

    def close(self) -> None:
        self._write(self.monitor.stop())

    def on_end(self, summary: dict, counters: dict | None = None, ratios: dict | None = None) -> None:
        self._write(self.monitor.stop())
        self._log(int(summary["committed_steps"]))


def system_callback(
    interval_seconds: float,
    accelerator: str,
    *,
    device_index: int,
    torch_threads: int,
    run_dir: Path,
    rank: int,
    tracker,
    log_interval_steps: int,
    report,
) -> SystemMetricsCallback | None:
    """The training loop's system metrics, started; None when switched off (interval 0) or when psutil
    cannot be imported (said once: training goes on without them)."""
    if interval_seconds <= 0:
        return None
    try:
        monitor = SystemMonitor(
            interval_seconds, accelerator, device_index=device_index, torch_threads=torch_threads, report=report
        )
    except ImportError as exc:
        report(f"system metrics: off ({exc}); pip install psutil")
        return None
    return SystemMetricsCallback(monitor.start(), run_dir, rank, tracker, log_interval_steps)


def close_and_summarize(callback: SystemMetricsCallback, barrier, main: bool) -> dict | None:
    """Stop this rank's sampler and write its last samples; after `barrier()` (every rank's written),
    the run's system record on the main process (None elsewhere)."""
    callback.close()
    barrier()
    if not main:
        return None
    return summarize(callback.path.parent.parent, callback.monitor.accelerator, callback.monitor.busy_source)
