"""bench/gpu_bench.py at its --cpu-tiny size: the JSON it writes, rows for failures, the budget."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from timeouts import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_bench", None)


@pytest.fixture(scope="module")
def table():
    """bench/device_table.py, loaded as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("device_table", ROOT / "bench" / "device_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    """One standalone run, as a user would start it (a subprocess, not an import)."""
    out = tmp_path_factory.mktemp("bench") / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-tiny", "--out", str(out), "--budget-s", "90", "--matmul-s", "0.5"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_json_records_when_where_and_how(tiny_result):
    result, stdout = tiny_result
    assert result["mode"] == "cpu-tiny" and result["date"]
    for key in ("device_name", "torch_version", "driver", "transformers_version"):
        assert key in result["device"]
    assert result["device"]["torch_version"] == str(torch.__version__)
    assert result["matmul"]["best_tflops"] > 0 and result["matmul"]["best_tflops"] >= result["matmul"]["median_tflops"]
    assert result["flops_formula"].startswith("6N+attn") and result["convention"]["params_counted"] == "non_embedding"
    assert result["elapsed_seconds"] <= result["budget_seconds"]
    assert "variant" in stdout and "wrote" in stdout  # the table was printed


@pytest.mark.slow
def test_measured_rows_are_consistent(tiny_result):
    result, _ = tiny_result
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    assert {r["variant"].split()[0] for r in ok} >= {"plain", "chunked-ce"}  # the first rungs always run
    for r in ok:
        shape = result["smoke_shape"] if r["shape"] == "smoke" else result["model_shape"]
        fpt = result["smoke_flops_per_token"] if r["shape"] == "smoke" else result["flops_per_token"]
        assert r["steps_timed"] >= 1 and r["tokens_per_second"] > 0
        tokens_per_step = r["micro_batch"] * shape["seq_len"]
        assert r["tokens_per_second"] == pytest.approx(tokens_per_step / r["step_seconds"])
        assert r["model_tflops"] == pytest.approx(fpt * r["tokens_per_second"] / 1e12)
        assert r["mfu"] is None  # a CPU has no datasheet peak: never borrow a GPU's
        assert r["planned_memory_gib"] > 0  # the memory plan's figure beside the measurement


@pytest.mark.slow
def test_the_ladder_and_the_smoke_row(tiny_result):
    result, _ = tiny_result
    names = [r["variant"] for r in result["rows"]]
    # what decides first (1p3b's own settings, then the smoke experiment's: no Liger under whole-model
    # compile, which failed on the H200 and is refused), then the ladder
    assert names[0] == "1p3b recipe mb2" and names[1].startswith("gpu-smoke-cpu settings mb")
    assert names[2:5] == ["plain mb2", "liger mb2", "chunked-ce mb2"]
    assert result["complete"] is True and result["part"] == "all"
    smoke = next(r for r in result["rows"] if r["shape"] == "smoke")
    # the CPU stand-in's own settings, as runner launch runs them: chunked loss, fp32, auto micro batch
    assert smoke["variant"].startswith("gpu-smoke-cpu settings") and smoke["cross_entropy"] == "chunked"
    assert smoke["autocast_bf16"] is False and smoke["micro_batch"] == result["smoke_micro_batch"]
    assert result["smoke_shape"]["vocab_size"] == 4096 and result["smoke_shape"]["seq_len"] == 64


@pytest.mark.slow
def test_unavailable_backends_and_skipped_compile_are_rows(tiny_result):
    result, _ = tiny_result
    by_name = {r["variant"].split()[0]: r for r in result["rows"]}
    assert by_name["liger"]["status"] == "unavailable" and "CUDA or ROCm" in by_name["liger"]["detail"]
    assert {r["status"] for r in result["rows"] if r["compile"] != "none"} == {"skipped"}
    for name, why in (("sdpa-efficient", "efficient"), ("fa3", "flash_attention_3")):
        assert by_name[name]["status"] in ("unavailable", "skipped")  # skipped when the budget ran out first
        assert by_name[name]["status"] == "skipped" or why in by_name[name]["detail"]


def test_oom_becomes_a_row_not_a_crash(bench, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")

    monkeypatch.setattr(bench, "build_model", lambda shape, v, device: torch.nn.Linear(2, 2))
    monkeypatch.setattr(bench, "train_step", oom)
    row = bench.run_variant(
        bench.Variant("sdpa-flash mb1", 1),
        bench.TINY_SHAPE,
        torch.device("cpu"),
        deadline=float("inf"),
        warmup_steps=1,
        timed_steps=1,
        fpt=1.0,
        peak_tflops=None,
        ceiling_tflops=None,
    )
    assert row.status == "oom" and "out of memory" in row.detail and row.tokens_per_second is None


def test_spent_budget_skips_variants(bench, tmp_path):
    result = bench.run(bench.parse_args(["--cpu-tiny", "--budget-s", "0.2", "--out", str(tmp_path / "r.json")]))
    statuses = {r["status"] for r in result["rows"]}
    assert statuses == {"skipped"} and any("budget" in r["detail"] for r in result["rows"])


@pytest.mark.parametrize(
    "name,arch,peak",
    [
        ("NVIDIA H200", "sm_90", 989.4),
        ("AMD Instinct MI300X", "gfx942", 1307.4),
        ("", "gfx942", 1307.4),
        ("NVIDIA H100 PCIe", "sm_90", None),
        ("NVIDIA RTX 4090", "sm_89", None),
    ],
)
def test_peak_is_the_datasheet_figure_or_none(bench, name, arch, peak):
    assert bench.datasheet_peak(name, arch)[0] == peak


def test_1p3b_flops_formula(bench):
    fpt, n, formula = bench.flops_per_token(bench.DEFAULT_SHAPE)
    # 24 x (4 x 2048^2 + 3 x 2048 x 5504 + 2 x 2048) + 2048 + 50,304 x 2048 (head; embedding excluded)
    assert n == 24 * (4 * 2048**2 + 3 * 2048 * 5504 + 2 * 2048) + 2048 + 50304 * 2048
    assert fpt == 6 * n + 12 * 24 * 2048 * 2048
    assert f"{n:,}" in formula


def test_shape_comes_from_the_experiment_when_readable(bench, tmp_path):
    shape, source = bench.load_shape(ROOT / "experiments" / "1p3b.yaml")
    assert (shape["hidden_size"], shape["n_layers"], shape["seq_len"]) == (2048, 24, 2048)
    assert shape["vocab_size"] % 64 == 0
    _, fallback = bench.load_shape(tmp_path / "missing.yaml")
    assert fallback.startswith("built-in 1p3b defaults")


@pytest.mark.slow  # 4-6 s: out of the fast subset (under 2 minutes)
def test_a_hung_warm_up_is_cut_at_the_variant_time_box(bench, monkeypatch):
    """A compile that never ends (here: a step that never returns) becomes a `timeout` row at the box."""
    import time

    def hang(*args, **kwargs):
        while True:  # Python between kernels, as compile runs: where the alarm's exception lands
            time.sleep(0.01)

    monkeypatch.setattr(bench, "build_model", lambda shape, v, device: torch.nn.Linear(2, 2))
    monkeypatch.setattr(bench, "train_step", hang)
    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), fused=True)  # its first use imports for seconds
    t0 = time.perf_counter()
    row = bench.run_variant(
        bench.Variant("compile-regional mb1", 1),
        bench.TINY_SHAPE,
        torch.device("cpu"),
        deadline=time.perf_counter() + 2,
        warmup_steps=1,
        timed_steps=1,
        fpt=1.0,
        peak_tflops=None,
        ceiling_tflops=None,
    )
    assert row.status == "timeout" and row.detail.startswith("warm-up (compile) passed the variant's time box")
    assert time.perf_counter() - t0 < 60  # the box (2 s + 1 s grace), not the hang


@pytest.mark.slow
def test_a_bench_killed_at_its_cap_leaves_its_rows_and_the_table_reads_them(tmp_path):
    """SIGKILL (what `timeout` sends at a phase's cap) after the first measured row: bench.json holds
    every row so far, valid JSON marked incomplete, and device_table builds the table from it."""
    import signal
    import time

    out = tmp_path / "out"
    out.mkdir()
    bench_json = out / "bench.json"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--cpu-tiny", "--out", str(bench_json), "--budget-s", "600"]
        + ["--matmul-s", "0.2", "--variant-s", "600"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    rows: list = []
    t0 = time.monotonic()
    while (
        not any(r["status"] == "ok" for r in rows)
        and proc.poll() is None
        and time.monotonic() - t0 < SUBPROCESS_TIMEOUT_S
    ):
        with contextlib.suppress(FileNotFoundError):  # replaced atomically: each read is one whole document
            rows = json.loads(bench_json.read_text())["rows"]
        time.sleep(0.05)
    still_running = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert still_running, proc.stderr.read()[-2000:]  # killed mid-ladder, not after it ended
    result = json.loads(bench_json.read_text())
    assert result["complete"] is False and len(result["rows"]) >= 2  # the first ok row: the smoke settings
    names = [r["variant"] for r in result["rows"]]
    assert names[0] == "1p3b recipe mb2" and names[1].startswith("gpu-smoke-cpu settings mb")
    assert result["matmul"]["best_tflops"] > 0
    work = tmp_path / "work"
    work.mkdir()
    table = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device_table.py"), "table", "--out", str(out), "--work", str(work)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=ROOT,
    )
    assert table.returncode == 0, table.stderr[-2000:]
    text = (out / "table.md").read_text()
    assert f"partial: the bench stopped after {len(result['rows'])} rows" in text
    assert all(f"| {r['variant']}" in text for r in result["rows"])  # a smoke row: "(smoke shape)" after it


@pytest.mark.parametrize("cpu_tiny", [0, 1])
def test_the_runner_against_bench_bound_is_a_device_check_not_a_cpu_one(cpu_tiny, table):
    """Off by 20%: a failure on a device; on the --cpu-tiny stand-in (a few timed steps on a shared
    CPU) the ratio is shown and said to be unchecked, never listed under "What failed"."""
    figures = {"mfu": 0.4, "steady_steps": 5, "tokens_per_second": 800.0, "step_seconds": 1.0, "data_wait_seconds": 0}
    bench = {"rows": [{"shape": "smoke", "status": "ok", "variant": "smoke", "tokens_per_second": 1000.0, "mfu": 0.5}]}
    failures: list[str] = []
    text = "\n".join(table._runner_lines(figures, bench, failures, {"cpu_tiny": cpu_tiny}))
    assert "runner / bench 0.800" in text
    if cpu_tiny:
        assert failures == [] and "not checked against the 3% bound" in text
    else:
        assert failures == ["runner 800 tok/s vs bench (ratio 0.800)"] and "NOT within 3%" in text


def test_the_import_profile_sums_own_time_by_package_as_counted_by_hand(table):
    """`device_table.py imports`: `-X importtime`'s lines summed by top-level package (own time, so the
    packages add up to the whole import), the heaviest modules, and the table's line; a failed probe is
    a line saying so."""
    stderr = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       500 |        500 |   torch._C",
            "import time:      1500 |       2000 | torch",
            "import time:    250000 |     250000 |     transformers.utils",
            "import time:    750000 |    1000000 |   transformers",
            "import time:      3000 |    1005000 | runner.training.loop",
            "something else on stderr",
        ]
    )
    rows = table.parse_importtime(stderr)
    assert rows[0] == ("torch._C", 0.0005, 0.0005) and len(rows) == 5
    s = table.summarize_imports(rows, top=2)
    assert s["by_package"] == {"transformers": 1.0, "runner": 0.003}  # 0.25 + 0.75; torch's 0.0005 + 0.0015 third
    assert s["self_seconds"] == 1.005 and s["modules"] == 5
    assert list(s["heaviest_modules"]) == ["transformers", "transformers.utils"]
    facts = {"imports": {"process_seconds": 2.0, "torch_s": 0.5, "runner_s": 1.2, "cuda_init_s": 0.3, **s}}
    line = table._imports_lines(facts)[0]
    assert "`import torch` 0.5 s, then `runner.training.loop` 1.2 s (5 modules)" in line
    assert "the device's first use after them 0.3 s" in line and "By package (own time): transformers 1.00" in line
    assert table._imports_lines({"imports": {"error": "ModuleNotFoundError: x"}}) == [
        "Imports: the profile failed: ModuleNotFoundError: x"
    ]
    assert table._imports_lines({}) == []


def test_the_import_profile_tries_the_runners_bytecode_cache_only_where_every_process_compiles(table, monkeypatch):
    """Where torch has no bytecode beside its sources and none is written (the runner would cache it),
    the profile runs the imports twice more with runner.bytecode settled as `runner launch` settles it
    (filling a fresh cache folder, then reading it) and the table says both; elsewhere it says why not.
    The probe's processes are stood in for (their real counterpart: tests/training/test_bytecode.py
    and the --cpu-tiny device check)."""
    calls = []

    def probe(compiles):
        def run(python, *flags, **env):
            calls.append((flags, env))
            settled = env.get("RUNNER_PROBE_SETTLE") == "1"
            reading = settled and sum(1 for _, e in calls if e.get("RUNNER_PROBE_SETTLE")) == 2
            out = {
                "torch_s": 1.0 if reading else 6.0 if settled else 5.0,
                "runner_s": 0.5 if reading else 3.0,
                "cuda_init_s": None,
                "bytecode": {
                    "cache": env.get("RUNNER_PYCACHE", "beside the sources") if settled else "beside the sources",
                    "written": settled,
                    **({"by": "runner", "why": "torch: no bytecode beside the sources, and X"} if settled else {}),
                    "beside_the_sources": {"torch": not compiles, "transformers": not compiles, "runner": False},
                    "compiled_each_time": ["torch", "transformers", "runner"] if compiles else ["runner"],
                    "runner_would_cache": compiles,
                },
            }
            err = "import time:      1500 |       2000 | torch" if "importtime" in flags else ""
            return subprocess.CompletedProcess([], 0, stdout=json.dumps(out) + "\n", stderr=err), 9.0

        return run

    monkeypatch.setattr(table, "memory_facts", lambda: {"total_gib": 128.0, "available_gib": 100.0, "cached_gib": 3.0})
    monkeypatch.setattr(table, "_probe", probe(True))
    facts = table.import_profile(cache=Path("/c/pycache"))
    assert [e.get("RUNNER_PROBE_SETTLE") for _, e in calls] == [None, None, "1", "1"]  # profile, again, fill, read
    assert calls[0][0] == ("-X", "importtime") and {e.get("RUNNER_PYCACHE") for _, e in calls[2:]} == {"/c/pycache"}
    assert (
        facts["repeat_s"] == 8.0 and facts["runner_cache"]["fill_s"] == 9.0 and facts["runner_cache"]["read_s"] == 1.5
    )
    line = table._imports_lines({"imports": facts})[1]
    assert line.startswith("Bytecode: none beside the sources for torch, transformers, runner; this Python writes no")
    assert "every process compiles torch, transformers, runner from source" in line
    assert "Memory: total 128.0 GiB, available 100.0 GiB, cached 3.0 GiB" in line
    assert "in a second process: 8.0 s" in line and "9.0 s filling it, then 1.5 s reading it." in line
    calls.clear()
    monkeypatch.setattr(table, "_probe", probe(False))
    facts = table.import_profile()
    assert len(calls) == 2 and "skipped" in facts["runner_cache"]  # bytecode there: nothing to try
    assert "The runner's bytecode cache: not tried" in table._imports_lines({"imports": facts})[1]


def test_the_checkpoint_stall_line_says_what_waited_for_the_previous_write(table):
    """The H200's step-16 stop of 19.92 s was, by its figures, the wait for step 12's write (24.7 s
    against about 4 s of steps between them): with run.json's t_checkpoint_waited the table says so,
    and judges the stall with and without that wait, plainly."""

    def ck(step, stop, waited, write):
        return {"step": step, "t_checkpoint": stop, "t_checkpoint_waited": waited, "t_checkpoint_write": write,
                "checkpoint_write": "background"}  # fmt: skip

    lines = table._startup_and_checkpoint_lines({"checkpoints": [ck(12, 0.07, 0.0, 24.7), ck(16, 19.92, 19.85, 24.5)]})
    assert lines[-1].startswith("- checkpoint stall (t_checkpoint) step 12: 0.07 s (write 24.7 s, background), ")
    assert "step 16: 19.92 s of which 19.85 s waiting for the previous write (write 24.5 s" in lines[-1]
    assert "**NOT < 1 s** counting the wait for the previous write; without it 0.07 s at most, < 1 s" in lines[-1]
    slow = table._startup_and_checkpoint_lines({"checkpoints": [ck(6, 9.7, 0.0, 30.0)]})[-1]
    assert slow.endswith(": **NOT < 1 s**")
    # each attempt's start by part, and before_first_step by piece where run.json has them
    attempt = {"attempt": 1, "seconds": 19.8, "first_step_seconds": 15.0, "parts": {"imports": 13.7, "before_first_step": 4.8},
               "before_first_step_parts": {"compile_wrapping": 0.2, "system_metrics": 4.4, "rest": 0.2}}  # fmt: skip
    start = table._startup_and_checkpoint_lines({"t_startup": {"attempts": [attempt]}})[0]
    assert (
        "(imports 13.7, before_first_step 4.8; before_first_step: compile_wrapping 0.2, system_metrics 4.4, rest 0.2)"
        in start
    )
    assert start.endswith("over the 15 s goal")  # Python's default bytecode: nothing said of it
    # where the runner's bytecode cache was used: whether this attempt compiled into it or read from it
    code = {"cache": "/c/pycache", "written": True, "by": "runner", "why": "torch: no bytecode", "warm": False}
    start = table._startup_and_checkpoint_lines({"t_startup": {"attempts": [{**attempt, "bytecode": code}]}})[0]
    assert start.endswith("over the 15 s goal; bytecode: /c/pycache, compiled into it (torch: no bytecode)")
    # a run.json from before t_checkpoint_waited: the stop as it was recorded
    old = table._startup_and_checkpoint_lines({"checkpoints": [{"step": 6, "t_checkpoint": 0.09}]})[-1]
    assert old.endswith("step 6: 0.09 s (write 0.0 s, None): < 1 s")
