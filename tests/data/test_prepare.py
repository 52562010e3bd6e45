"""prepare: pools equal tokenize(doc)+EOS in source order, splits are deterministic, output is
byte-identical across runs, worker counts, batch sizes and interruptions."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from datafixtures import documents, make_tokenizer, run_cli, write_jsonl, write_parquet, write_text_dir
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from tokenizers import Tokenizer, models, pre_tokenizers

from runner.data.manifest import load_manifest
from runner.data.pool import Pool
from runner.data.prepare import SPLIT_RULE, is_validation, prepare
from runner.data.tokenizer import load_tokenizer
from runner.errors import RunnerError


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def expected_pool(tok_path, docs, fraction, split_key=lambda d: d["id"]):
    tok = load_tokenizer(tok_path)
    tok.encode_special_tokens = True
    eos = tok.token_to_id("<|endoftext|>")
    train, val = [], []
    for d in docs:
        ids = tok.encode(d["text"], add_special_tokens=False).ids + [eos]
        (val if is_validation(split_key(d), fraction) else train).extend(ids)
    return np.array(train), np.array(val)


def dir_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.gz", "text"])
def test_pool_is_documents_plus_eos_in_order(tmp_path, tok_path, fmt):
    docs = documents(60)
    if fmt == "parquet":
        src, key = write_parquet(tmp_path / "src" / "a.parquet", docs), lambda d: d["id"]
    elif fmt == "jsonl":
        src, key = write_jsonl(tmp_path / "src" / "a.jsonl", docs), lambda d: d["id"]
    elif fmt == "jsonl.gz":  # read through gzip (it was refused as "not UTF-8": issue 27)
        plain = write_jsonl(tmp_path / "plain" / "a.jsonl", docs)
        src, key = tmp_path / "src" / "a.jsonl.gz", lambda d: d["id"]
        src.parent.mkdir()
        src.write_bytes(gzip.compress(Path(plain).read_bytes()))
    else:
        src, key = write_text_dir(tmp_path / "src", docs), lambda d: d["text"]  # no id: text decides
    path, sha = prepare(
        "web", tok_path, tmp_path / "out", [src], validation_fraction=0.2, shard_tokens=97, workers=0, batch_docs=5
    )
    m = load_manifest(path, sha, verify="full")
    train, val = expected_pool(tok_path, docs, 0.2, key)
    assert len(m.shards) > 1  # the pool spans shard boundaries
    assert np.array_equal(Pool(m, "train").read(0, m.pool_tokens), train)
    assert np.array_equal(Pool(m, "validation").read(0, m.validation_tokens), val)
    n_val = sum(is_validation(key(d), 0.2) for d in docs)
    assert 0 < n_val < len(docs)
    assert (m.data["documents"], m.data["validation_documents"]) == (len(docs) - n_val, n_val)
    assert sum(s.documents for s in m.shards) == len(docs) - n_val
    assert m.data["validation"] == {"fraction": 0.2, "rule": SPLIT_RULE}
    assert m.data["sources"][0]["kind"] == fmt.removesuffix(".gz")


def test_other_compressed_files_say_decompress_it(tmp_path, tok_path):
    src = tmp_path / "a.txt.gz"
    src.write_bytes(gzip.compress(b"some text"))
    with pytest.raises(
        RunnerError, match=r"a compressed file \(\.gz\): decompress it first \(e\.g\. `gunzip a\.txt\.gz`\)"
    ):
        prepare("web", tok_path, tmp_path / "out", [src], workers=0)
    (tmp_path / "b.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(RunnerError, match="not a readable gzip file"):
        prepare("web", tok_path, tmp_path / "out", [tmp_path / "b.jsonl.gz"], workers=0)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_split_is_deterministic_and_disjoint():
    keys = [f"doc-{i}" for i in range(4000)]
    held_out = {k for k in keys if is_validation(k, 0.05)}
    assert held_out == {k for k in keys if is_validation(k, 0.05)}
    assert 120 < len(held_out) < 280  # ~5 %
    assert held_out <= {k for k in keys if is_validation(k, 0.10)}  # larger fraction only adds
    assert not any(is_validation(k, 0.0) for k in keys)


def test_output_independent_of_workers_and_batch_and_deterministic(tmp_path, tok_path):
    src = write_jsonl(tmp_path / "src" / "a.jsonl", documents(80))
    runs = [dict(workers=0, batch_docs=3), dict(workers=0, batch_docs=64), dict(workers=2, batch_docs=7)]
    shas = []
    for i, kw in enumerate(runs):
        _, sha = prepare("web", tok_path, tmp_path / f"out{i}", [src], validation_fraction=0.1, shard_tokens=128, **kw)
        shas.append(sha)
    assert len(set(shas)) == 1
    assert dir_bytes(tmp_path / "out0") == dir_bytes(tmp_path / "out2")
    manifest_text = (tmp_path / "out0" / "manifest.json").read_text()
    assert str(tmp_path) not in manifest_text  # nothing machine-specific is pinned


def test_sources_in_order_recorded_by_name_and_sha(tmp_path, tok_path):
    a = write_parquet(tmp_path / "src" / "a.parquet", documents(10, seed=1))
    b = write_jsonl(tmp_path / "src" / "b.jsonl", documents(10, seed=2))
    c = write_text_dir(tmp_path / "src" / "texts", documents(3, seed=3))
    path, _ = prepare("web", tok_path, tmp_path / "out", [b, a, c], validation_fraction=0.0, workers=0)
    m = load_manifest(path)
    assert [s["path"] for s in m.data["sources"]] == [
        "b.jsonl",
        "a.parquet",
        "texts/0000.txt",
        "texts/0001.txt",
        "texts/0002.txt",
    ]
    docs = documents(10, seed=2) + documents(10, seed=1) + documents(3, seed=3)
    train, _ = expected_pool(tok_path, docs, 0.0)
    assert np.array_equal(Pool(m).read(0, m.pool_tokens), train)


def test_literal_eos_text_stays_text(tmp_path, tok_path):
    src = write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "text": "before <|endoftext|> after"}])
    path, _ = prepare("web", tok_path, tmp_path / "out", [src], validation_fraction=0.0, workers=0)
    m = load_manifest(path)
    pool = Pool(m).read(0, m.pool_tokens)
    assert list(np.flatnonzero(pool == m.eos_id)) == [m.pool_tokens - 1]


def test_large_vocab_writes_uint32_without_truncation(tmp_path):
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "text": "w69999 w5 w65536"}])
    path, _ = prepare("big", tmp_path / "tokenizer.json", tmp_path / "out", [src], validation_fraction=0.0, workers=0)
    m = load_manifest(path)
    assert m.token_dtype == "uint32" and m.shards[0].path.stat().st_size == 4 * 4
    assert list(Pool(m).read(0, 4)) == [70_000, 6, 65_537, 0]


def test_nanogpt_bin_pool(tmp_path, tok_path):
    rng = np.random.default_rng(0)
    train = rng.integers(1, 320, size=1000).astype("<u2")
    train[[99, 499, 999]] = 0
    val = rng.integers(1, 320, size=50).astype("<u2")
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    assert (
        run_cli(
            "data",
            "prepare",
            "--domain",
            "web",
            "--tokenizer",
            str(tok_path),
            "--out",
            str(tmp_path / "out"),
            "--input-format",
            "nanogpt-bin",
            "--shard-tokens",
            "300",
            "--input",
            str(tmp_path / "train.bin"),
            str(tmp_path / "val.bin"),
        )
        == 0
    )
    m = load_manifest(tmp_path / "out" / "manifest.json", verify="full")
    assert np.array_equal(Pool(m).read(0, m.pool_tokens), train)
    assert np.array_equal(Pool(m, "validation").read(0, 50), val)
    assert m.data["documents"] == 3 and [s.tokens for s in m.shards] == [300, 300, 300, 100]
    np.array([5, 4000], dtype="<u2").tofile(tmp_path / "bad.bin")
    with pytest.raises(RunnerError, match="outside the tokenizer's vocabulary"):
        prepare("web", tok_path, tmp_path / "out2", [tmp_path / "bad.bin"], input_format="nanogpt-bin")


def test_bad_inputs_refused_with_file(tmp_path, tok_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no text"}\n')
    with pytest.raises(RunnerError, match=r"bad\.jsonl: line 2"):
        prepare("web", tok_path, tmp_path / "out", [bad], workers=0)
    with pytest.raises(RunnerError, match="tokenizer.sha256"):
        prepare("web", tok_path, tmp_path / "out", [bad], tokenizer_sha256="f" * 64)
    with pytest.raises(RunnerError, match="input not found"):
        prepare("web", tok_path, tmp_path / "out", [tmp_path / "missing.parquet"])


def test_failure_mid_way_then_rerun_is_byte_identical(tmp_path, tok_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", documents(60))
    kw = dict(validation_fraction=0.1, shard_tokens=100, workers=0, batch_docs=4)
    _, clean_sha = prepare("web", tok_path, tmp_path / "clean", [src], **kw)

    import runner.data.prepare as prep

    real_replace, renames = os.replace, []

    def crash_on_third_shard(a, b):
        renames.append(b)
        if len(renames) == 3:
            raise OSError("disk went away")
        real_replace(a, b)

    monkeypatch.setattr(prep.os, "replace", crash_on_third_shard)
    with pytest.raises(OSError):
        prepare("web", tok_path, tmp_path / "out", [src], **kw)
    monkeypatch.undo()
    assert not (tmp_path / "out" / "manifest.json").exists()
    _, sha = prepare("web", tok_path, tmp_path / "out", [src], **kw)
    assert sha == clean_sha and dir_bytes(tmp_path / "out") == dir_bytes(tmp_path / "clean")


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sigkill_then_rerun_is_byte_identical(tmp_path, tok_path):
    src = write_jsonl(tmp_path / "a.jsonl", documents(3000))
    kw = dict(validation_fraction=0.05, shard_tokens=2000, workers=0, batch_docs=8)
    code = (
        "import sys; from runner.data.prepare import prepare; "
        f"prepare('web', {str(tok_path)!r}, sys.argv[1], [{str(src)!r}], **{kw!r})"
    )
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)])
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not (out.exists() and any(p.name.startswith("train-") for p in out.iterdir())):
        assert time.monotonic() < deadline and proc.poll() is None, "prepare never wrote a shard"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    _, sha = prepare("web", tok_path, out, [src], **kw)
    _, clean_sha = prepare("web", tok_path, tmp_path / "clean", [src], **kw)
    assert sha == clean_sha and dir_bytes(out) == dir_bytes(tmp_path / "clean")


def test_rerun_over_old_output_drops_stale_shards(tmp_path, tok_path):
    src = write_jsonl(tmp_path / "a.jsonl", documents(40))
    prepare("web", tok_path, tmp_path / "out", [src], shard_tokens=50, workers=0)
    many = len(list((tmp_path / "out").glob("train-*.bin")))
    path, _ = prepare("web", tok_path, tmp_path / "out", [src], shard_tokens=10_000, workers=0)
    assert many > 1 and [p.name for p in (tmp_path / "out").glob("train-*.bin")] == ["train-00000.bin"]
    load_manifest(path, verify="full")


def test_prepare_never_rewrites_another_domains_folder(tmp_path, tok_path):
    """`--out data/builtin/code --domain d` replaced the built-in code domain's pinned shards; a folder
    whose manifest.json holds another domain is refused before anything there changes, a file as --out
    too (was a FileExistsError traceback); the CLI's numeric flags are refused by argparse, naming them."""
    src = write_jsonl(tmp_path / "a.jsonl", documents(40))
    out = tmp_path / "code"
    prepare("code", tok_path, out, [src], workers=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RunnerError, match=r"code/manifest.json: holds domain 'code', not 'd': preparing here"):
        prepare("d", tok_path, out, [src], workers=0)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    prepare("code", tok_path, out, [src], workers=0)  # its own domain: a rerun, byte-identical
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(RunnerError, match="a.jsonl: exists and is not a folder"):
        prepare("d", tok_path, src, [src], workers=0)
    app = tmp_path / "app"  # a manifest.json that is no JSON object: it was removed by the rerun's first step
    app.mkdir()
    (app / "manifest.json").write_text("CACHE MANIFEST\n")
    with pytest.raises(RunnerError, match=r"app/manifest.json: is not a manifest `runner data prepare` wrote"):
        prepare("d", tok_path, app, [src], workers=0)
    assert [p.name for p in app.iterdir()] == ["manifest.json"]
    assert (app / "manifest.json").read_text() == "CACHE MANIFEST\n"
    flags = (
        "data",
        "prepare",
        "--domain",
        "d",
        "--tokenizer",
        str(tok_path),
        "--input",
        str(src),
        "--out",
        str(tmp_path / "n"),
    )
    for bad in (("--workers", "0"), ("--batch-docs", "0"), ("--shard-tokens", "-1"), ("--validation-fraction", "nan")):
        with pytest.raises(SystemExit):
            run_cli(*flags, *bad)
    assert not (tmp_path / "n").exists()


