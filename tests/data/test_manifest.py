"""Manifests: a pool is refused, in one line naming the file, unless it is exactly what was pinned."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datafixtures import documents, make_tokenizer, run_cli, write_jsonl

from runner.data.manifest import load_manifest, manifest_sha256, num_samples
from runner.data.pool import Pool
from runner.data.prepare import prepare
from runner.errors import RunnerError


@pytest.fixture()
def prepared(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "a.jsonl", documents(40))
    path, sha = prepare("web", tok, tmp_path / "out", [src], validation_fraction=0.1, shard_tokens=64, workers=0)
    return path, sha


def refused(*args, **kwargs) -> str:
    with pytest.raises(RunnerError) as e:
        load_manifest(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_manifest_has_the_design_shape(prepared):
    path, sha = prepared
    data = json.loads(path.read_text())
    assert set(data) == {
        "format",
        "domain",
        "tokenizer_sha256",
        "token_dtype",
        "vocab_size",
        "eos_id",
        "shards",
        "validation_shards",
        "validation",
        "pool_tokens",
        "documents",
        "validation_tokens",
        "validation_documents",
        "sources",
        "manifest_sha256",
    }
    assert data["manifest_sha256"] == sha == manifest_sha256(data)
    assert all(set(s) == {"path", "tokens", "documents", "sha256"} for s in data["shards"])
    m = load_manifest(path, sha, verify="full")
    assert (m.domain, m.token_dtype, m.pool_tokens, m.sha256, m.dir) == (
        "web",
        "uint16",
        data["pool_tokens"],
        sha,
        path.parent,
    )


def test_truncated_shard_refused_naming_it(prepared):
    path, sha = prepared
    shard = path.parent / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    message = refused(path, sha)
    assert str(shard) in message and "truncated" in message


def test_missing_shard_refused(prepared):
    path, _ = prepared
    (path.parent / "validation-00000.bin").unlink()
    assert "validation-00000.bin" in refused(path)


def test_full_verify_catches_same_size_corruption(prepared):
    path, sha = prepared
    shard = path.parent / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    load_manifest(path, sha, verify="size")  # sizes still match
    assert str(shard) in refused(path, sha, verify="full")
    with pytest.raises(RunnerError, match="sha256"):
        run_cli("data", "verify", str(path))


def test_edited_manifest_refused(prepared):
    path, _ = prepared
    data = json.loads(path.read_text())
    data["pool_tokens"] += 1
    path.write_text(json.dumps(data))
    message = refused(path)
    assert message.startswith(f"{path}: manifest_sha256:") and "edited" in message


def test_pinned_sha_mismatch_names_the_recipe_key(prepared):
    path, _ = prepared
    message = refused(path, "a" * 64, key="data.manifests.web.sha256")
    assert message.startswith(f"{path}: data.manifests.web.sha256:") and "a" * 64 in message


def test_missing_bad_json_and_missing_keys(tmp_path):
    assert "not found" in refused(tmp_path / "manifest.json")
    (tmp_path / "bad.json").write_text("{not json")
    assert "not valid JSON" in refused(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text(json.dumps({"format": "runner-manifest/1", "domain": "x"}))
    assert "missing keys: tokenizer_sha256" in refused(tmp_path / "partial.json")


def test_pool_reads_across_shards(prepared):
    path, _ = prepared
    m = load_manifest(path)
    whole = np.concatenate([np.fromfile(s.path, dtype="<u2") for s in m.shards])
    assert len(m.shards) >= 3 and len(whole) == m.pool_tokens
    pool = Pool(m, "train")
    assert pool.tokens == m.pool_tokens
    for start, stop in [(0, 0), (0, m.pool_tokens), (60, 70), (63, 64 + 64 + 1), (m.pool_tokens - 1, m.pool_tokens)]:
        assert np.array_equal(pool.read(start, stop), whole[start:stop])
    with pytest.raises(IndexError):
        pool.read(0, m.pool_tokens + 1)


def test_num_samples():
    assert num_samples(1025, 1024) == 1
    assert num_samples(1024, 1024) == 0  # the last target needs one token past the window
    assert num_samples(10 * 64 + 1, 64) == 10


def test_verify_cli_accepts_a_good_pool(prepared, capsys):
    path, sha = prepared
    assert run_cli("data", "verify", str(path), "--sha256", sha) == 0
    assert sha in capsys.readouterr().out


def test_verify_cli_takes_an_experiment_and_hashes_every_manifest_it_pins(project_with_data, capsys, monkeypatch):
    monkeypatch.chdir(project_with_data)
    assert run_cli("data", "verify", "experiments/cpu-tiny.yaml") == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in out] == [
        ["ok:", f"data/builtin/{d}/manifest.json", f"domain={d}"] for d in ("code", "prose", "legal")
    ]
    shard = sorted((project_with_data / "data/builtin/prose").rglob("*.bin"))[0]
    body = bytearray(shard.read_bytes())
    body[0] ^= 1  # the same size: only the full hash sees it
    shard.write_bytes(bytes(body))
    with pytest.raises(RunnerError, match="sha256"):
        run_cli("data", "verify", "experiments/cpu-tiny.yaml")
    with pytest.raises(RunnerError) as e:
        run_cli("data", "verify", "experiments/cpu-tiny.yaml", "--sha256", "0" * 64)
    assert str(e.value) == (
        "experiments/cpu-tiny.yaml: --sha256: is for one manifest.json: an experiment pins each of its own"
    )
