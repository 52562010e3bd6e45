"""bench/gpu_bench.py --part moe --cpu-tiny: the MoE rows' own code path on a CPU, as CI runs it
(cpu-tiny-moe's model; the compiled rows trace fullgraph with the aot_eager backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_bench_part_moe_measures_every_moe_row_on_cpu(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--part", "moe", "--cpu-tiny", "--out", str(out)]
        + ["--budget-s", "600", "--steps", "1", "--matmul-s", "0.5"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["part"] == "moe" and result["complete"] is True
    rows = {r["variant"]: r for r in result["rows"]}
    assert len(rows) == 7 and all(r["status"] == "ok" for r in rows.values()), rows
    assert {r["extra"]["moe_layer"] for r in rows.values()} == {"runner", "transformers"}
    assert {r["extra"]["activation_checkpointing"] for r in rows.values()} == {"none", "full", "selective"}
    assert {r["compile"] for r in rows.values()} == {"none", "regional"}
    assert {r["micro_batch"] for r in rows.values()} >= {4, 8}
    # active-parameter FLOPs: cpu-tiny-moe's 337,408 active parameters (recipes/model/olmoe-tiny.yaml) x 6 + attention
    assert all(r["extra"]["flops_per_token"] > 6 * 337_408 for r in rows.values())
    assert "moe runner regional selective mb4" in proc.stdout
