"""`runner sample`: text from a run's checkpoint or an exported folder, through transformers' `generate`.

Owns: opening either kind of source (a run folder: its verified checkpoint in transformers' plain
class, with the pinned tokenizer; an exported folder: `AutoModelForCausalLM`/`AutoTokenizer`,
exactly what a user of the folder gets; a damaged one, a file it names missing, unreadable JSON or
safetensors, is one line naming the file; weights that do not fit the model config.json describes,
missing, unused or of another shape, are refused rather than generated from at random; an exported
folder's files checked against the record its run folder keeps (runner.export.verify_export): refused
when they differ, said "unverified" where no record is at hand), and the sampling settings (greedy at temperature 0,
otherwise multinomial sampling seeded by `seed`; a temperature that is not 0 or a finite number >=
`MIN_TEMPERATURE` is refused, as is a model whose next-token probabilities are not finite), with the new tokens capped at what the model's context (`max_position_embeddings`) leaves
after the prompt. One process, on the CPU. Never writes anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from runner.data.tokenizer import load_tokenizer
from runner.errors import RunnerError
from runner.export.export import RECORD
from runner.export.source import export_model, open_source, quiet_transformers
from runner.export.verify_export import sample_provenance
from runner.runs.folder import is_run_dir


@dataclass
class Sample:
    prompt: str
    text: str  #: the continuation only
    new_tokens: int
    source: str  #: what generated it: `runs/x/y checkpoints/step-0000150` or the folder
    note: str | None = None  #: said beside the text: the new tokens were capped at the model's context
    #: an exported folder's files against the run folder's record (verified / unverified: why)
    provenance: str | None = None


#: torch.manual_seed's range
SEED_LIMIT = 2**64
# Below this, logits / temperature overflow float32 (3.4e38) for ordinary logits (T = 1e-300: inf, then NaN
# probabilities, a RuntimeError inside generate); at 1e-3 a logit of 100 becomes 1e5, far from it, and
# sampling at T = 1e-3 is greedy in all but name (0 asks for greedy).
MIN_TEMPERATURE = 1e-3


def _from_run(path: Path, step: int | None):
    src = open_source(path, step, command="sample")
    cfg = src.exp.config
    pinned = src.exp.resolve_path(cfg.tokenizer.path)
    tok = load_tokenizer(pinned, cfg.tokenizer.sha256)
    eos = tok.id_to_token(cfg.tokenizer.eos_id)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(pinned), eos_token=eos, pad_token=eos, split_special_tokens=True
    )
    return export_model(src, torch.float32), tokenizer, f"{path} {src.checkpoint.path.name}"


def _from_folder(path: Path):
    if not (path / "config.json").is_file():
        if (path / RECORD).is_file() or any(path.glob("*.safetensors")):
            raise RunnerError("missing: the exported folder is damaged", file=str(path / "config.json"))
        raise RunnerError("neither a run folder nor an exported model folder (no config.json)", file=str(path))
    _check_folder(path)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        model, info = loaded
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers' loaders raise many kinds (tokenizers' is a bare Exception)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RunnerError(f"transformers cannot load it ({type(e).__name__}: {first})", file=str(path)) from None
    _check_loaded(path, model, info)
    return model.eval(), tokenizer, str(path)


def _check_loaded(path: Path, model, info: dict) -> None:
    """Refuse a folder whose weights do not fit the model its config.json describes: transformers
    initialises what the weights lack at random and drops what the model has no place for, and
    would generate from that without a word (config.json saying GPT-2 over Llama weights)."""
    missing = sorted(map(str, info.get("missing_keys") or []))
    unused = sorted(map(str, info.get("unexpected_keys") or []))
    mismatched = sorted(
        str(m[0]) if isinstance(m, (tuple, list)) else str(m) for m in info.get("mismatched_keys") or []
    )
    if not (missing or unused or mismatched):
        return
    said = [
        f"{len(keys)} {what} (first {keys[0]})"
        for keys, what in (
            (missing, "weights missing, which would be random"),
            (unused, "weights in the files not used"),
            (mismatched, "of another shape"),
        )
        if keys
    ]
    kind = f"{model.config.model_type} ({type(model).__name__})"
    raise RunnerError(
        f"config.json describes {kind}, and the weights do not fit it: {'; '.join(said)}: refusing to sample "
        "from partly random weights",
        file=str(path),
    )


def _json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunnerError(f"not readable JSON ({e}): the folder is damaged", file=str(file)) from None
    if not isinstance(data, dict):
        raise RunnerError("not a JSON object: the folder is damaged", file=str(file))
    return data


def _check_folder(path: Path) -> None:
    """The files an exported folder's loaders read, each readable, before transformers reads them:
    its JSON files, and the safetensors its index names (or model.safetensors), headers and sizes."""
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        if (path / name).exists():
            _json(path / name)
        elif name.startswith("tokenizer") and (path / RECORD).is_file():  # runner export writes both
            raise RunnerError("missing: the exported folder is damaged", file=str(path / name))
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise RunnerError("has no weight_map: the folder is damaged", file=str(index))
        shards = sorted(set(map(str, weight_map.values())))
    elif (path / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        return  # another layout (pytorch_model.bin): transformers says what it lacks
    for name in shards:
        file = path / name
        if not file.is_file():
            raise RunnerError(f"missing ({index.name} names it): the folder is damaged", file=str(file))
        try:
            with safe_open(str(file), framework="pt"):
                pass  # the header parsed and every tensor it lists inside the file
        except (SafetensorError, OSError) as e:
            raise RunnerError(f"not a readable safetensors file ({e}): the folder is damaged", file=str(file)) from None


def _check_settings(max_new_tokens: int, temperature: float, seed: int) -> None:
    if max_new_tokens < 1:
        raise RunnerError(f"must be >= 1, got {max_new_tokens}", key="--max-new-tokens")
    if not (math.isfinite(temperature) and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        raise RunnerError(
            f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {temperature}", key="--temperature"
        )
    if isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
        raise RunnerError(f"an integer from 0 to 2**64 - 1, got {seed}", key="--seed")


def _room(model, prompt_tokens: int, max_new_tokens: int) -> tuple[int, str | None]:
    """The new tokens to generate: at most what the model's context leaves after the prompt (a
    model trained on N positions has never seen position N), and the note that says so."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None:
        return max_new_tokens, None
    room = int(positions) - prompt_tokens
    if room < 1:
        raise RunnerError(
            f"encodes to {prompt_tokens} tokens; the model's context is {positions} positions "
            "(max_position_embeddings): no room is left to generate",
            key="--prompt",
        )
    if max_new_tokens <= room:
        return max_new_tokens, None
    return room, (
        f"--max-new-tokens {max_new_tokens} capped at {room}: the model's context is {positions} positions "
        f"(max_position_embeddings) and the prompt takes {prompt_tokens}"
    )


