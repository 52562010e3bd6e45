"""The device check's two ends: what the machine is (`env`), and the one-screen table of what it did (`table`).

`env` writes the environment as JSON: torch and its CUDA/ROCm, the device, its driver, and which
kernels and packages import (Liger, FlashAttention 2/3, Triton, the SDPA kernels that run); `imports`
adds to it where the launch's import seconds go (`-X importtime` by package, CUDA's first use).
`table` reads what bench/device_check.sh left (phases, pytest output, the bench JSON, the memory
probe, the smoke run's run.json and metrics) and writes table.md: markdown ready to paste into
docs/GPU_BENCH.md, with the date, machine, versions, the exact command, the matmul ceiling and its
share of the datasheet peak, tokens/s and MFU per variant, the runner's own MFU against the bench's
row of the same settings, peak memory against the plan, and what failed.
Never measures anything itself (but for the import checks) and never fails on a missing input: a
phase that left nothing is a line saying so.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PACKAGES = {
    "liger_kernel": "liger-kernel",
    "flash_attn": "flash-attn",
    "flash_attn_interface": "flash-attn-3",
    "triton": "triton",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "omegaconf": "omegaconf",
    "pandera": "pandera",
    "mlflow": "mlflow",
    "pynvml": "nvidia-ml-py",
    "amdsmi": "amdsmi",
    "psutil": "psutil",
    # what transformers 5.17 would import into a launch if present (runner.training.hf_models keeps them out
    # of the model modules' import): recorded, so the device's `imports` seconds can be read against them
    "sklearn": "scikit-learn",
    "scipy": "scipy",
    "pandas": "pandas",
}
RUNNER_WITHIN = 0.03  # the issue's goal: the runner's MFU within 3% of the bench's row of the same settings


def _bench_module():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module
    spec.loader.exec_module(module)
    return module


#: kernel packages are imported to see that they load (a broken build is a finding); the rest only looked up
IMPORTED = ("liger_kernel", "flash_attn", "flash_attn_interface", "triton")


def _import_status(module: str, dist: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "missing"
    if module in IMPORTED:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken build is a finding, not a crash
            return f"import fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "importable"


def environment() -> dict[str, Any]:
    import torch

    facts = _bench_module().device_facts()
    facts["packages"] = {dist: _import_status(mod, dist) for mod, dist in PACKAGES.items()}
    kernels = {}
    if torch.cuda.is_available():
        from runner.errors import RunnerError
        from runner.training.accelerator import check_attention_backend, device_identity

        dev = device_identity()
        for kernel in ("flash", "efficient", "cudnn", "math"):
            try:
                check_attention_backend("sdpa", dev, sdpa_kernel=kernel)
                kernels[f"sdpa/{kernel}"] = "runs"
            except RunnerError as exc:
                kernels[f"sdpa/{kernel}"] = exc.detail.split(": ", 1)[-1][:100]
        for backend in ("flash_attention_2", "flash_attention_3"):
            try:
                check_attention_backend(backend, dev)
                kernels[backend] = "runs"
            except RunnerError as exc:
                kernels[backend] = "unavailable: " + exc.detail.split(": ", 2)[-1][:80]
    facts["attention_kernels"] = kernels
    return facts


# ---- where the launch's `imports` part goes --------------------------------------------------------

#: what the launch imports in its `imports` part (runner/training/launch.py), then the device's first use;
#: with RUNNER_PROBE_SETTLE=1, after the runner's bytecode choice, as `runner launch` makes it
IMPORT_PROBE = """
import json, os, sys, time
from runner import bytecode
if os.environ.get("RUNNER_PROBE_SETTLE") == "1":
    bytecode.settle()
state = bytecode.state()
compiled = {n: n not in bytecode.uncompiled([n], dont_write=True) for n in ("torch", "transformers", "runner")}
uncached = bytecode.uncompiled(("torch", "transformers", "runner"), dont_write=sys.dont_write_bytecode)
would = bool(bytecode.uncompiled(bytecode.PROBES, dont_write=sys.dont_write_bytecode))
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import runner.training.loop
t2 = time.perf_counter()
cuda = None
if torch.cuda.is_available():
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    cuda = time.perf_counter() - t2
print(json.dumps({"torch_s": t1 - t0, "runner_s": t2 - t1, "cuda_init_s": cuda,
                  "bytecode": {**state, "beside_the_sources": compiled, "compiled_each_time": uncached,
                               "runner_would_cache": would}}))