def _pdeathsig_after_die_with_parent() -> int:
    import ctypes

    from runner.data.prepare import PR_GET_PDEATHSIG, die_with_parent

    die_with_parent()
    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_prepare_workers_die_with_a_sigkilled_parent():
    # A SIGKILLed prepare must not leave workers tokenizing on and printing BrokenPipeError.
    import multiprocessing
    import signal

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_pdeathsig_after_die_with_parent) == signal.SIGKILL


def test_workers_are_capped_at_the_usable_cores_and_a_domain_is_a_name(tmp_path, tok_path, monkeypatch, capsys):
    """`--workers 100000` started tokenizer processes until the machine ran out of memory (the OOM
    killer took other processes with it): capped at the cores this process may use, with a note.
    `--domain 'a b/../c'` was written into manifest.json and named MLflow metrics, report columns and
    the model card's rows: refused before anything is written, as a mixture's domain is."""
    import runner.data.prepare as prep

    src = write_jsonl(tmp_path / "src" / "a.jsonl", documents(20))
    started = []
    real = prep._ordered_results
    monkeypatch.setattr(prep, "usable_cores", lambda: 2)
    monkeypatch.setattr(prep, "_ordered_results", lambda b, workers, i: started.append(workers) or real(b, 1, i))
    flags = ("data", "prepare", "--domain", "d", "--tokenizer", str(tok_path), "--input", str(src))
    assert run_cli(*flags, "--out", str(tmp_path / "a"), "--workers", "100000") == 0
    assert run_cli(*flags, "--out", str(tmp_path / "b")) == 0
    assert started == [2, 2]
    assert "note: --workers 100,000 capped at 2: the cores this process may use" in capsys.readouterr().err
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")
    for bad in ("a b/../c", "a|b", "-x", ""):
        with pytest.raises(RunnerError, match=r"^--domain: .* is not a domain name"):
            prepare(bad, tok_path, tmp_path / "n", [src])
    assert not (tmp_path / "n").exists()
