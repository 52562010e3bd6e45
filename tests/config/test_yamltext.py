"""In-place YAML edits (what `runner pin` writes): one value changes, every comment and line stays."""

from __future__ import annotations

import pytest
import yaml

from runner.config.yamltext import set_value
from runner.errors import RunnerError

TEXT = """\
name: 1p3b
version: 1   # bumped on every change
recipes:
  tokenizer: gpt-neox-20b@1
train:
  checkpoint: {interval_steps: 1000, keep_last: 3}
  nested:
    deep: 1
  # a comment after the last key

data:
  manifests:   # prepared, then pinned
    web: {path: data/web/manifest.json, sha256: null}
"""


def _changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    a, b = before.splitlines(), after.splitlines()
    return [(x, y) for x, y in zip(a, b) if x != y]


def test_a_scalar_is_replaced_in_place_keeping_its_comment():
    out = set_value(TEXT, ["version"], 2)
    assert _changed_lines(TEXT, out) == [
        ("version: 1   # bumped on every change", "version: 2   # bumped on every change")
    ]
    out = set_value(TEXT, ["recipes", "tokenizer"], "gpt-neox-20b@2")
    assert "  tokenizer: gpt-neox-20b@2\n" in out and out.count("\n") == TEXT.count("\n")


def test_a_flow_mapping_gains_a_key_before_its_brace():
    out = set_value(TEXT, ["data", "manifests", "web", "sha256"], "ab" * 32)
    out = set_value(out, ["data", "manifests", "web", "pool_tokens"], 123)
    assert f"    web: {{path: data/web/manifest.json, sha256: {'ab' * 32}, pool_tokens: 123}}\n" in out
    assert "  manifests:   # prepared, then pinned\n" in out


def test_a_block_mapping_gains_a_key_after_its_last_line_of_content():
    out = set_value(TEXT, ["train", "log_interval_steps"], 10)
    assert "    deep: 1\n  log_interval_steps: 10\n  # a comment after the last key\n" in out
    assert yaml.safe_load(out)["train"]["log_interval_steps"] == 10


def test_strings_that_would_read_as_something_else_are_quoted():
    for value in ("1" * 64, "null", "yes", "0123"):
        out = set_value(TEXT, ["recipes", "tokenizer"], value)
        assert yaml.safe_load(out)["recipes"]["tokenizer"] == value


def test_what_cannot_be_edited_in_place_is_refused_not_guessed():
    folded = "description: >-\n  two\n  lines\n"
    with pytest.raises(RunnerError, match="description: cannot edit this key in place"):
        set_value(folded, ["description"], "one")
    with pytest.raises(RunnerError, match="cannot edit this key in place"):
        set_value(TEXT, ["missing", "key"], 1)
