"""Built-in data: offline, fast, byte-identical on every run and machine, every reader exercised."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import pytest
import yaml
from datafixtures import documents, make_tokenizer, run_cli, write_jsonl

from runner.data.builtin.build import ASSETS, TOKENIZER_PATH, build_builtin
from runner.data.manifest import load_manifest
from runner.data.pool import Pool
from runner.data.prepare import prepare
from runner.data.tokenizer import tokenizer_info
from runner.errors import RunnerError
from runner.fsio import sha256_file

# The values the shipped recipes pin: a build that no longer reproduces them breaks the CPU experiment.
_REPO = Path(__file__).resolve().parents[2]
TOKENIZER_RECIPE = yaml.safe_load((_REPO / "recipes/tokenizer/builtin-bpe-4k.yaml").read_text())
TOKENIZER_SHA256 = TOKENIZER_RECIPE["sha256"]
MANIFEST_SHA256 = {
    d: pin["sha256"]
    for d, pin in yaml.safe_load((_REPO / "experiments/cpu-tiny.yaml").read_text())["data"]["manifests"].items()
}


def test_shipped_tokenizer_matches_its_recipe():
    recipe = TOKENIZER_RECIPE
    assert sha256_file(TOKENIZER_PATH) == recipe["sha256"] == TOKENIZER_SHA256
    assert tokenizer_info(TOKENIZER_PATH) == {k: recipe[k] for k in ("sha256", "vocab_size", "eos_id", "token_dtype")}
    assert recipe["vocab_size"] == 4096 and recipe["path"] == "runner/builtin/assets/tokenizer.json"


def test_snapshot_is_small_and_has_no_gzip_timestamp():
    assert sum(p.stat().st_size for p in ASSETS.iterdir() if p.name != "tokenizer.json") < 1_500_000
    for name in ("prose.jsonl.gz", "legal.jsonl.gz"):
        header = (ASSETS / name).read_bytes()[:10]
        assert header[4:8] == b"\0\0\0\0"  # MTIME field
        assert gzip.decompress((ASSETS / name).read_bytes())


def test_two_builds_are_identical_fast_and_pinned(tmp_path):
    start = time.monotonic()
    first = build_builtin(tmp_path / "a")
    second = build_builtin(tmp_path / "b")
    assert time.monotonic() - start < 60  # two builds; one is < 30 s
    assert {d: sha for d, (_, sha) in first.items()} == {d: sha for d, (_, sha) in second.items()}
    assert {d: sha for d, (_, sha) in first.items()} == MANIFEST_SHA256
    for domain, (path, _sha) in first.items():
        assert path == tmp_path / "a" / domain / "manifest.json"
        assert path.read_bytes() == (tmp_path / "b" / domain / "manifest.json").read_bytes()


def test_builtin_domains_use_every_reader_and_legal_is_small(tmp_path, capsys):
    assert run_cli("data", "builtin", "--out", str(tmp_path)) == 0
    printed = capsys.readouterr().out
    manifests = {
        d: load_manifest(tmp_path / d / "manifest.json", MANIFEST_SHA256[d], verify="full") for d in MANIFEST_SHA256
    }
    assert all(MANIFEST_SHA256[d] in printed for d in manifests)
    kinds = {d: {s["kind"] for s in m.data["sources"]} for d, m in manifests.items()}
    assert kinds == {"code": {"parquet"}, "prose": {"jsonl"}, "legal": {"text"}}
    assert all(m.data["validation"]["fraction"] == 0.05 and m.validation_tokens > 0 for m in manifests.values())
    assert manifests["legal"].pool_tokens * 5 < manifests["prose"].pool_tokens < manifests["code"].pool_tokens
    assert len(manifests["code"].shards) > 1
    code = Pool(manifests["code"])
    assert code.read(0, code.tokens)[-1] == manifests["code"].eos_id


def test_builtin_never_replaces_a_domain_of_another_tokenizer(tmp_path):
    """`runner data builtin --out data` where data/code is the user's own code domain (prepared with
    their tokenizer) would have rewritten it with the built-in corpus; refused before anything is written."""
    tok = make_tokenizer(tmp_path / "tok")
    prepare("code", tok, tmp_path / "data" / "code", [write_jsonl(tmp_path / "mine.jsonl", documents(20))], workers=0)
    before = {p.name: p.read_bytes() for p in (tmp_path / "data" / "code").iterdir()}
    with pytest.raises(RunnerError, match=r"code/manifest.json: holds a domain of another tokenizer"):
        build_builtin(tmp_path / "data")
    assert {p.name: p.read_bytes() for p in (tmp_path / "data" / "code").iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["code"]


def test_builtin_never_removes_a_sources_legal_folder_of_the_users_own(tmp_path):
    """The build replaces OUT/sources/legal whole (a stale file would join the domain): a folder there of
    the user's own files was removed. Refused before anything is written; an earlier build's is rebuilt."""
    legal = tmp_path / "data" / "sources" / "legal"
    legal.mkdir(parents=True)
    (legal / "contract.txt").write_text("mine")
    with pytest.raises(RunnerError, match=r"sources/legal: holds contract.txt, not the built-in legal documents"):
        build_builtin(tmp_path / "data")
    assert [p.name for p in legal.iterdir()] == ["contract.txt"]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["sources"]
    (legal / "contract.txt").unlink()
    build_builtin(tmp_path / "data")  # an empty folder, then the build's own files: rebuilt
    build_builtin(tmp_path / "data")
    assert "contract.txt" not in {p.name for p in legal.iterdir()} and len(list(legal.iterdir())) > 1
