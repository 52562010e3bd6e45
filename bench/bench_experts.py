"""Cost of recording expert load, as a fraction of a training step: CPU tiny, extrapolated to the H200.

1. CPU tiny (experiments/cpu-tiny-moe.yaml's model: 2 layers, 8 experts, k 2; 2 micro batches of
   8 x 128 per step), side by side in one process: the same training step (forward, router losses,
   backward, AdamW) alternately with the RouterProbe that records expert load (one index_add_ of
   every layer's routing per micro batch, then per step: the copy to the host, the add to the run's
   totals, the step's balance figures and the SPEC invariant) and with a probe that computes the
   same router losses and records nothing. The difference is the recording's cost.
2. The H200 experiment (experiments/olmoe-1b-7b.yaml: 16 layers, 64 experts, k 8, 128 micro
   batches of 4 x 2048 per step, one domain): a bandwidth estimate (the bytes the recording moves /
   an assumed 10% of the HBM's 4.8 TB/s, scatter-adds being atomics) and, where a CUDA device is
   present, the recording's operations at those shapes timed on it; both against the planned step:
   1,048,576 tokens at the plan's 22,760 tokens/s (18.1% MFU over active parameters: the H200 recipe's
   dense 40% x 0.453 for a mixture of experts, runner.planning.assumptions) = 46.1 s. (On a
   CPU these scatters take seconds per step: a CPU is no stand-in for the H200 here.)

Run: python bench/bench_experts.py [--steps 20]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runner.config.load import load_experiment  # noqa: E402
from runner.planning.plan import build_plan  # noqa: E402
from runner.training import experts  # noqa: E402
from runner.training.expert_load import ExpertLoad  # noqa: E402
from runner.training.model import build_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ONE_PROCESS = type("Acc", (), {"num_processes": 1})()
H200_HBM_BYTES_PER_SECOND = 4.8e12
SCATTER_EFFICIENCY = 0.10  # assumed share of HBM bandwidth an int64 scatter-add (atomics) reaches
# The H200 experiment's step: 16 layers, 64 experts, k 8, 128 micro batches of 4 x 2048 positions.
LAYERS, EXPERTS, K, MICRO, SEQ, ACCUM = 16, 64, 8, 4, 2048, 128
# Per routed (position, expert) pair: stack (read + write an index), key sum (read 3, write 1), ones
# (write), index_add_ (read key and one, read-modify-write the bin): ~10 int64 touches.
BYTES_PER_ROUTED = 10 * 8
H200_BYTES_PER_STEP = ACCUM * LAYERS * MICRO * SEQ * K * BYTES_PER_ROUTED


class Timed(experts.RouterProbe):
    """The trainer's probe, with the time spent recording (counting, committing) summed."""

    seconds = 0.0

    def _count(self, indices):
        t0 = time.perf_counter()
        super()._count(indices)
        self.seconds += time.perf_counter() - t0

    def commit(self, acc):
        t0 = time.perf_counter()
        out = super().commit(acc)
        self.seconds += time.perf_counter() - t0
        return out


class LossesOnly(experts.RouterProbe):
    """The same router losses, no expert load recorded: the baseline."""

    def _count(self, indices):
        pass

    def commit(self, acc):
        self.discard()
        return {}