@torch.no_grad()
def sample(
    target: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    step: int | None = None,
) -> Sample:
    """Continue `prompt` with the model of a run folder (its checkpoint at `step`, default the last)
    or of an exported folder."""
    path = Path(target)
    if not path.is_dir():
        raise RunnerError("no such folder", file=str(path))
    _check_settings(max_new_tokens, temperature, seed)
    with quiet_transformers():
        provenance = None
        if is_run_dir(path):
            model, tokenizer, where = _from_run(path, step)
        else:
            if step is not None:
                raise RunnerError(
                    "--step names a checkpoint of a run folder; this is an exported folder", file=str(path)
                )
            model, tokenizer, where = _from_folder(path)
            provenance = sample_provenance(path)  # refuses files that differ from the run's record
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        if ids.shape[1] == 0:
            raise RunnerError("the prompt encodes to no tokens", key="--prompt")
        max_new_tokens, note = _room(model, int(ids.shape[1]), max_new_tokens)
        torch.manual_seed(seed)
        settings = (
            {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
        )
        try:
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                **settings,
            )[0, ids.shape[1] :]
        except RuntimeError as e:  # torch.multinomial over NaN/inf probabilities: a diverged checkpoint
            if "probability tensor" not in str(e):
                raise
            raise RunnerError(
                f"{where}: the model's next-token probabilities are not finite (NaN or inf logits: a diverged "
                "checkpoint?); nothing to sample from"
            ) from None
    text = tokenizer.decode(out, skip_special_tokens=False)
    return Sample(prompt, text, int(out.shape[0]), where, note, provenance)
