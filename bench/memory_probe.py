"""Memory plan vs reality at an experiment's own shape: the saved-tensor probe against the planner.

For each micro batch: build the experiment's model on the device (GPU when torch sees one, else the
CPU), run one training forward and backward under the recipe's precision (bf16 autocast on a GPU
recipe, fp32 on a CPU one) through runner.training.memprobe, and print beside each other
- saved activations: the planner's `saved_activation_bytes` vs the bytes of distinct storages
  autograd saved (exact on CPU; this script is what says how exact on a GPU);
- peak (GPU only): torch.cuda.max_memory_allocated over forward and backward vs the planner's
  backward peak less the AdamW moments (no optimizer step is taken here; measured_memory.planned_probe_bytes).
Never trains, writes checkpoints or downloads anything.

    python bench/memory_probe.py --experiment experiments/gpu-smoke.yaml --micro-batches 1,2 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runner.config.load import load_experiment  # noqa: E402
from runner.config.rules import model_vocab_size  # noqa: E402
from runner.planning.measured_memory import planned_probe_bytes  # noqa: E402
from runner.planning.memory import GIB, saved_activation_bytes  # noqa: E402
from runner.training.memprobe import probe_training_forward  # noqa: E402
from runner.training.model import build_model  # noqa: E402


def probe(experiment: Path, micro_batches: list[int]) -> dict:
    exp = load_experiment(experiment, check_files=False)
    cfg = exp.config
    gpu = torch.cuda.is_available() and cfg.hardware.accelerator != "cpu"
    device = torch.device("cuda" if gpu else "cpu")
    autocast = torch.bfloat16 if gpu and cfg.hardware.precision == "bf16" else None
    plain = exp.to_container()
    torch.manual_seed(0)
    with device:  # initialise on the device: 1.2B parameters initialised on a CPU cost seconds
        model = build_model(cfg)
    vocab, seq_len = model_vocab_size(cfg), int(cfg.train.seq_len)
    rows = []
    for micro in micro_batches:
        g = torch.Generator().manual_seed(micro)
        x = torch.randint(0, vocab, (micro, seq_len), generator=g).to(device)
        y = torch.randint(0, vocab, (micro, seq_len), generator=g).to(device)
        mask = torch.ones(micro, seq_len, dtype=torch.bool, device=device)
        if gpu:
            torch.cuda.empty_cache()
        measured = probe_training_forward(model, x, y, mask, autocast_dtype=autocast)
        planned_saved = saved_activation_bytes(plain, micro)["total"]
        rows.append(
            {
                "micro_batch": micro,
                "saved_planned_gib": planned_saved / GIB,
                "saved_probed_gib": measured.activations / GIB,
                "saved_error": planned_saved / measured.activations - 1,
                "weight_copies_probed_gib": measured.weight_copies / GIB,
                "peak_planned_gib": planned_probe_bytes(plain, micro) / GIB if gpu else None,
                "peak_allocated_gib": measured.peak_allocated / GIB if measured.peak_allocated else None,
                "probe": measured.to_dict(),
            }
        )
    return {
        "experiment": str(experiment),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "autocast": str(autocast).replace("torch.", "") if autocast else "fp32",
        "cross_entropy": str(cfg.model.cross_entropy),
        "kernels": str(cfg.model.kernels),
        "seq_len": seq_len,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default=str(ROOT / "experiments" / "gpu-smoke.yaml"))
    ap.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    result = probe(Path(args.experiment), args.micro_batches)
    print(f"memory plan vs probe: {result['experiment']} on {result['device']} ({result['autocast']})")
    print(
        f"{'micro':>5} {'saved plan GiB':>15} {'saved probe GiB':>16} {'error':>8} {'peak plan GiB':>14} {'peak GiB':>9}"
    )
    for r in result["rows"]:
        peak_plan = "-" if r["peak_planned_gib"] is None else f"{r['peak_planned_gib']:.2f}"
        peak = "-" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.2f}"
        print(
            f"{r['micro_batch']:>5} {r['saved_planned_gib']:>15.3f} {r['saved_probed_gib']:>16.3f} "
            f"{r['saved_error']:>+8.2%} {peak_plan:>14} {peak:>9}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
