"""The Hugging Face folder of one checkpoint: weights, config, generation config, tokenizer.

Owns: the files transformers reads, written by transformers itself (`save_pretrained` of the plain
classes: OLMoE's experts, fused in memory, land under the Hub's per-expert keys; safetensors
sharded above `max_shard_size` with `model.safetensors.index.json`; a tied LM head stored once),
plus the keys older readers need (`torch_dtype` beside transformers 5's `dtype`, `rope_theta`
beside `rope_parameters`), and the tokenizer: the pinned `tokenizer.json` byte for byte and a
`tokenizer_config.json` that makes `AutoTokenizer` encode as the run's data preparation did
(special-token strings split as text, no BOS unless the recipe has one). Never writes outside the
folder it is given.
"""

from __future__ import annotations

import json
import re
import shutil
from fractions import Fraction
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast

from runner.data.tokenizer import load_tokenizer
from runner.errors import RunnerError
from runner.export import DEFAULT_MAX_SHARD_SIZE
from runner.export.source import Source, bos_id, export_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
#: the Hub's size units (huggingface_hub's shard splitter reads these; powers of 1000)
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*$", re.IGNORECASE)


def shard_size_bytes(size: str | int) -> int:
    """`--max-shard-size` in bytes (`5GB`, `500MB`, `100KB`; an int is bytes), refused unless it is a
    size above 0: checked before an export starts, then handed to save_pretrained as bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise RunnerError(
                f"not a size: {size!r} (give a number and a unit: 5GB, 500MB, 100KB; {', '.join(SIZE_UNITS)})",
                key="--max-shard-size",
            )
        value = int(Fraction(m.group(1)) * SIZE_UNITS[m.group(2).upper()])  # exact: 400 digits are no float
    if value < 1:
        raise RunnerError(f"a shard holds at least one byte, got {size!r}", key="--max-shard-size")
    return value


def write_folder(src: Source, dtype: str, out: Path, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write the model and tokenizer of `src` into the (new, empty) folder `out`."""
    model = export_model(src, DTYPES[dtype])
    model.generation_config = generation_config(src)
    model.save_pretrained(out, max_shard_size=shard_size_bytes(max_shard_size))
    _complete_config(out / "config.json", src, dtype)
    write_tokenizer(src, out)


def generation_config(src: Source) -> GenerationConfig:
    """EOS ends a sequence and pads a batch; greedy unless a caller asks to sample (written out:
    transformers' text-generation pipeline samples at temperature 0.7 where the folder says nothing)."""
    eos = src.exp.config.tokenizer.eos_id
    return GenerationConfig(bos_token_id=bos_id(src.exp), eos_token_id=eos, pad_token_id=eos, do_sample=False)


def _complete_config(path: Path, src: Source, dtype: str) -> None:
    """config.json as transformers 5 wrote it, plus the names older readers look for."""
    config = json.loads(path.read_text())
    config["dtype"] = DTYPE_NAMES[dtype]
    config["torch_dtype"] = DTYPE_NAMES[dtype]  # transformers 4.x reads this name
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # transformers 4.x reads rope_theta at the top level
        config["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_tokenizer(src: Source, out: Path) -> None:
    """tokenizer.json (the pinned file, unchanged) and tokenizer_config.json."""
    cfg = src.exp.config
    pinned = src.exp.resolve_path(cfg.tokenizer.path)
    tok = load_tokenizer(pinned, cfg.tokenizer.sha256)  # refuses a file that is not the pinned one
    eos = tok.id_to_token(cfg.tokenizer.eos_id)
    bos = bos_id(src.exp)
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(pinned),
        eos_token=eos,
        pad_token=eos,
        bos_token=tok.id_to_token(bos) if bos is not None else None,
        model_max_length=cfg.train.seq_len,
        split_special_tokens=True,  # the pools were encoded with special-token strings split as text
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out)
    shutil.copyfile(pinned, out / "tokenizer.json")  # byte for byte: its sha256 is the recipe's pin
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # a name transformers 4.x and 5.x both resolve
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
