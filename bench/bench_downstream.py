"""Downstream scoring speed: runner.training.downstream's batched scoring vs a forward-only loop.

Both run over the same padded batches (the same token count and batch shape, in the same order):
the scoring runs the runner's model (RunnerLlama: the lm_head on the continuation positions only)
and adds the fp32 log-softmax over them, the gather and the sums; the forward-only loop runs
`model(input_ids=x).logits` (the head on every position) and nothing else. Prints tokens/s (input
positions fed, padding included) side by side and their ratio (the issue's goal: >= 0.8 on CPU),
the median of `--repeats` runs each, alternated so that a loaded machine slows both alike.

    OMP_NUM_THREADS=1 python bench/bench_downstream.py [--hidden 64] [--layers 2] [--seq-len 128] [--micro-batch 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    from transformers import LlamaConfig

    from runner.config.eval_recipe import DownstreamTask
    from runner.data.builtin.build import TOKENIZER_PATH
    from runner.data.tokenizer import load_tokenizer, vocab_size_of
    from runner.fsio import sha256_file
    from runner.training.downstream.encode import Encoder
    from runner.training.downstream.score import batches, loglikelihoods, mask_kind_of, pack
    from runner.training.downstream.tasks import load_task
    from runner.training.model import RunnerLlama

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tasks", default="builtin,arc_easy", help="of builtin, arc_easy, piqa (comma-separated)")
    ap.add_argument("--no-share", action="store_true", help="one row per request (no context shared by its choices)")
    args = ap.parse_args()

    tok = load_tokenizer(TOKENIZER_PATH)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size_of(tok),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    model = RunnerLlama(config).eval()  # the runner's model: its head scores only the target positions
    olmes = REPO / "tests/assets/downstream/olmes"
    specs = {"builtin": DownstreamTask(format="builtin")}
    for name, folder in (("arc_easy", olmes / "arc_easy_rc_5shot"), ("piqa", olmes / "piqa_rc_0shot")):
        specs[name] = DownstreamTask(
            format="olmes",
            path=str(folder / "requests.jsonl.gz"),
            sha256=sha256_file(folder / "requests.jsonl.gz"),
            config_path=str(folder / "config.json"),
            config_sha256=sha256_file(folder / "config.json"),
        )
    unknown = set(args.tasks.split(",")) - set(specs)
    if unknown:
        raise SystemExit(f"--tasks: no task {', '.join(sorted(unknown))} (known: {', '.join(specs)})")
    encoder = Encoder(tok, args.seq_len)
    specs = {name: specs[name] for name in args.tasks.split(",")}
    encoded = [e for name, spec in specs.items() for e in encoder.encode_task(load_task(name, spec, REPO))]
    share = not args.no_share
    plan = batches(encoded, args.micro_batch, share)
    packed = [pack(encoded, b) for b in plan]
    positions = sum(p.ids.numel() for p in packed)
    kind = mask_kind_of(model) if share else None

    @torch.no_grad()
    def forward_only() -> None:
        for p in packed:
            model(**p.model_kwargs("cpu", kind)).logits  # noqa: B018 (the forward is the work measured)

    def scoring() -> None:
        loglikelihoods(model, encoded, args.micro_batch, share=share)

    times: dict[str, list[float]] = {"scoring": [], "forward only": []}
    forward_only()  # warm-up: allocator, kernels' first calls
    for _ in range(args.repeats):
        for name, fn in (("scoring", scoring), ("forward only", forward_only)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(
        f"{len(encoded)} requests ({', '.join(specs)}), {len(plan)} forwards of <= {args.micro_batch} rows, "
        f"{'choices of one context in one row' if share else 'one row per request'}, "
        f"{positions:,} input positions (padding included); hidden {args.hidden}, {args.layers} layers, "
        f"seq_len {args.seq_len}, {torch.get_num_threads()} threads"
    )
    rates = {name: positions / statistics.median(ts) for name, ts in times.items()}
    for name, rate in rates.items():
        print(
            f"  {name:<13} {rate:>12,.0f} tokens/s   (median of {args.repeats}: {statistics.median(times[name]):.3f} s)"
        )
    print(f"  ratio scoring / forward only: {rates['scoring'] / rates['forward only']:.3f}  (goal >= 0.8)")


if __name__ == "__main__":
    main()
