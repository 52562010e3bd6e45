"""What a checkpoint stops the loop for, written in the loop (`train.checkpoint.write: foreground`) and
behind it (`background`), side by side.

A Llama of the trainer tests' tiny project made larger (hidden 512, 8 layers: 27M parameters, 330 MB
checkpoints of fp32 weights and AdamW moments), 8 steps with a checkpoint every 2, launched as its own
process once per mode. Prints, per checkpoint, run.json's `t_checkpoint` (the loop's stop) and
`t_checkpoint_write` (the write's own time) and the thread that wrote; and the run's wall and step time.

    python bench/bench_checkpoint.py [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from trainfixtures import env, make_project  # noqa: E402  (the tests' tiny project, on the path just above)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    model = {
        "hidden_size": args.hidden,
        "n_layers": args.layers,
        "n_heads": 8,
        "n_kv_heads": 8,
        "intermediate_size": args.hidden * 8 // 3 // 8 * 8,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("foreground", "background"):
            root = Path(tmp) / mode
            checkpoint = {"interval_steps": 2, "interval_minutes": 0, "keep_last": 2, "write": mode}
            exp = make_project(root, steps=8, model_extra=model, train_extra={"checkpoint": checkpoint})
            run = root / "run"
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "runner", "launch", str(exp), "--run-dir", str(run), "--no-tracking"]
            subprocess.run(cmd, cwd=root, env=env(root), check=True, capture_output=True)
            info = json.loads((run / "run.json").read_text())
            print(
                f"{mode}: launch {time.perf_counter() - t0:.1f} s, wall {info['wall_seconds']:.2f} s, "
                f"step time {info['step_seconds_total']:.2f} s"
            )
            for c in info["checkpoints"]:
                print(
                    f"  step {c['step']}: the loop stopped {c['t_checkpoint']:.3f} s, "
                    f"the write took {c['t_checkpoint_write']:.3f} s ({c['checkpoint_write']})"
                )


if __name__ == "__main__":
    main()
