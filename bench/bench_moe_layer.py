"""The runner's MoE layer against transformers' OLMoE block on a CPU: forward + backward, side by side.

One process, the same weights and the same input for both, alternating (A B B A ...) so drift on a
shared machine hits both; medians and their ratio printed. Shapes:
1. cpu-tiny-moe (recipes/model/olmoe-tiny.yaml: hidden 64, 8 experts of 64, k 2), 8 x 128 positions;
2. one OLMoE-1B-7B layer's MoE block (hidden 2048, 64 experts of 1024, k 8), few positions (256):
   the expert weights are full size (402M parameters, 1.6 GB fp32), the token count is a CPU's.
Rows: transformers' block with its CPU default (the eager per-expert loop, what CPU runs trained
before) and with its grouped_mm experts (the GPU path, fp32 here); the runner's layer
(runner.training.moe: one grouped matmul per projection). fp32, as CPU runs train. A CPU is no
stand-in for the H200: the figures say the layer is not slower where CI runs it, not what a GPU gains.

Run: python bench/bench_moe_layer.py [--repeats 7]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import OlmoeConfig  # noqa: E402
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock  # noqa: E402

from runner.training.moe.olmoe import runner_moe_block  # noqa: E402

SHAPES = {
    "cpu-tiny-moe (H 64, E 8 x 64, k 2), 8 x 128 positions": dict(hidden=64, experts=8, inter=64, k=2, tokens=1024),
    "one OLMoE-1B-7B layer (H 2048, E 64 x 1024, k 8), 256 positions": dict(
        hidden=2048, experts=64, inter=1024, k=8, tokens=256
    ),
}


def transformers_block(shape: dict, impl: str) -> OlmoeSparseMoeBlock:
    config = OlmoeConfig(
        hidden_size=shape["hidden"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["k"],
        intermediate_size=shape["inter"],
        norm_topk_prob=False,
    )
    config._experts_implementation = impl
    torch.manual_seed(0)
    block = OlmoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block, config


def fwd_bwd_seconds(module, x: torch.Tensor, grad: torch.Tensor) -> float:
    for p in module.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    module(x).backward(grad)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed forward+backward passes per row (after one warm-up)"
    )
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32, forward + backward per pass")
    for title, shape in SHAPES.items():
        eager, config = transformers_block(shape, "eager")
        grouped, _ = transformers_block(shape, "grouped_mm")
        grouped.load_state_dict(eager.state_dict())
        ours = runner_moe_block(transformers_block(shape, "eager")[0], config)
        ours.load_state_dict(eager.state_dict())
        rows = {"transformers eager loop": eager, "transformers grouped_mm": grouped, "runner layer": ours}
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, shape["tokens"], shape["hidden"], generator=gen)
        grad = torch.randn(1, shape["tokens"], shape["hidden"], generator=gen)
        with torch.no_grad():
            ref = eager(x)
            assert torch.allclose(ours(x), ref, rtol=1e-4, atol=1e-5), "the layers disagree"
        times: dict[str, list[float]] = {name: [] for name in rows}
        names = list(rows)
        for i in range(args.repeats + 1):
            for name in names if i % 2 else names[::-1]:
                dt = fwd_bwd_seconds(rows[name], x, grad)
                if i:
                    times[name].append(dt)
        base = statistics.median(times["transformers eager loop"])
        print(f"\n{title}")
        for name in names:
            med = statistics.median(times[name])
            print(f"  {name:26} {med * 1e3:9.2f} ms  ratio to the eager loop {med / base:5.2f}")
        mine, theirs = statistics.median(times["runner layer"]), statistics.median(times["transformers grouped_mm"])
        print(f"  runner layer / transformers grouped_mm: {mine / theirs:.2f}")


if __name__ == "__main__":
    main()
