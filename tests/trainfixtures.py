"""A tiny self-contained project for trainer tests: recipes, an experiment, random-token pools.

Pools are random ids from the built-in tokenizer's vocabulary (the trainer does not care what the
text says, and random tokens keep the data a few kilobytes). The model is a 2-layer Llama with
hidden size 32; a step takes milliseconds on one core.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import yaml
from timeouts import SUBPROCESS_TIMEOUT_S

from runner.data.manifest import write_manifest
from runner.fsio import sha256_file

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "runner" / "builtin" / "assets" / "tokenizer.json"
VOCAB = 4096


def write_pool(folder: Path, domain: str, train_tokens: int, val_tokens: int, seed: int) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards = {}
    for split, n in (("train", train_tokens), ("validation", val_tokens)):
        if n == 0:
            shards[split] = []
            continue
        path = folder / f"{split}-00000.bin"
        rng.integers(1, VOCAB, size=n, dtype=np.uint16).tofile(path)
        shards[split] = [{"path": path.name, "tokens": n, "documents": 1, "sha256": sha256_file(path)}]
    fields = {
        "format": "runner-manifest/1",
        "domain": domain,
        "tokenizer_sha256": sha256_file(TOKENIZER),
        "token_dtype": "uint16",
        "vocab_size": VOCAB,
        "eos_id": 0,
        "shards": shards["train"],
        "validation_shards": shards["validation"],
        "validation": {"fraction": 0.1, "rule": "test"},
        "pool_tokens": train_tokens,
        "documents": 1,
        "validation_tokens": val_tokens,
        "validation_documents": 1 if val_tokens else 0,
        "sources": [],
    }
    return folder / "manifest.json", write_manifest(folder / "manifest.json", fields)


def make_project(
    root: Path,
    *,
    steps: int = 8,
    seq_len: int = 16,
    global_batch: int = 8,
    micro: int = 4,
    lr: float = 3e-3,
    checkpoint_every: int = 2,
    keep_last: int = 3,
    eval_every: int = 4,
    pools: dict | None = None,
    train_extra: dict | None = None,
    model_extra: dict | None = None,
    name: str = "t",
) -> Path:
    """Write recipes/, experiments/<name>.yaml and data/ under `root`; returns the experiment path."""
    pools = pools or {"a": (0.5, 4000, 400), "b": (0.5, 3000, 300)}
    recipes = {
        "tokenizer": {
            "name": "tok",
            "version": 1,
            "description": "built-in",
            "path": str(TOKENIZER),
            "sha256": sha256_file(TOKENIZER),
            "vocab_size": VOCAB,
            "eos_id": 0,
            "token_dtype": "uint16",
        },
        "mixture": {
            "name": "mix",
            "version": 1,
            "description": "two domains",
            "domains": {d: {"target_ratio": r, "max_repetition_ratio": 50.0} for d, (r, _, _) in pools.items()},
        },
        "model": {
            "name": "m",
            "version": 1,
            "description": "tiny",
            "hidden_size": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "intermediate_size": 64,
            "tie_embeddings": True,
            **(model_extra or {}),
        },
        "optim": {
            "name": "o",
            "version": 1,
            "description": "adamw",
            "lr": lr,
            "schedule": "cosine",
            "warmup_tokens": 2 * global_batch * seq_len,
        },
        "hardware": {
            "name": "cpu",
            "version": 1,
            "description": "test cpu",
            "accelerator": "cpu",
            "device_name": "cpu",
            "peak_tflops": 0.05,
            "peak_dtype": "fp32",
            "peak_source": "test figure",
            "memory_gib": 4,
            "price_per_device_hour_usd": 0.1,
            "precision": "fp32",
            "tf32": False,
            "pin_memory": False,
        },
        "eval": {
            "name": "e",
            "version": 1,
            "description": "eval",
            "interval_steps": eval_every,
            "samples_per_domain": 8,
            "micro_batch_sequences": 8,
        },
    }
    refs = {}
    for kind, body in recipes.items():
        folder = root / "recipes" / kind
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{body['name']}.yaml").write_text(yaml.safe_dump(body))
        refs[kind] = f"{body['name']}@1"
    manifests = {}
    for i, (d, (_, train_tokens, val_tokens)) in enumerate(pools.items()):
        path, sha = write_pool(root / "data" / d, d, train_tokens, val_tokens, seed=i)
        manifests[d] = {"path": str(path), "sha256": sha}
    train = {
        "seq_len": seq_len,
        "global_batch_sequences": global_batch,
        "micro_batch_sequences": micro,
        "exposure_tokens": steps * global_batch * seq_len,
        "log_interval_steps": 1,
        "checkpoint": {"interval_steps": checkpoint_every, "interval_minutes": 0, "keep_last": keep_last},
    }
    train.update(train_extra or {})
    exp = {
        "name": name,
        "version": 1,
        "description": "trainer test",
        "seed": 7,
        "recipes": refs,
        "train": train,
        "data": {"manifests": manifests},
    }
    (root / "experiments").mkdir(parents=True, exist_ok=True)
    path = root / "experiments" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(exp, sort_keys=False))
    return path


def env(tmp: Path, **extra) -> dict:
    """Subprocess environment: one thread (shared cores; also the bit-identity reference), local MLflow."""
    e = dict(os.environ)
    e.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp / 'mlflow.db'}",
        PYTHONUNBUFFERED="1",
    )
    e.update({k: str(v) for k, v in extra.items()})
    return e


def launch(
    tmp: Path,
    *args,
    check: bool = True,
    timeout: float = SUBPROCESS_TIMEOUT_S,
    in_process: bool | None = None,
    **env_extra,
) -> subprocess.CompletedProcess:
    """`runner launch ARGS` from `tmp`. In this process (seconds less per launch: torch,
    transformers and mlflow are imported already) unless it must die as a process does
    (`--kill-at-step`) or `in_process=False` asks for a process of its own."""
    argv = ["launch", *map(str, args)]
    if in_process is None:
        in_process = "--kill-at-step" not in argv
    if in_process:
        proc = run_in_process(tmp, argv, env(tmp, **env_extra))
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "runner", *argv],
            cwd=tmp,
            env=env(tmp, **env_extra),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"launch exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_in_process(cwd: Path, argv: list[str], environ: dict) -> subprocess.CompletedProcess:
    """`runner ARGV` as a subprocess would run it (its environment and folder, one thread, output
    captured, an unexpected exception printed with exit 1), in this process; everything it
    changed that outlives a run (environment, folder, threads, determinism, accelerate's
    singleton state) is put back."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from runner.cli import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    threads = torch.get_num_threads()
    deterministic = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    out, err = io.StringIO(), io.StringIO()
    AcceleratorState._reset_state(reset_partial_state=True)  # whatever an earlier test made of it
    GradientState._reset_state()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 of a subprocess: the bit-identity reference
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return subprocess.CompletedProcess(["runner", *argv], code, out.getvalue(), err.getvalue())


def check_pr(cwd: Path) -> subprocess.CompletedProcess:
    """`runner check-pr --base main` in `cwd` (a git repository with a `main` branch), in this process."""
    return run_in_process(cwd, ["check-pr", "--base", "main"], dict(os.environ))


def step_record(step: int, **fields):
    """A committed step's record as the loop hands it to callbacks: `fields` given, every other figure 0."""
    from runner.runs.steprecord import StepRecord  # noqa: PLC0415 (only the callback tests need it)

    zeros = dict.fromkeys(
        ("loss", "lr", "grad_norm", "step_seconds", "data_wait_seconds", "wall_seconds", "tokens_per_second"), 0.0
    )
    zeros.update(dict.fromkeys(("tokens_per_second_useful", "mfu", "goodput_mfu"), 0.0))
    zeros.update(dict.fromkeys(("devices", "tokens_processed", "tokens_useful", "exposure_tokens"), 0))
    return StepRecord(step=step, **(zeros | fields))