def _step(model, optimizer, probe, batches, exposure):
    t0 = time.perf_counter()
    for input_ids, domain_ids in batches:
        probe.arm(domain_ids, torch.device("cpu"))
        logits = model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1)[:-1], input_ids.flatten()[1:]) + probe.disarm()
        (loss / len(batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if probe.commit(ONE_PROCESS):  # the trainer checks SPEC's invariant after every committed step
        t1 = time.perf_counter()
        exposure += np.bincount(np.concatenate([d for _, d in batches]), minlength=3) * batches[0][0].shape[1]
        assert not probe.load.broken_invariant(dict(zip(probe.load.domains, exposure.tolist())))
        probe.seconds += time.perf_counter() - t1
    return time.perf_counter() - t0


def cpu_tiny(steps: int) -> tuple[float, float, float]:
    """Median step seconds with recording and without, and the recording's own seconds per step."""
    cfg = load_experiment(REPO / "experiments/cpu-tiny-moe.yaml", check_files=False).config
    torch.manual_seed(0)
    model = build_model(cfg)
    domains, moe = ["code", "legal", "prose"], cfg.model.moe
    routers = [layer.mlp.gate for layer in model.model.layers]
    recording, baseline = (
        probe(
            routers,
            ExpertLoad(domains, cfg.model.n_layers, moe.n_experts, moe.experts_per_token),
            cfg.train.seq_len,
            moe.router_aux_loss_coef,
            moe.router_z_loss_coef,
        )
        for probe in (Timed, LossesOnly)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    micro, seq = cfg.train.micro_batch_sequences, cfg.train.seq_len
    accum = cfg.train.global_batch_sequences // micro
    exposure = np.zeros(3, dtype=np.int64)
    times: dict[str, list[float]] = {"recording": [], "baseline": []}
    for i in range(steps + 2):  # the first pair warms up allocators and kernels
        if i == 2:
            recording.seconds = 0.0
        batches = [
            (torch.as_tensor(rng.integers(1, 4096, (micro, seq))), rng.integers(0, 3, micro)) for _ in range(accum)
        ]
        order = [("recording", recording), ("baseline", baseline)]
        for name, probe in order if i % 2 else order[::-1]:
            dt = _step(model, optimizer, probe, batches, exposure if name == "recording" else exposure.copy())
            if i >= 2:
                times[name].append(dt)
    return statistics.median(times["recording"]), statistics.median(times["baseline"]), recording.seconds / steps


def h200_recording(device: torch.device, repeats: int = 5) -> float:
    """Seconds of one step's recording work at the H200 experiment's shapes, timed on `device`."""
    load = ExpertLoad(["web"], LAYERS, EXPERTS, K)
    probe = experts.RouterProbe([], load, SEQ, 0.01, 0.001)
    indices = [torch.randint(0, EXPERTS, (MICRO * SEQ, K), device=device) for _ in range(LAYERS)]
    domain_ids = np.zeros(MICRO, dtype=np.int64)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_micro = []
    for _ in range(repeats):
        probe.arm(domain_ids, device)
        sync()
        t0 = time.perf_counter()
        probe._count(indices)
        sync()
        per_micro.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(repeats):
        probe.commit(ONE_PROCESS)
        load.broken_invariant({"web": 0})
    per_step = (time.perf_counter() - t0) / repeats
    return ACCUM * statistics.median(per_micro[1:]) + per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (alternating)")
    args = parser.parse_args()

    recording, baseline, own = cpu_tiny(args.steps)
    print(f"CPU tiny (2 layers, 8 experts, k 2, 2 x 8 x 128 positions per step), {args.steps} steps each, 1 thread")
    print(f"  step with expert load recorded  {recording * 1e3:8.1f} ms (median)")
    print(f"  step with router losses only    {baseline * 1e3:8.1f} ms (median)")
    print(f"  ratio                           {recording / baseline:8.4f} (difference of medians: noise-bound)")
    print(
        f"  recording's own time            {own * 1e3:8.3f} ms per step = {own / recording:.3%} of the step (target < 1%)"
    )

    cfg = load_experiment(REPO / "experiments/olmoe-1b-7b.yaml", check_files=False).to_container()
    plan = build_plan(cfg, root=REPO)
    step_seconds = 512 * 2048 / plan["time"]["assumed"]["tokens_per_second"]
    print(
        f"H200 experiment (16 layers, 64 experts, k 8, 128 x 4 x 2048 positions per step); planned step {step_seconds:.1f} s"
    )
    if torch.cuda.is_available():
        measured = h200_recording(torch.device("cuda"))
        print(
            f"  recording on {torch.cuda.get_device_name()} {measured * 1e3:8.1f} ms per step = "
            f"{measured / step_seconds:.3%} (measured; target < 1%)"
        )
    estimate = H200_BYTES_PER_STEP / (H200_HBM_BYTES_PER_SECOND * SCATTER_EFFICIENCY)
    print(
        f"  recording on the H200, estimate {estimate * 1e3:8.1f} ms per step = {estimate / step_seconds:.3%} "
        f"({H200_BYTES_PER_STEP / 1e9:.1f} GB moved at {SCATTER_EFFICIENCY:.0%} of 4.8 TB/s; target < 1%)"
    )


if __name__ == "__main__":
    main()
