"""Fabricate a consistent run folder without training, for report/audit/publish tests.

The folder is what runner.training.loop would leave behind for a tiny 2-device H200 run (run.json
records the devices it held as `devices`, the world size): the real
sampler decides every batch, a real TokenLedger counts it (one step is processed twice to make
`lost` non-zero, as after a crash), and times/MFU/cost come from the real runner.planning.flops and
runner.planning.hardware functions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from runner.config.load import experiment_from_dict
from runner.data.manifest import manifest_sha256, num_samples
from runner.data.sampler import MixtureSampler
from runner.planning.flops import DEFAULT_CONVENTION, flops_per_token
from runner.planning.hardware import convention_record, cost_per_billion_useful_tokens, mfu, resolve_peak

SEQ_LEN = 16
GLOBAL_BATCH = 8
STEPS = 6
# domain -> (target_ratio, max_repetition_ratio, samples, tail tokens)
DOMAINS = {"code": (0.25, 2.0, 15, 3), "math": (0.25, 2.0, 9, 0), "web": (0.5, 1.0, 40, 7)}


def _manifest(domain: str, samples: int, tail: int) -> dict:
    pool_tokens = samples * SEQ_LEN + 1 + tail
    fields = {
        "format": "runner-manifest/1",
        "domain": domain,
        "tokenizer_sha256": "ab" * 32,
        "token_dtype": "uint16",
        "vocab_size": 256,
        "eos_id": 0,
        "shards": [{"path": "train-00000.bin", "tokens": pool_tokens, "documents": 3, "sha256": "cd" * 32}],
        "validation_shards": [{"path": "validation-00000.bin", "tokens": 50, "documents": 1, "sha256": "ef" * 32}],
        "validation": {"fraction": 0.02, "rule": "sha256(id) < fraction"},
        "pool_tokens": pool_tokens,
        "documents": 3,
        "validation_tokens": 50,
        "validation_documents": 1,
        "sources": [{"path": f"{domain}.jsonl", "kind": "jsonl", "sha256": "12" * 32}],
    }
    fields["manifest_sha256"] = manifest_sha256(fields)
    return fields


def config(manifests: dict[str, dict], recipe_devices: int = 2) -> dict:
    """A resolved experiment config in the DESIGN.md shape (tiny model, `recipe_devices` x H200 SXM)."""
    return {
        "name": "fixture",
        "version": "1",
        "description": "fabricated run for report tests",
        "seed": 1234,
        "recipes": {
            "tokenizer": "tiny@1",
            "mixture": "fixture@1",
            "model": "llama-tiny@1",
            "optim": "adamw@1",
            "hardware": "h200x2@1",
            "eval": "small@1",
        },
        "tokenizer": {
            "name": "tiny",
            "version": "1",
            "description": "",
            "path": "tokenizer.json",
            "sha256": "ab" * 32,
            "vocab_size": 256,
            "eos_id": 0,
            "token_dtype": "uint16",
        },
        "mixture": {
            "name": "fixture",
            "version": "1",
            "description": "",
            "domains": {d: {"target_ratio": r, "max_repetition_ratio": cap} for d, (r, cap, _, _) in DOMAINS.items()},
        },
        "data": {
            "manifests": {
                d: {"path": f"data/{d}/manifest.json", "sha256": m["manifest_sha256"]} for d, m in manifests.items()
            }
        },
        "model": {
            "name": "llama-tiny",
            "version": "1",
            "description": "",
            "arch": "llama",
            "hidden_size": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "intermediate_size": 64,
            "tie_embeddings": False,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "init_std": 0.02,
            "attn_implementation": "sdpa",
            "activation_checkpointing": False,
            "compile": False,
        },
        "optim": {
            "name": "adamw",
            "version": "1",
            "description": "",
            "lr": 1e-3,
            "min_lr_ratio": 0.1,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "fused": False,
            "schedule": "cosine",
            "warmup_tokens": 256,
            "decay_fraction": 0.2,
        },
        "hardware": {
            "name": "h200x2",
            "version": "1",
            "description": "",
            "accelerator": "cuda",
            "device_name": "H200 SXM",
            "peak_tflops": None,
            "peak_dtype": "bf16",
            "peak_source": None,
            "memory_gib": 141,
            "price_per_device_hour_usd": 3.5,
            "devices_per_node": recipe_devices,
            "nodes": 1,
            "precision": "bf16",
            "distributed": "ddp",
            "tf32": True,
            "default_mfu": 0.35,
            "pin_memory": True,
            "cpu_peak": None,
        },
        "eval": {
            "name": "small",
            "version": "1",
            "description": "",
            "interval_steps": 3,
            "samples_per_domain": 2,
            "micro_batch_sequences": 2,
            "targets": {  # evaluations at steps 3 and 6 (see make_run's losses)
                "code-5": {"domain": "code", "loss_nats": 5.0},  # met at step 6, bracket 3..6
                "math-first": {"domain": "math", "loss_nats": 5.3},  # met at the first evaluation
                "mean-bpb": {"domain": "mean", "bpb": 2.25},  # met at step 6
                "web-never": {"domain": "web", "loss_nats": 4.0},  # never met: best 4.9 at step 6
            },
        },
        "train": {
            "seq_len": SEQ_LEN,
            "global_batch_sequences": GLOBAL_BATCH,
            "micro_batch_sequences": 2,
            "exposure_tokens": STEPS * GLOBAL_BATCH * SEQ_LEN,
            "max_duration_tokens": STEPS * GLOBAL_BATCH * SEQ_LEN,
            "hard_stop_tokens": None,
            "log_interval_steps": 1,
            "checkpoint": {"interval_steps": 3, "interval_minutes": 30, "keep_last": 2},
        },
        "plan": {
            "checkpoint_overhead_fraction": 0.01,
            "eval_overhead_fraction": 0.02,
            "recovery_overhead_fraction": 0.0,
            "raw_bytes_per_token": 4.0,
            "inference_tokens": 0,
        },
    }


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def make_run(
    root: Path,
    *,
    run_id: str = "20250101-000000-fixture",
    steps: int = STEPS,
    lost_step: int | None = 3,
    recipe_devices: int = 2,
) -> Path:
    """Write runs/fixture/<run_id>/ under `root` and return it. `lost_step` is processed twice.

    The run always holds 2 devices; `recipe_devices` is what the hardware recipe says (1 mimics a
    single-device recipe launched under `torchrun --nproc-per-node 2`).
    """
    from runner.training.ledger import TokenLedger

    root = Path(root)
    manifests = {d: _manifest(d, n, tail) for d, (_, _, n, tail) in DOMAINS.items()}
    cfg = config(manifests, recipe_devices)
    run_dir = root / "runs" / cfg["name"] / run_id
    run_dir.mkdir(parents=True)
    for d, m in manifests.items():
        _write_json(run_dir / "manifests" / f"{d}.json", m)
    (run_dir / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    fp = experiment_from_dict(cfg).fingerprint  # as the runner resolves it (schema defaults filled)
    (run_dir / "fingerprint.txt").write_text(fp + "\n")

    samples = {d: num_samples(m["pool_tokens"], SEQ_LEN) for d, m in manifests.items()}
    ratios = {d: r for d, (r, _, _, _) in DOMAINS.items()}
    sampler = MixtureSampler(samples, ratios, cfg["seed"], GLOBAL_BATCH)
    ledger = TokenLedger(samples, SEQ_LEN)
    typed = experiment_from_dict(cfg).config
    peak = resolve_peak(typed.hardware)
    devices = 2
    fpt = flops_per_token(typed, DEFAULT_CONVENTION, seq_len=SEQ_LEN)

    train_rows, eval_rows, journal = [], [], []
    wall_seconds = step_seconds_total = 0.0
    attempts = [(s, 0) for s in range(steps)]
    if lost_step is not None:
        # The first attempt crashed after processing `lost_step`; the resume redid it.
        attempts = [(s, 0) for s in range(lost_step + 1)] + [(s, 1) for s in range(lost_step, steps)]
    for step, attempt in attempts:
        pairs = sampler.global_batch(step)
        processed = {d: 0 for d in sampler.domains}
        for domain_id, _ in pairs:
            processed[sampler.domains[domain_id]] += SEQ_LEN
        ledger.record_processed(processed)
        journal.append({"attempt": attempt, "step": step, "processed": processed})
        step_seconds = 0.040 + 0.002 * (step % 3)
        step_seconds_total += step_seconds
        wall_seconds += step_seconds + 0.005  # data loading and logging around the step
        if attempt == 0 and step == lost_step:
            wall_seconds += 1.5  # crash detection and restart from the checkpoint
            continue
        ledger.commit(pairs, dict(processed))  # packed pools: every target position counts
        counters = ledger.counters()
        tokens = GLOBAL_BATCH * SEQ_LEN
        train_rows.append(
            {
                "step": step + 1,
                "loss": 5.5 - 0.2 * step,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "step_seconds": step_seconds,
                "wall_seconds": wall_seconds,
                "tokens_processed": tokens,
                "tokens_useful": tokens,
                "tokens_per_second": tokens / step_seconds,
                "mfu": mfu(fpt, tokens, step_seconds, peak.peak_tflops, devices),
                "goodput_mfu": mfu(fpt, counters["total"]["useful"], wall_seconds, peak.peak_tflops, devices),
                "exposure_tokens": int(counters["total"]["exposure"]),
            }
        )
        if (step + 1) % cfg["eval"]["interval_steps"] == 0:
            wall_seconds += 0.3
            for i, d in enumerate(sampler.domains):
                loss = 5.6 - 0.15 * (step + 1) + 0.1 * i
                eval_rows.append(
                    {
                        "step": step + 1,
                        "exposure_tokens": int(counters["total"]["exposure"]),
                        "domain": d,
                        "loss_nats": loss,
                        "bpb": loss / math.log(2) / 3.2,
                        "samples": cfg["eval"]["samples_per_domain"],
                        "tokens": cfg["eval"]["samples_per_domain"] * SEQ_LEN,
                        "useful_tokens": int(counters["total"]["useful"]),
                        "wall_seconds": wall_seconds,
                        "device_wall_seconds": wall_seconds * devices,
                    }
                )

    counters = ledger.counters()
    useful = int(counters["total"]["useful"])
    run = {
        "run_id": run_id,
        "experiment": cfg["name"],
        "fingerprint": fp,
        "mlflow": {"tracking_uri": None, "experiment_id": None, "run_id": None},
        "segments": [
            {
                "index": 0,
                "start_step": 0,
                "max_duration_tokens": cfg["train"]["max_duration_tokens"],
                "fingerprint": fp,
                "started_at": "2025-01-01T00:00:00Z",
            }
        ],
        "status": "finished",
        "committed_steps": steps,
        "devices": devices,
        "conventions": convention_record(DEFAULT_CONVENTION, peak, devices, "step"),
        "wall_seconds": wall_seconds,
        "step_seconds_total": step_seconds_total,
        "exposure_tokens": int(counters["total"]["exposure"]),
        "useful_tokens": useful,
        "processed_tokens": int(counters["total"]["processed"]),
        "lost_tokens": int(counters["total"]["lost"]),
        "mfu": mfu(fpt, counters["total"]["processed"], step_seconds_total, peak.peak_tflops, devices),
        "goodput_mfu": mfu(fpt, useful, wall_seconds, peak.peak_tflops, devices),
        "cost_per_billion_useful_tokens": cost_per_billion_useful_tokens(devices, 3.5, wall_seconds, useful),
    }
    _write_json(run_dir / "run.json", run)

    def plain(x):
        return (
            {str(k): plain(v) for k, v in x.items()}
            if isinstance(x, dict)
            else (int(x) if hasattr(x, "__int__") and not isinstance(x, float) else x)
        )

    _write_json(
        run_dir / "ledger.json",
        {
            "counters": plain(ledger.counters()),
            "histogram": plain(ledger.histogram()),
            "realized_ratios": {d: float(v) for d, v in ledger.realized_ratios().items()},
        },
    )
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    (run_dir / "metrics" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    (run_dir / "journal").mkdir()
    (run_dir / "journal" / "processed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in journal))
    return run_dir


def run_commands(register, argv: list[str]) -> int:
    """Run one verb of a runner/commands module in-process, as the CLI would."""
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)
