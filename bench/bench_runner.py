"""Runner overhead: `runner launch`'s loop vs a bare PyTorch loop on the same model and batches.

Prints tokens/s side by side and their ratio (target >= 0.95), then the per-step cost of the
runner's own bookkeeping (sampler + batch read, ledger, processed journal, MLflow logging: what the
training thread pays to journal a step's metrics, and what the background thread spends delivering
them) and that cost as a share of the 1p3b step time (planned at the hardware recipe's default MFU).

`--overlap` measures what is left visible of that bookkeeping at 1p3b's own step geometry (global
batch 512 x 2048, 64 micro batches of 8) with the batch read ahead in a background thread and
without: the real `runner.training.loop.train`, its sampler, reader, ledger, journal, metrics files
and MLflow (SQLite, every 10 steps as shipped), with the device replaced by a model whose forward
sleeps a fixed time per micro batch. Visible host time per step = step time - the sleeps; it is
divided by the planned 1p3b step on an H200 (at 50% and at 40% MFU). A sleep releases the GIL,
as a GPU's synchronisation does, but kernel launches hold it: the device check
(bench/device_check.sh) records the real wait for data per step (`data_wait_seconds`) on a GPU.

    python bench/bench_runner.py [--steps 40] [--hidden 128]
    python bench/bench_runner.py --overlap [--overlap-steps 10] [--micro-ms 20]
    OMP_NUM_THREADS=1 python bench/bench_runner.py --ablate --steps 60 --repeats 7   # each part off in turn
    OMP_NUM_THREADS=1 python bench/bench_runner.py [--steps 40] [--hidden 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def project(tmp: Path, steps: int, hidden: int, log_every: int = 1, train_extra: dict | None = None) -> Path:
    from trainfixtures import make_project

    exp = make_project(
        tmp,
        steps=steps,
        seq_len=128,
        global_batch=16,
        micro=8,
        checkpoint_every=10**6,
        train_extra={"log_interval_steps": log_every, **(train_extra or {})},
        eval_every=10**6,
        pools={"a": (0.5, 400_000, 2_000), "b": (0.5, 300_000, 2_000)},
    )
    model = tmp / "recipes" / "model" / "m.yaml"
    body = yaml.safe_load(model.read_text())
    body.update(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 16 * 16, n_heads=4, n_kv_heads=2)
    model.write_text(yaml.safe_dump(body))
    return exp


def rates(ends: list[float], tokens_per_step: int) -> tuple[float, float]:
    """(tokens/s over the whole steady span, tokens/s of the median step) from the times each step
    ended. Steps 1-2 pay for allocator and thread-pool warm-up in both loops: not counted. A step's
    time is everything from the end of the one before (the runner's callbacks, MLflow hand-off and
    progress line included); the median step is what a long run repeats, and on a shared machine it
    hardly moves when a neighbour's burst slows a few steps, which the span's mean cannot ignore."""
    gaps = [b - a for a, b in zip(ends[1:], ends[2:])]
    return tokens_per_step * len(gaps) / (ends[-1] - ends[1]), tokens_per_step / statistics.median(gaps)


def runner_tokens_per_second(exp_path: Path, run_dir: Path, *extra: str) -> tuple[tuple[float, float], list[dict]]:
    from runner.cli import main

    assert main(["launch", str(exp_path), "--run-dir", str(run_dir), *extra]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    return rates([r["wall_seconds"] for r in rows], rows[0]["tokens_processed"]), rows


def runner_cpu_seconds_per_step(short_exp: Path, long_exp: Path, tmp: Path, extra_steps: int) -> float:
    """CPU seconds (every thread of this process: the MLflow delivery thread too) per runner step,
    as the difference of two launches `extra_steps` apart, so start-up and the final report cancel.
    Unlike wall time, it hardly moves when other jobs share the cores."""
    from runner.cli import main

    spent = []
    # The first launch imports what later ones find loaded (report plots, ...): not counted.
    for i, exp_path in enumerate((short_exp, short_exp, long_exp)):
        t = time.process_time()
        assert main(["launch", str(exp_path), "--run-dir", str(tmp / f"cpu-{exp_path.parent.parent.name}-{i}")]) == 0
        spent.append(time.process_time() - t)
    return (spent[2] - spent[1]) / extra_steps


def bare_tokens_per_second(exp, steps: int, cpu: bool = False, runner_loss: bool = False) -> tuple[float, float]:
    """The same model, optimizer, batches and loss with nothing else: no ledger, journal or tracking.
    Tokens per wall second (span, median step: `rates`), or with `cpu` per CPU second of this process.
    `runner_loss`: the loss as the runner computes it (inside the model's forward, masked, per token),
    instead of one cross_entropy over the logits."""
    from runner.training.batches import load_data
    from runner.training.model import build_model
    from runner.training.schedule import make_optimizer

    cfg = exp.config
    B, L, micro = cfg.train.global_batch_sequences, cfg.train.seq_len, cfg.train.micro_batch_sequences
    data = load_data(exp, L)
    batches = [data.reader.read(data.sampler.global_batch(s)) for s in range(steps)]
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    opt = make_optimizer(model, cfg, fused=False)
    model.train()
    marks = []
    clock = time.process_time if cpu else time.perf_counter
    for batch in batches:
        for m in range(B // micro):
            sl = slice(m * micro, (m + 1) * micro)
            if runner_loss:
                mask = torch.ones_like(batch.labels[sl], dtype=torch.bool)
                summed = model(input_ids=batch.input_ids[sl], loss_targets=batch.labels[sl], loss_mask=mask)
                loss = summed / (B * L)
            else:
                logits = model(input_ids=batch.input_ids[sl]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels[sl].flatten(), reduction="sum")
                loss = loss / (B * L)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(clock())
    return rates(marks, B * L)


def bookkeeping_seconds(exp, tmp: Path, steps: int) -> dict[str, float]:
    """Per-step seconds of what the runner adds, each timed alone at this experiment's batch."""
    from runner.training.batches import domain_positions, load_data
    from runner.training.ledger import TokenLedger
    from runner.training.tracking import Tracker

    cfg = exp.config
    L = cfg.train.seq_len
    data = load_data(exp, L)
    ledger = TokenLedger(data.samples, L)
    out = {}
    t = time.perf_counter()
    pairs = [data.sampler.global_batch(s) for s in range(steps)]
    out["sampler"] = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    for p in pairs:
        data.reader.read(p)
    out["batch_read"] = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    with open(tmp / "journal.jsonl", "a") as journal:
        for p in pairs:
            processed = domain_positions(p, data.domains, L)
            ledger.record_processed(processed)
            journal.write(json.dumps({"attempt": 1, "step": 0, "processed": processed}) + "\n")
            journal.flush()
            ledger.commit(p, {d: n for d, n in processed.items()})
            ledger.counters()
    out["ledger+journal"] = (time.perf_counter() - t) / steps
    tracker = Tracker(tmp / "trk", tracking_uri=f"sqlite:///{tmp / 'bench-mlflow.db'}")
    tracker.start("bench", "bench", params=None, tags={})
    tracker.flush()  # the store's creation is start-up, not a step
    t = time.perf_counter()
    for s in range(steps):
        tracker.log_metrics({f"m{i}": float(i) for i in range(32)}, step=s)
    out["mlflow: journal + hand-off"] = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    tracker.flush()  # what the delivery thread does off the step, all at once here
    out["mlflow: delivery (background)"] = (time.perf_counter() - t) / steps
    tracker.close()
    return out


def planned_1p3b_step_seconds() -> tuple[float, dict]:
    from runner.config.load import load_experiment
    from runner.planning.flops import flops_per_token
    from runner.planning.hardware import resolve_peak

    exp = load_experiment(REPO / "experiments" / "1p3b.yaml", check_files=False)
    cfg = exp.config
    tokens = cfg.train.global_batch_sequences * cfg.train.seq_len
    peak = resolve_peak(cfg.hardware)
    return flops_per_token(cfg) * tokens / (peak.peak_tflops * 1e12 * cfg.hardware.default_mfu), cfg


class SleepingDevice(torch.nn.Module):
    """Stands in for the GPU: each training forward takes `seconds`, GIL released, and returns a loss
    with a gradient (zero) so the optimizer, clipping and checkpoints run as usual."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.slept: list[float] = []  # what each sleep really took (a loaded machine oversleeps)
        self.spans: list[tuple[float, float]] = []  # (start, end) of each forward
        self.w = torch.nn.Parameter(torch.zeros(8))

    def forward(self, input_ids=None, loss_targets=None, loss_mask=None, **kwargs):
        t0 = time.perf_counter()
        time.sleep(self.seconds)
        t1 = time.perf_counter()
        self.slept.append(t1 - t0)
        self.spans.append((t0, t1))
        return self.w.sum() * 0.0 + 10.0 * float(loss_mask.sum())


def overlap_run(tmp: Path, prefetch: int, steps: int, micro_seconds: float) -> dict:
    """The trainer at 1p3b's step geometry on a sleeping device; per-step visible host seconds."""
    from accelerate import Accelerator
    from trainfixtures import make_project

    import runner.training.model as model_module
    from runner.config.load import load_experiment
    from runner.training.loop import Options, train
    from runner.training.tracking import Tracker

    root = tmp / f"prefetch{prefetch}"
    exp_path = make_project(
        root,
        steps=steps,
        seq_len=2048,
        global_batch=512,
        micro=8,
        checkpoint_every=10**6,
        eval_every=10**6,
        train_extra={"log_interval_steps": 10, "prefetch_batches": prefetch, "system_metrics_interval_seconds": 10.0},
        pools={"a": (0.5, 6_000 * 2048, 0), "b": (0.3, 4_000 * 2048, 0), "c": (0.2, 3_000 * 2048, 0)},
    )
    exp = load_experiment(exp_path)
    build = model_module.build_model
    device = SleepingDevice(micro_seconds)
    model_module.build_model = lambda cfg: device
    try:
        run_dir = root / "runs" / "r"
        from runner.runs.folder import create_run_folder

        create_run_folder(exp, run_dir, "r")
        tracker = Tracker(run_dir, tracking_uri=f"sqlite:///{tmp / 'overlap-mlflow.db'}")
        tracker.start("overlap", f"prefetch{prefetch}", params=None, tags={})
        train(exp, run_dir, Accelerator(cpu=True), tracker, Options(report=lambda m: None))
    finally:
        model_module.build_model = build
    rows = [json.loads(x) for x in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    slept = [sum(device.slept[64 * i : 64 * (i + 1)]) for i in range(len(rows))]
    steady = list(zip(rows, slept))[2:]
    # Between the last forward of step k and the first of step k+1: clipping, the optimizer step, the
    # ledger, metrics, callbacks and the next batch. A GPU idles there; within a step it does not,
    # because the host queues kernels ahead of it.
    gaps = [device.spans[64 * (i + 1)][0] - device.spans[64 * i + 63][1] for i in range(2, len(rows) - 1)]
    return {
        "boundary": statistics.median(gaps),
        "visible": statistics.median(r["step_seconds"] - s for r, s in steady),
        "data_wait": statistics.median(r["data_wait_seconds"] for r, _ in steady),
        "step": statistics.median(r["step_seconds"] for r, _ in steady),
        "device": statistics.median(s for _, s in steady),
    }


def overlap_main(steps: int, micro_ms: float) -> int:
    from runner.config.load import load_experiment
    from runner.planning.flops import flops_per_token
    from runner.planning.hardware import resolve_peak

    cfg = load_experiment(REPO / "experiments" / "1p3b.yaml", check_files=False).config
    tokens = int(cfg.train.global_batch_sequences) * int(cfg.train.seq_len)
    peak = resolve_peak(cfg.hardware).peak_tflops * 1e12
    planned = {mfu: flops_per_token(cfg) * tokens / (peak * mfu) for mfu in (0.5, 0.4)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs = {p: overlap_run(tmp, p, steps, micro_ms / 1e3) for p in (0, 1)}
    print(
        f"1p3b step geometry: 512 x 2048 tokens, 64 micro batches of 8, device = {micro_ms:g} ms sleep per micro "
        f"batch ({64 * micro_ms / 1e3:.2f} s per step); {steps} steps, median of steps 3..{steps}"
    )
    print(
        f"planned 1p3b step on {cfg.hardware.device_name}: {planned[0.5]:.1f} s at 50% MFU, {planned[0.4]:.1f} s at 40%"
    )
    print(
        "all host ms: every host millisecond of a step outside the forwards (an upper bound: as if the device "
        "waited for each)\nboundary ms: host time between the last forward of a step and the first of the next "
        "(what a GPU, fed ahead within a step, waits for)"
    )
    print(
        f"{'batch read':<20}{'step s':>8}{'data wait ms':>14}{'all host ms':>13}{'@50% MFU':>10}"
        f"{'boundary ms':>13}{'@50% MFU':>10}{'@40%':>8}"
    )
    for p, r in runs.items():
        name = "ahead (thread, 1)" if p else "in the step (0)"
        print(
            f"{name:<20}{r['step']:>8.3f}{r['data_wait'] * 1e3:>14.2f}{r['visible'] * 1e3:>13.1f}"
            f"{r['visible'] / planned[0.5]:>10.3%}{r['boundary'] * 1e3:>13.1f}{r['boundary'] / planned[0.5]:>10.3%}"
            f"{r['boundary'] / planned[0.4]:>8.3%}"
        )
    return 0


#: the runner with one of its background or per-step parts off: (train section overrides, launch flags)
ABLATIONS = {
    "runner as shipped (MLflow every 10)": ({}, ()),
    "  read-ahead off (prefetch 0)": ({"prefetch_batches": 0}, ()),
    "  system metrics off": ({"system_metrics_interval_seconds": 0}, ()),
    "  MLflow off (--no-tracking)": ({}, ("--no-tracking",)),
    "  all three off": ({"prefetch_batches": 0, "system_metrics_interval_seconds": 0}, ("--no-tracking",)),
}


def ablation_main(steps: int, hidden: int, repeats: int) -> int:
    """Where the runner's time goes: each part switched off in turn, and the bare loop with the
    runner's loss path, every one against the bare loops of its own repeat (median step ratios)."""
    from runner.config.load import load_experiment

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
        exps = {
            name: project(tmp / f"v{i}", steps, hidden, 10, extra)
            for i, (name, (extra, _)) in enumerate(ABLATIONS.items())
        }
        exp = load_experiment(exps[next(iter(ABLATIONS))])
        runner_tokens_per_second(exps[next(iter(ABLATIONS))], tmp / "warm")  # imports, plots: not counted
        ratios: dict[str, list[float]] = {"bare, the runner's loss path": []} | {name: [] for name in ABLATIONS}
        for r in range(repeats):
            before = bare_tokens_per_second(exp, steps)[1]
            got = {"bare, the runner's loss path": bare_tokens_per_second(exp, steps, runner_loss=True)[1]}
            for i, (name, (_, flags)) in enumerate(ABLATIONS.items()):
                got[name] = runner_tokens_per_second(exps[name], tmp / f"run{i}-{r}", *flags)[0][1]
            after = bare_tokens_per_second(exp, steps)[1]
            for name, tps in got.items():
                ratios[name].append(tps / statistics.mean([before, after]))
    print(
        f"model: 2 layers, hidden {hidden}; 16 x 128 tokens per step; {steps} steps; {repeats} repeats; "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'loop':<40}{'median step / bare':>20}   runs")
    for name, rs in ratios.items():
        print(f"{name:<40}{statistics.median(rs):>20.3f}   {', '.join(f'{x:.3f}' for x in rs)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument(
        "--log-every",
        default="1,10",
        help="MLflow logging intervals to compare (steps); the shipped recipes log every 10",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="alternate bare and runner loops this many times; ratios are medians (a noisy machine)",
    )
    ap.add_argument("--ablate", action="store_true", help="only the runner with each of its parts off, vs bare")
    ap.add_argument("--overlap", action="store_true", help="only the read-ahead measurement at 1p3b's step geometry")
    ap.add_argument("--overlap-steps", type=int, default=10)
    ap.add_argument("--micro-ms", type=float, default=20.0, help="the sleeping device's time per micro batch")
    args = ap.parse_args()
    if args.overlap:
        return overlap_main(args.overlap_steps, args.micro_ms)
    if args.ablate:
        return ablation_main(args.steps, args.hidden, args.repeats)
    intervals = [int(x) for x in args.log_every.split(",")]
    from runner.config.load import load_experiment

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp / 'mlflow.db'}"
        exps = {n: project(tmp / f"log{n}", args.steps, args.hidden, log_every=n) for n in intervals}
        exp = load_experiment(exps[intervals[0]])
        # [0]: tokens/s over the steady span, [1]: of the median step (see `rates`)
        bares: list[tuple[float, float]] = []
        ours: dict[int, list[tuple[float, float]]] = {n: [] for n in intervals}
        ratios: dict[int, list[tuple[float, float]]] = {n: [] for n in intervals}
        for r in range(args.repeats):
            # bare, runner(s), bare: each runner figure against the mean of the bare loops around it
            before = bare_tokens_per_second(exp, args.steps)
            runs = {n: runner_tokens_per_second(exps[n], tmp / f"run{n}-{r}")[0] for n in intervals}
            after = bare_tokens_per_second(exp, args.steps)
            bares += [before, after]
            for n, tps in runs.items():
                ours[n].append(tps)
                ratios[n].append(
                    (tps[0] / statistics.mean([before[0], after[0]]), tps[1] / statistics.mean([before[1], after[1]]))
                )
        bare = [statistics.median(b[i] for b in bares) for i in (0, 1)]
        # The same comparison in CPU seconds: what each loop costs, whoever else uses the cores.
        tokens_per_step = int(exp.config.train.global_batch_sequences) * int(exp.config.train.seq_len)
        bare_cpu = bare_tokens_per_second(exp, args.steps, cpu=True)[0]
        cpu_ratios = {}
        for n in intervals:
            short = project(tmp / f"cpu-short{n}", args.steps, args.hidden, log_every=n)
            long = project(tmp / f"cpu-long{n}", 2 * args.steps, args.hidden, log_every=n)
            per_step = runner_cpu_seconds_per_step(short, long, tmp, args.steps)
            cpu_ratios[n] = tokens_per_step / per_step / bare_cpu
        book = bookkeeping_seconds(exp, tmp, args.steps)
        step_1p3b, cfg = planned_1p3b_step_seconds()
    print(
        f"model: 2 layers, hidden {args.hidden}; 16 x 128 tokens per step; {args.steps} steps; "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'loop':<30}{'tokens/s, median step':>22}{'steady span':>13}")
    print(f"{'bare PyTorch':<30}{bare[1]:>22,.0f}{bare[0]:>13,.0f}")
    for n, tps in ours.items():
        med = [statistics.median(x[i] for x in ratios[n]) for i in (0, 1)]
        runs = [", ".join(f"{x[i]:.3f}" for x in ratios[n]) for i in (0, 1)]
        print(
            f"{f'runner, MLflow every {n} step' + ('s' if n > 1 else ''):<30}"
            f"{statistics.median(x[1] for x in tps):>22,.0f}{statistics.median(x[0] for x in tps):>13,.0f}"
        )
        print(
            f"  ratio runner / bare: median step {med[1]:.3f} (runs: {runs[1]}) (target >= 0.95); "
            f"steady span {med[0]:.3f} (runs: {runs[0]}); in CPU seconds {cpu_ratios[n]:.3f}"
        )
    print(
        f"\nrunner bookkeeping per step at 16 x 128 (1p3b step: {cfg.train.global_batch_sequences} x "
        f"{cfg.train.seq_len}, planned {step_1p3b:.2f} s at MFU {cfg.hardware.default_mfu:.0%} "
        f"on {cfg.hardware.device_name})"
    )
    # The sampler and ledger grow with sequences per step, the batch read with tokens per step.
    scale = {
        "sampler": cfg.train.global_batch_sequences / 16,
        "ledger+journal": cfg.train.global_batch_sequences / 16,
        "batch_read": cfg.train.global_batch_sequences * cfg.train.seq_len / (16 * 128),
    }
    for name, sec in book.items():
        at_1p3b = sec * scale.get(name, 1.0)
        print(
            f"  {name:<28}{sec * 1e3:>9.3f} ms   ~{at_1p3b * 1e3:>8.2f} ms at 1p3b = {at_1p3b / step_1p3b:.3%} of its step"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