"""


def _probe(python: str, *flags: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [python, *flags, "-c", IMPORT_PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, **env},
    )
    return proc, time.perf_counter() - t0


def _last_json(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _error(proc: subprocess.CompletedProcess) -> str:
    return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]


def memory_facts(meminfo: str = "/proc/meminfo") -> dict[str, float] | None:
    """The host's memory in GiB (a VM's can start small and grow): total, available, page cache."""
    try:
        with open(meminfo) as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError, IndexError):
        return None
    names = {"MemTotal": "total_gib", "MemAvailable": "available_gib", "Cached": "cached_gib"}
    return {out: round(kib[k] / 2**20, 1) for k, out in names.items() if k in kib}


def parse_importtime(text: str) -> list[tuple[str, float, float]]:
    """`python -X importtime`'s stderr as (module, self seconds, cumulative seconds), in its order."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:"):
            continue
        parts = line[len("import time:") :].split("|")
        if len(parts) != 3 or not parts[0].strip().isdigit():
            continue  # the header line
        rows.append((parts[2].strip(), int(parts[0]) / 1e6, int(parts[1]) / 1e6))
    return rows


def summarize_imports(rows: list[tuple[str, float, float]], top: int = 10) -> dict[str, Any]:
    """Self time summed by top-level package (the parts add up to the whole import), and the modules
    that cost most in their own body."""
    by_package: dict[str, float] = {}
    for module, own, _ in rows:
        package = module.split(".")[0]
        by_package[package] = by_package.get(package, 0.0) + own
    ranked = sorted(by_package.items(), key=lambda kv: -kv[1])
    return {
        "modules": len(rows),
        "self_seconds": round(sum(own for _, own, _ in rows), 3),
        "by_package": {k: round(v, 3) for k, v in ranked[:top]},
        "heaviest_modules": {m: round(own, 3) for m, own, _ in sorted(rows, key=lambda r: -r[1])[:top]},
    }


def import_profile(python: str = sys.executable, cache: Path | None = None) -> dict[str, Any]:
    """The launch's imports (torch, then `runner.training.loop`) in a fresh process under
    `-X importtime`, then the device's first use (CUDA's initialisation where there is one): which
    package the seconds of run.json's `t_startup.imports` go to. Then why they cost what they do:
    whether torch, transformers and the runner have bytecode beside their sources and whether this
    Python writes any (`bytecode`), the host's memory, the same imports again in a second fresh
    process (`repeat_s`: the page cache and any bytecode written by the first warm), and, where the
    runner would keep bytecode in its own cache (runner.bytecode), the imports with that cache as
    `runner launch` uses it: once filling it, once reading it (`runner_cache`), in `cache` (default:
    a fresh folder under the system's temporary folder, never the user's)."""
    proc, wall = _probe(python, "-X", "importtime")
    if proc.returncode != 0:
        return {"error": _error(proc)}
    out = _last_json(proc)
    facts: dict[str, Any] = {
        "process_seconds": round(wall, 3),
        **{k: (None if v is None else round(v, 3)) for k, v in out.items() if k != "bytecode"},
        **summarize_imports(parse_importtime(proc.stderr)),
        "bytecode": out["bytecode"],
        "memory": memory_facts(),
    }
    again, _ = _probe(python)
    facts["repeat_s"] = (
        round(sum(_last_json(again)[k] for k in ("torch_s", "runner_s")), 3) if again.returncode == 0 else None
    )
    if not out["bytecode"]["runner_would_cache"] or out["bytecode"]["cache"] != "beside the sources":
        facts["runner_cache"] = {
            "skipped": "torch's bytecode is read or written, beside its sources or where PYTHONPYCACHEPREFIX says: "
            "nothing for the runner to cache"
        }
        return facts
    import tempfile  # noqa: PLC0415

    folder = Path(cache) if cache is not None else Path(tempfile.mkdtemp(prefix="runner-pycache-"))
    runs = []
    for _ in ("fill", "read"):
        p, _ = _probe(python, RUNNER_PROBE_SETTLE="1", RUNNER_PYCACHE=str(folder))
        if p.returncode != 0:
            facts["runner_cache"] = {"error": _error(p)}
            return facts
        runs.append(_last_json(p))
    fill, read = runs
    facts["runner_cache"] = {
        "folder": str(folder),
        "fill_s": round(fill["torch_s"] + fill["runner_s"], 3),
        "read_s": round(read["torch_s"] + read["runner_s"], 3),
        "by": read["bytecode"].get("by"),
        "why": read["bytecode"].get("why"),
    }
    return facts


