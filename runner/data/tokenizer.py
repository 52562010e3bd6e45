"""Tokenizers pinned by sha256: train a byte-level BPE, load a `tokenizer.json`, describe it.

Owns: what a tokenizer file is to the rest of the project (its sha256, vocabulary size, EOS id,
token dtype, and the UTF-8 byte length of every id, for bits per byte). Any HF `tokenizers`
file works the same way. Never downloads anything, and never loads a tokenizer whose sha256
differs from the one a recipe pins.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import numpy as np
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runner.errors import RunnerError
from runner.fsio import sha256_file

EOS_TOKEN = "<|endoftext|>"
# Checked in this order, so a tokenizer that defines several picks the document separator.
EOS_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "[EOS]",
    "<|eos|>",
    "<EOS>",
)
UINT16_MAX_VOCAB = 65536


def token_dtype_for(vocab_size: int) -> str:
    """`uint16` when every id fits (vocab_size <= 65,536), else `uint32`; never truncates."""
    if vocab_size <= 0:
        raise RunnerError(f"vocab_size must be positive, got {vocab_size}", key="tokenizer.vocab_size")
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def load_tokenizer(path: str | os.PathLike, expected_sha256: str | None = None):
    """Load a `tokenizer.json`; refuse it when its sha256 is not the pinned one."""
    path = Path(path)
    if path.is_dir():
        raise RunnerError("is a folder: name the tokenizer.json file in it", file=str(path))
    if not path.is_file():
        raise RunnerError("tokenizer file not found", file=str(path))
    if expected_sha256 is not None:
        actual = sha256_file(path)
        if actual != expected_sha256:
            raise RunnerError(
                f"file sha256 is {actual}, the recipe pins {expected_sha256}", file=str(path), key="tokenizer.sha256"
            )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception on bad JSON or schema
        raise RunnerError(f"not a tokenizers file: {e}", file=str(path)) from None


def vocab_size_of(tokenizer) -> int:
    """Number of ids the tokenizer can emit: one past the largest id, added tokens included."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def eos_id_of(tokenizer, source: str = "tokenizer") -> int:
    for name in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise RunnerError(f"no end-of-text token among {', '.join(EOS_CANDIDATES)}", file=source, key="eos_id")


def tokenizer_info(path: str | os.PathLike) -> dict:
    """`{sha256, vocab_size, eos_id, token_dtype}` of a tokenizer file."""
    tokenizer = load_tokenizer(path)
    vocab_size = vocab_size_of(tokenizer)
    return {
        "sha256": sha256_file(path),
        "vocab_size": vocab_size,
        "eos_id": eos_id_of(tokenizer, str(path)),
        "token_dtype": token_dtype_for(vocab_size),
    }


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible bytes<->unicode table, inverted: printable char -> raw byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


def _mentions_byte_level(node) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(_mentions_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_byte_level(v) for v in node)
    return False


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 byte length of the text each id decodes to (special tokens: 0), indexed by id."""
    spec = json.loads(tokenizer.to_str())
    byte_level = _mentions_byte_level(spec.get("decoder")) or _mentions_byte_level(spec.get("pre_tokenizer"))
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    table = _byte_decoder()
    lengths = np.zeros(vocab_size_of(tokenizer), dtype=np.int64)
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id in special:
            continue
        if byte_level and all(c in table for c in token):
            lengths[token_id] = len(token)  # one printable char per raw byte
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            lengths[token_id] = 1  # SentencePiece byte fallback
        else:
            lengths[token_id] = len(token.replace("\u2581", " ").encode("utf-8"))
    return lengths


def train_tokenizer(documents: Iterable[str], vocab_size: int):
    """Byte-level BPE with `<|endoftext|>` as its only special token (id 0)."""
    if vocab_size < 257 + 1:
        raise RunnerError(f"vocab_size {vocab_size} is below the 256 bytes plus EOS", key="vocab_size")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def recipe_path_value(path: Path) -> str:
    """Recipes name tokenizers relative to the repo root (the working directory) when inside it."""
    resolved = path.resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(resolved)


def write_trained(tokenizer, out_dir: str | os.PathLike, name: str, description: str) -> tuple[Path, Path]:
    """Save `tokenizer.json` and a ready tokenizer recipe `<name>.yaml` next to it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_path = out_dir / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    info = tokenizer_info(tokenizer_path)
    recipe = {"name": name, "version": 1, "description": description, "path": recipe_path_value(tokenizer_path), **info}
    recipe_path = out_dir / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return tokenizer_path, recipe_path
