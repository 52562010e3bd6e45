"""The loopback Hub of the fetch tests: a tiny tokenizer and FineWeb-Edu-layout shards served by
tests/fakehub.py, the tiny-hub experiment and its recipes, and what the Hub was asked for. Shared by
tests/data/test_fetch.py, tests/e2e/test_fetch_attacks.py and tests/cli/test_bad_input.py."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from datafixtures import documents, make_tokenizer, write_parquet
from fakehub import FakeHub

from runner.config.load import load_experiment

TOKENIZER_REPO, DATA_REPO = "test-org/tiny-tokenizer", "test-org/tiny-fineweb"
SHARDS = ("sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet")

TOKENIZER_RECIPE = """\
name: tiny-hub
version: 1
description: A byte-level BPE of 320 ids on the loopback Hub (a stand-in for GPT-NeoX-20B's).
path: data/tokenizers/tiny-hub/tokenizer.json
sha256: null   # `runner pin` writes it
vocab_size: 320
eos_id: 0
token_dtype: uint16
hub: {repo: test-org/tiny-tokenizer, revision: main, files: [tokenizer.json]}
"""
MIXTURE_RECIPE = """\
name: tiny-web
version: 1
description: One web domain, FineWeb-Edu's layout, on the loopback Hub.
domains:
  web:
    target_ratio: 1.0
    max_repetition_ratio: 4.0   # a stand-in dataset: small enough to repeat
    source:
      repo: test-org/tiny-fineweb
      repo_type: dataset
      revision: main            # `runner pin` writes the commit it resolved to
      files: [sample/10BT/*.parquet]
      local_dir: data/raw/tiny-fineweb
"""
EVAL_RECIPE = """\
name: tiny-hub-eval
version: 1
description: Validation loss of the one web domain (tiny-eval's targets name the built-in domains).
interval_steps: 25
samples_per_domain: 16
micro_batch_sequences: 16
"""
EXPERIMENT = """\
name: tiny-hub
version: 1
description: The 1p3b flow in miniature, on the loopback Hub.
recipes:
  tokenizer: tiny-hub@1
  mixture: tiny-web@1
  model: llama-tiny@1
  optim: adamw-tiny@1
  hardware: cpu@1
  eval: tiny-hub-eval@1
seed: 7
train:
  seq_len: 64
  global_batch_sequences: 8      # 8 x 64 = 512 tokens per step
  micro_batch_sequences: 8
  exposure_tokens: 25600         # 50 steps x 512
  checkpoint: {interval_steps: 25, keep_last: 1}
data:
  manifests:   # `runner data prepare experiments/tiny-hub.yaml`, then `runner pin`
    web: {path: data/tiny-fineweb/web/manifest.json, sha256: null}
"""


@contextmanager
def serving_hub(tmp_path: Path):
    """A loopback Hub holding the tokenizer (plain git file) and two parquet shards (LFS) plus files
    the experiment does not name (another sample folder, a README)."""
    src = tmp_path / "hub-src"
    tok = make_tokenizer(src / "tok")
    files = {p: write_parquet(src / f"{i}.parquet", documents(300, i)).read_bytes() for i, p in enumerate(SHARDS)}
    files["sample/100BT/000_00000.parquet"] = b"not named by the recipe" * 100
    files["README.md"] = b"# tiny fineweb\n"
    with FakeHub() as server:
        server.commits = {
            "tokenizer": server.add_repo("model", TOKENIZER_REPO, {"tokenizer.json": tok.read_bytes()}, lfs=False),
            "web": server.add_repo("dataset", DATA_REPO, files, lfs=True),
        }
        server.files = files
        yield server


def use_hub(project: Path, hub: FakeHub, monkeypatch) -> Path:
    """`project` with the tiny-hub experiment and its recipes, HF_ENDPOINT at `hub`, in its folder."""
    (project / "recipes/tokenizer/tiny-hub.yaml").write_text(TOKENIZER_RECIPE)
    (project / "recipes/mixture/tiny-web.yaml").write_text(MIXTURE_RECIPE)
    (project / "recipes/eval/tiny-hub-eval.yaml").write_text(EVAL_RECIPE)
    (project / "experiments/tiny-hub.yaml").write_text(EXPERIMENT)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(project.parent / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(project)
    return project


def _exp(project: Path):
    return load_experiment(project / "experiments/tiny-hub.yaml", check_files=False)


def _downloads(hub: FakeHub) -> list[tuple[str, str | None]]:
    return [(path, rng) for method, path, rng in hub.requests if method == "GET" and "/resolve/" in path]