def _imports_lines(facts: dict) -> list[str]:
    imp = facts.get("imports")
    if not imp:
        return []
    if "error" in imp:
        return [f"Imports: the profile failed: {imp['error']}"]
    cuda = imp.get("cuda_init_s")
    return [
        f"Imports (`-X importtime` in a fresh process; the launch's `imports` part): `import torch` "
        f"{imp['torch_s']:.1f} s, then `runner.training.loop` {imp['runner_s']:.1f} s ({imp['modules']} modules)"
        + (f"; the device's first use after them {cuda:.1f} s" if cuda is not None else "")
        + f"; the process {imp['process_seconds']:.1f} s in all. By package (own time): "
        + ", ".join(f"{k} {v:.2f}" for k, v in imp["by_package"].items())
        + ". Heaviest modules: "
        + ", ".join(f"{k} {v:.2f}" for k, v in list(imp["heaviest_modules"].items())[:6])
        + ".",
    ] + _bytecode_lines(imp)


def _bytecode_lines(imp: dict) -> list[str]:
    """Why the imports cost what they do: bytecode, memory, a second process, the runner's cache."""
    code = imp.get("bytecode")
    if not code:
        return []
    beside = code.get("beside_the_sources") or {}
    have = [n for n, ok in beside.items() if ok]
    lack = [n for n, ok in beside.items() if not ok]
    text = (
        "Bytecode: "
        + (f"beside the sources for {', '.join(have)}" if have else "")
        + ("; " if have and lack else "")
        + (f"none beside the sources for {', '.join(lack)}" if lack else "")
        + f"; this Python {'writes' if code.get('written') else 'writes no'} bytecode"
        + (f" (cache: {code['cache']})" if code.get("cache") != "beside the sources" else "")
    )
    if code.get("compiled_each_time"):
        text += f"; every process compiles {', '.join(code['compiled_each_time'])} from source"
    mem = imp.get("memory")
    if mem:
        text += ". Memory: " + ", ".join(f"{k.removesuffix('_gib')} {v:.1f} GiB" for k, v in mem.items())
    if imp.get("repeat_s") is not None:
        text += f". The same imports in a second process: {imp['repeat_s']:.1f} s"
    cache = imp.get("runner_cache") or {}
    if "fill_s" in cache:
        text += (
            f". With the runner's bytecode cache (runner.bytecode, as `runner launch` uses it): "
            f"{cache['fill_s']:.1f} s filling it, then {cache['read_s']:.1f} s reading it"
        )
    elif "error" in cache:
        text += f". The runner's bytecode cache failed: {cache['error']}"
    elif "skipped" in cache:
        text += f". The runner's bytecode cache: not tried ({cache['skipped']})"
    return [text + "."]


# ---- the table ----------------------------------------------------------------------------------


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def steady_steps(rows: list[dict], skip: int = 3) -> list[dict]:
    """Training steps past the first `skip` of each attempt (those pay for compilation and warm-up);
    an attempt starts where the step number goes back (a resume redoes steps after its checkpoint)."""
    out, since_start, last = [], 0, None
    for r in rows:
        step = int(r["step"])
        since_start = 1 if last is None or step <= last else since_start + 1
        last = step
        if since_start > skip:
            out.append(r)
    return out or rows


def runner_figures(work: Path) -> dict[str, Any]:
    run = _read(work / "run" / "run.json") or {}
    rows = _jsonl(work / "run" / "metrics" / "train.jsonl")
    steady = steady_steps(rows)
    out: dict[str, Any] = {"status": run.get("status"), "run": run}
    if steady:
        out["tokens_per_second"] = statistics.median(float(r["tokens_per_second"]) for r in steady)
        out["mfu"] = statistics.median(float(r["mfu"]) for r in steady)
        out["steady_steps"] = len(steady)
        out["data_wait_seconds"] = statistics.median(float(r.get("data_wait_seconds", 0.0)) for r in steady)
        out["step_seconds"] = statistics.median(float(r["step_seconds"]) for r in steady)
    return out


def pytest_summary(text: str) -> tuple[str, list[str]]:
    summary = ""
    for line in text.splitlines()[::-1]:
        if re.search(r"\d+ (passed|failed|skipped|error)", line):
            summary = line.strip("= ").strip()
            break
    failed = [line.split(" - ")[0].replace("FAILED ", "") for line in text.splitlines() if line.startswith("FAILED ")]
    return summary or "no summary (did not run?)", failed


