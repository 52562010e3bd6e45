"""Tokenizers: training writes a ready recipe, dtype follows vocab size, pins are enforced."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from datafixtures import CORPUS, documents, make_tokenizer, run_cli, write_jsonl
from tokenizers import Tokenizer, models, pre_tokenizers

from runner.data.tokenizer import load_tokenizer, token_byte_lengths, token_dtype_for, tokenizer_info
from runner.errors import RunnerError
from runner.fsio import sha256_file


def test_train_cli_writes_tokenizer_and_ready_recipe(tmp_path):
    src = write_jsonl(tmp_path / "src" / "a.jsonl", documents(30))
    assert (
        run_cli(
            "tokenizer",
            "train",
            "--input",
            str(src),
            "--vocab-size",
            "300",
            "--out",
            str(tmp_path / "tok"),
            "--name",
            "tiny",
        )
        == 0
    )
    recipe = yaml.safe_load((tmp_path / "tok" / "tiny.yaml").read_text())
    assert set(recipe) == {"name", "version", "description", "path", "sha256", "vocab_size", "eos_id", "token_dtype"}
    assert recipe["name"] == "tiny" and recipe["version"] == 1
    assert recipe["sha256"] == sha256_file(tmp_path / "tok" / "tokenizer.json")
    assert recipe["vocab_size"] == 300 and recipe["token_dtype"] == "uint16"
    tok = load_tokenizer(tmp_path / "tok" / "tokenizer.json", recipe["sha256"])
    assert tok.token_to_id("<|endoftext|>") == recipe["eos_id"]
    text = "Ünïcödé — def add(a, b)"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: lossless round trip


def test_dtype_boundary_is_65536():
    assert token_dtype_for(4096) == "uint16"
    assert token_dtype_for(65536) == "uint16"
    assert token_dtype_for(65537) == "uint32"


def test_70k_vocab_tokenizer_is_uint32(tmp_path):
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    info = tokenizer_info(tmp_path / "tokenizer.json")
    assert info == {
        "sha256": sha256_file(tmp_path / "tokenizer.json"),
        "vocab_size": 70_001,
        "eos_id": 0,
        "token_dtype": "uint32",
    }


def test_wrong_sha_refused_naming_file_and_key(tmp_path):
    path = make_tokenizer(tmp_path)
    with pytest.raises(RunnerError) as e:
        load_tokenizer(path, "0" * 64)
    message = str(e.value)
    assert str(path) in message and "tokenizer.sha256" in message and "\n" not in message


def test_tokenizer_without_eos_refused(tmp_path):
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(RunnerError, match="end-of-text"):
        tokenizer_info(tmp_path / "tokenizer.json")


def test_eos_found_under_other_common_names(tmp_path):
    tok = Tokenizer(models.WordLevel({"a": 0, "</s>": 1, "b": 2}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer_info(tmp_path / "tokenizer.json")["eos_id"] == 1


def test_byte_lengths_sum_to_utf8_bytes(tmp_path):
    tok = load_tokenizer(make_tokenizer(tmp_path))
    lengths = token_byte_lengths(tok)
    assert lengths.shape == (tok.get_vocab_size(),)
    assert lengths[tok.token_to_id("<|endoftext|>")] == 0
    for text in CORPUS[:8] + ["  spaces\ttabs\nnewlines  ", "日本語🙂"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert int(np.sum(lengths[ids])) == len(text.encode("utf-8"))


def test_byte_lengths_for_a_non_byte_level_tokenizer(tmp_path):
    spec_vocab = {"<|endoftext|>": 0, "\u2581the": 1, "<0xE2>": 2, "é": 3}
    tok = Tokenizer(models.WordLevel(spec_vocab, unk_token="<|endoftext|>"))
    tok.add_special_tokens(["<|endoftext|>"])
    assert list(token_byte_lengths(tok)) == [0, 4, 1, 2]


def test_train_cli_says_when_the_corpus_cannot_reach_the_asked_vocab(tmp_path, capsys):
    src = write_jsonl(tmp_path / "src" / "a.jsonl", documents(5))
    assert (
        run_cli(
            "tokenizer",
            "train",
            "--input",
            str(src),
            "--vocab-size",
            "70000",
            "--out",
            str(tmp_path / "tok"),
            "--name",
            "big",
        )
        == 0
    )
    recipe = yaml.safe_load((tmp_path / "tok" / "big.yaml").read_text())
    assert recipe["vocab_size"] < 70_000 and recipe["token_dtype"] == "uint16"
    assert f"vocab {recipe['vocab_size']}," in recipe["description"]  # not the asked 70000
    err = capsys.readouterr().err
    assert f"vocab_size: {recipe['vocab_size']:,} ids, not the 70,000 asked" in err


def test_train_cli_never_writes_over_a_tokenizer_nor_outside_its_folder(tmp_path):
    """A retrain into the folder of a (possibly pinned) tokenizer is refused before any training, as are
    a recipe name that is a path (`--name ../x` wrote ../x.yaml beside --out), a file as --out (a
    FileExistsError traceback) and a vocabulary below 258 ids; nothing is written."""
    src = str(write_jsonl(tmp_path / "src" / "a.jsonl", documents(30)))
    out = tmp_path / "tok"
    train = ("tokenizer", "train", "--input", src, "--vocab-size", "300", "--out")
    assert run_cli(*train, str(out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def refused(*argv: str) -> str:
        with pytest.raises(RunnerError) as e:
            run_cli(*argv)
        return str(e.value)

    assert "tokenizer.json, " in refused(*train, str(out)) and "bpe.yaml already there" in refused(*train, str(out))
    assert "never written over" in refused(*train, str(out), "--name", "other")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert refused(*train, str(tmp_path / "new"), "--name", "../x").startswith("--name: '../x' is not a recipe name")
    assert not (tmp_path / "x.yaml").exists() and not (tmp_path / "new").exists()
    assert refused(*train, src).startswith("--out: exists and is not a folder")
    assert refused(*train[:-3], "--vocab-size", "257", "--out", str(tmp_path / "n2")).startswith(
        "--vocab-size: 257 is below"
    )
    assert "not a file or a folder" in refused(
        "tokenizer", "train", "--input", "/dev/null", *train[4:], str(tmp_path / "n3")
    )


def test_train_cli_refuses_a_vocabulary_tokenizers_aborts_on_and_a_corpus_without_text(tmp_path):
    """`--vocab-size 99999999999` (or anything from 2**30 up) aborted the process with a Rust panic
    backtrace; an empty corpus (or one character) wrote a 257-id tokenizer without a single merge,
    which the 258-id minimum refuses as a request. Both are one line; nothing written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "empty.txt").write_text("")
    (src / "one.txt").write_text("a")
    with pytest.raises(RunnerError, match=r"^--vocab-size: 99,999,999,999 is above 16,777,216 ids"):
        run_cli("tokenizer", "train", "--input", str(src), "--vocab-size", "99999999999", "--out", str(tmp_path / "t"))
    for name in ("empty.txt", "one.txt"):
        with pytest.raises(RunnerError, match=r"^--input: no pair of bytes to merge in 1 file\(s\)"):
            run_cli(
                "tokenizer", "train", "--input", str(src / name), "--vocab-size", "300", "--out", str(tmp_path / "t")
            )
    assert not (tmp_path / "t").exists()
