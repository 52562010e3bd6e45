"""Prepare throughput vs raw `tokenizers` encode_batch, same text, same cores, side by side.

    python bench/bench_prepare.py [--mb 32] [--workers 2] [--batch-docs 256] [--repeats 3]

Raw: Tokenizer.encode_batch over the documents already in memory, with the tokenizers thread
pool limited to --workers threads. Prepare: the whole `runner.data.prepare.prepare` call on the same
documents stored as jsonl (reading, worker start-up, tokenizing, shard writing, hashing,
manifest) with --workers processes. The two alternate --repeats times and each keeps its best
time (shared machines are noisy). Prints tokens/s for both and their ratio (target >= 0.85).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=32, help="raw text size in MB")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="cores for both sides")
    ap.add_argument("--batch-docs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs; best time of each kept")
    args = ap.parse_args()
    # Must be set before tokenizers starts its thread pool: the raw side gets the same cores.
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)

    import gzip
    import json

    import pyarrow.parquet as pq

    from runner.data.builtin.build import ASSETS, TOKENIZER_PATH
    from runner.data.prepare import prepare
    from runner.data.tokenizer import load_tokenizer

    base = pq.read_table(ASSETS / "code.parquet", columns=["text"]).column("text").to_pylist()
    with gzip.open(ASSETS / "prose.jsonl.gz", "rt", encoding="utf-8") as f:
        base += [json.loads(line)["text"] for line in f]
    # Split into ~4 KB documents (web-page sized) and repeat with distinct ids up to --mb.
    chunks = [t[i : i + 4096] for t in base for i in range(0, len(t), 4096)]
    target_bytes, texts, size = int(args.mb * 1e6), [], 0
    while size < target_bytes:
        for c in chunks:
            texts.append(c)
            size += len(c.encode("utf-8"))
            if size >= target_bytes:
                break

    tok = load_tokenizer(TOKENIZER_PATH)

    def raw() -> tuple[int, float]:
        t0 = time.perf_counter()
        tokens = 0
        for i in range(0, len(texts), args.batch_docs):
            encodings = tok.encode_batch(texts[i : i + args.batch_docs], add_special_tokens=False)
            tokens += sum(len(e.ids) for e in encodings)
        return tokens, time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bench.jsonl"
        with open(src, "w", encoding="utf-8") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"id": f"bench-{i}", "text": t}) + "\n")

        def runner_prepare() -> tuple[int, float]:
            t0 = time.perf_counter()
            manifest_path, _ = prepare(
                "bench",
                TOKENIZER_PATH,
                Path(tmp) / "out",
                [src],
                validation_fraction=0.0,
                workers=args.workers,
                batch_docs=args.batch_docs,
                progress=False,
            )
            seconds = time.perf_counter() - t0
            return json.loads(manifest_path.read_text())["pool_tokens"], seconds

        raw_runs, prep_runs = [], []
        for _ in range(args.repeats):
            raw_runs.append(raw())
            prep_runs.append(runner_prepare())
    raw_tokens, raw_seconds = min(raw_runs, key=lambda r: r[1])
    prep_tokens, prep_seconds = min(prep_runs, key=lambda r: r[1])

    raw_rate, prep_rate = raw_tokens / raw_seconds, prep_tokens / prep_seconds
    print(f"text: {size / 1e6:.1f} MB, {len(texts)} documents, cores: {args.workers}, batch: {args.batch_docs}")
    print(f"raw encode_batch : {raw_tokens:>11,} tokens in {raw_seconds:7.2f} s = {raw_rate:12,.0f} tokens/s")
    print(
        f"runner prepare   : {prep_tokens:>11,} tokens in {prep_seconds:7.2f} s = {prep_rate:12,.0f} tokens/s"
        f" (pool includes one EOS per document)"
    )
    print(f"ratio prepare/raw: {prep_rate / raw_rate:.2f} (target >= 0.85)")


if __name__ == "__main__":
    sys.exit(main())