def _bench_lines(bench: dict, failures: list[str]) -> list[str]:
    mm = bench["matmul"]
    rows = bench.get("rows") or []
    partial = (
        f" **partial: the bench stopped after {len(rows)} rows** (killed at its cap; every finished row is here)."
        if bench.get("complete") is False
        else ""
    )
    lines = [
        f"Matmul ceiling ({mm['size']}^3 {mm['dtype']}): best **{mm['best_tflops']:.4g} TFLOP/s**, median "
        f"{mm['median_tflops']:.4g} = {_pct(mm.get('fraction_of_peak'))} of the datasheet "
        f"{_num(bench.get('peak_tflops'), '.1f')} TFLOP/s ({bench.get('peak_source')}).",
        "",
        f"Ladder (1p3b shape unless marked smoke; MFU {bench['convention']['flops_formula']}, "
        f"{bench['convention']['params_counted']}; warmup {bench['warmup_steps']}, up to {bench['timed_steps']} timed steps):"
        + partial,
        "",
        "| variant | mb | tok/s | MFU | of matmul | peak GiB | plan GiB | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["variant"] + (" (smoke shape)" if r.get("shape") == "smoke" else "")
        lines.append(
            f"| {name} | {r['micro_batch']} | {_num(r['tokens_per_second'], ',.0f')} | {_pct(r['mfu'])} | "
            f"{_pct(r['fraction_of_matmul'])} | {_num(r['peak_memory_gib'], '.1f')} | "
            f"{_num(r.get('planned_memory_gib'), '.1f')} | {r['status']} |"
        )
        if r["status"] in ("error", "oom", "timeout"):
            failures.append(f"bench `{r['variant']}`: {r['status']}: {r['detail'][:120]}")
    return lines


RUNNER_PHASES = ("launch-killed", "resume", "audit")


def _startup_and_checkpoint_lines(run: dict) -> list[str]:
    """run.json's `t_startup` (process start to the first step, by part, per attempt) and each
    checkpoint's stall (`t_checkpoint`) and write (`t_checkpoint_write`): the issue-39 goals are a
    start of <= 15 s (compile not counted) and a stall < 1 s for 1p3b-sized checkpoints."""
    lines = []
    t = run.get("t_startup") or {}
    for a in t.get("attempts") or []:
        parts = ", ".join(f"{k} {float(v):.1f}" for k, v in (a.get("parts") or {}).items() if float(v) >= 0.05)
        first = a.get("first_step_seconds")
        pieces = ", ".join(f"{k} {float(v):.1f}" for k, v in (a.get("before_first_step_parts") or {}).items())
        code = a.get("bytecode") or {}
        lines.append(
            f"- attempt {a.get('attempt')}: start **{float(a.get('seconds', 0)):.1f} s** to the first step "
            f"({parts or 'no part'}" + (f"; before_first_step: {pieces}" if pieces else "") + "); "
            f"first step {_num(first, '.1f')} s (compile included, not in the start)"
            + ("; <= 15 s" if float(a.get("seconds", 0)) <= 15 else "; over the 15 s goal")
            + (f"; bytecode: {code['cache']}" if code.get("cache") not in (None, "beside the sources") else "")
            + {True: ", read from it", False: ", compiled into it"}.get(code.get("warm"), "")
            + (f" ({code['why']})" if code.get("why") else "")
        )
    if not lines:
        lines.append("- start: no `t_startup` in run.json (a runner from before it, or no attempt reached a step)")
    ckpts = run.get("checkpoints") or []
    if ckpts:

        def waited(c: dict) -> float:
            return float(c.get("t_checkpoint_waited") or 0)

        stalls = ", ".join(
            f"step {c.get('step')}: {float(c.get('t_checkpoint', 0)):.2f} s"
            + (f" of which {waited(c):.2f} s waiting for the previous write" if waited(c) >= 0.005 else "")
            + f" (write {float(c.get('t_checkpoint_write', 0)):.1f} s, {c.get('checkpoint_write')})"
            for c in ckpts
        )
        worst = max(float(c.get("t_checkpoint", 0)) for c in ckpts)
        own = max(float(c.get("t_checkpoint", 0)) - waited(c) for c in ckpts)
        if worst < 1:
            verdict = "< 1 s"
        elif own < 1:  # the copy is quick; the disk wrote slower than the checkpoints came (run.json says how much)
            verdict = (
                f"**NOT < 1 s** counting the wait for the previous write; without it {own:.2f} s at most, < 1 s "
                "(checkpoints came faster than the disk wrote them: `runner plan` counts max(write - time between, 0))"
            )
        else:
            verdict = "**NOT < 1 s**"
        lines.append(f"- checkpoint stall (t_checkpoint) {stalls}: {verdict}")
    return lines


def _runner_lines(
    figures: dict, bench: dict | None, failures: list[str], check: dict, phases: list[dict] = ()
) -> list[str]:
    ran = {p.get("phase") for p in phases if p.get("rc") is not None}
    if phases and not ran & set(RUNNER_PHASES):
        return ["Runner: the runner's phases (launch-killed, resume, audit) did not run in this call."]
    run = figures.get("run") or {}
    runtime = run.get("runtime") or {}
    system = run.get("system") or {}
    smoke = None
    if bench:
        smoke = next((r for r in bench["rows"] if r.get("shape") == "smoke" and r["status"] == "ok"), None)
    lines = [
        f"Runner: `runner launch {check.get('experiment', '?')}` killed (SIGKILL) in step {check.get('kill_at_step', '?')} "
        f"and resumed: status "
        f"**{figures.get('status')}**, {run.get('committed_steps', '?')} steps, lost tokens {run.get('lost_tokens', '?')}, "
        f"micro batch {runtime.get('micro_batch_sequences')} ({runtime.get('micro_batch_note', 'fixed')}).",
    ]
    if figures.get("mfu") is not None:
        line = (
            f"- steady steps ({figures['steady_steps']}): {figures['tokens_per_second']:,.0f} tok/s, "
            f"MFU **{_pct(figures['mfu'])}**, step {figures['step_seconds']:.3f} s of which waiting for data "
            f"{figures['data_wait_seconds'] * 1e3:.2f} ms"
        )
        if smoke and smoke.get("tokens_per_second"):
            # same model, settings, FLOPs per token and peak: the MFU ratio is the tokens/s ratio
            ratio = figures["tokens_per_second"] / smoke["tokens_per_second"]
            line += (
                f"; bench `{smoke['variant']}` {smoke['tokens_per_second']:,.0f} tok/s, MFU {_pct(smoke['mfu'])}: "
                f"runner / bench {ratio:.3f}"
            )
            if check.get("cpu_tiny") in (1, True, "1"):
                # --cpu-tiny: a shared CPU and a bench of a few timed steps; the 3% check is a device's
                line += " (a CPU stand-in: not checked against the 3% bound)"
            elif abs(ratio - 1) <= RUNNER_WITHIN:
                line += ", within 3%"
            else:
                line += ", NOT within 3%"
                failures.append(f"runner {figures['tokens_per_second']:,.0f} tok/s vs bench (ratio {ratio:.3f})")
        lines.append(line + ".")
    if run:
        lines += _startup_and_checkpoint_lines(run)
    if run.get("mfu") is not None:
        lines.append(
            f"- whole run (compile, checkpoints, the kill and resume included): MFU {_pct(run['mfu'])}, goodput MFU "
            f"{_pct(run.get('goodput_mfu'))}; device busy {_pct(system.get('device_busy'))} "
            f"({system.get('device_busy_source', 'not recorded')}); mean power "
            f"{_num(system.get('device_power_mean_watts'), '.0f')} W; peak device memory "
            f"{_num(system.get('device_memory_used_peak_gib'), '.1f')} GiB."
        )
    return lines


def _probe_lines(probe: dict) -> list[str]:
    lines = [
        f"Memory plan vs probe ({Path(probe['experiment']).name}, {probe['autocast']}, {probe['cross_entropy']} loss):"
    ]
    for r in probe["rows"]:
        peak = (
            f"; peak allocated {r['peak_allocated_gib']:.2f} GiB vs planned {r['peak_planned_gib']:.2f} GiB "
            f"({r['peak_planned_gib'] / r['peak_allocated_gib'] - 1:+.1%})"
            if r.get("peak_allocated_gib")
            else ""
        )
        lines.append(
            f"- micro {r['micro_batch']}: saved activations planned {r['saved_planned_gib']:.3f} GiB, probed "
            f"{r['saved_probed_gib']:.3f} GiB ({r['saved_error']:+.2%}){peak}"
        )
    return lines


def render(out: Path, work: Path, command: str) -> str:
    env = _read(out / "env.json") or {}
    bench = _read(out / "bench.json")
    probe = _read(out / "probe.json")
    phases = _jsonl(work / "phases.jsonl")
    tests, failed_tests = pytest_summary((work / "pytest.txt").read_text() if (work / "pytest.txt").exists() else "")
    failures = [f"test {t}" for t in failed_tests]
    for p in phases:
        if p.get("rc") not in p.get("expected", [0]):
            killed = " killed at its cap" if p.get("note") == "killed at its cap" else ""
            failures.append(f"phase {p['phase']}: exit {p.get('rc')}{killed} (expected {p.get('expected', [0])})")
    pk = env.get("packages", {})
    total = sum(float(p.get("seconds", 0)) for p in phases)
    lines = [
        f"### {env.get('date', '')[:10] or '?'}: {env.get('device_name', '?')} ({env.get('arch')}), "
        f"driver {env.get('driver')}, {env.get('host', '?')}",
        "",
        f"torch {env.get('torch_version')} (CUDA {env.get('cuda_version')}, HIP {env.get('hip_version')}), "
        f"transformers {pk.get('transformers')}, accelerate {pk.get('accelerate')}, liger-kernel {pk.get('liger-kernel')}, "
        f"triton {pk.get('triton')}, flash-attn {pk.get('flash-attn')}, FA3 {pk.get('flash-attn-3')}, "
        f"scikit-learn {pk.get('scikit-learn')}, scipy {pk.get('scipy')}, pandas {pk.get('pandas')}, "
        f"Python {env.get('python')}; attention: "
        + (", ".join(f"{k} {v}" for k, v in (env.get("attention_kernels") or {}).items()) or "-"),
        "",
        f"Command: `{command}`; {total:.0f} s. pytest -m gpu: {tests}. Phases: "
        + ", ".join(
            f"{p['phase']} {p.get('rc')} ({float(p.get('seconds', 0)):.0f} s"
            + (f" of {p['cap']}" if p.get("cap") is not None else "")
            + ")"
            for p in phases
        )
        + ".",
        "",
    ]
    if (work / "budget.md").exists():  # what each phase was allowed, before what it did
        lines += [(work / "budget.md").read_text().strip(), ""]
    if env.get("imports"):
        lines += _imports_lines(env) + [""]
    if bench:
        lines += _bench_lines(bench, failures) + [""]
    else:
        lines += ["Bench: no result (phase did not finish).", ""]
    lines += _runner_lines(runner_figures(work), bench, failures, _read(work / "check.json") or {}, phases) + [""]
    moe = _read(out / "bench-moe.json")
    if moe and moe.get("rows"):
        lines += ["Mixture of experts (`gpu_bench.py --part moe`, MFU over active parameters):", ""]
        lines += [
            f"- {r.get('variant')}: {r.get('status')} {_num(r.get('tokens_per_second'), ',.0f')} tok/s, "
            f"MFU {_pct(r.get('mfu'))}, peak {_num(r.get('peak_memory_gib'), '.1f')} GiB"
            for r in moe["rows"]
        ] + [""]
    if probe:
        lines += _probe_lines(probe) + [""]
    lines += ["What failed: " + ("; ".join(failures) if failures else "nothing.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="write the environment as JSON")
    e.add_argument("--out", required=True)
    i = sub.add_parser("imports", help="add the launch's import profile to an env.json (created if missing)")
    i.add_argument("--out", required=True)
    t = sub.add_parser("table", help="write table.md from what the device check left")
    t.add_argument("--out", required=True, help="the device check's output folder")
    t.add_argument("--work", required=True, help="its work folder (phases, pytest output, the run)")
    t.add_argument("--command", default="bash bench/device_check.sh")
    args = ap.parse_args(argv)
    if args.cmd == "env":
        import datetime as dt

        facts = environment()
        facts["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        Path(args.out).write_text(json.dumps(facts, indent=2, default=str) + "\n")
        print(json.dumps(facts, indent=1, default=str))
        return 0
    if args.cmd == "imports":
        path = Path(args.out)
        facts = _read(path) or {}
        facts["imports"] = import_profile()
        path.write_text(json.dumps(facts, indent=2, default=str) + "\n")
        print("\n".join(_imports_lines(facts)))
        return 0 if "error" not in facts["imports"] else 1
    text = render(Path(args.out), Path(args.work), args.command)
    (Path(args.out) / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
