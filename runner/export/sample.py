"""`runner sample`: text from a run's checkpoint or an exported folder, through transformers' `generate`.

Owns: opening either kind of source (a run folder: its verified checkpoint in transformers' plain
class, with the pinned tokenizer; an exported folder: `AutoModelForCausalLM`/`AutoTokenizer`,
exactly what a user of the folder gets), and the sampling settings (greedy at temperature 0,
otherwise multinomial sampling seeded by `seed`). One process, on the CPU. Never writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from runner.data.tokenizer import load_tokenizer
from runner.errors import RunnerError
from runner.export.export import quiet_transformers
from runner.export.source import export_model, open_source
from runner.training.runfolder import is_run_dir


@dataclass
class Sample:
    prompt: str
    text: str  #: the continuation only
    new_tokens: int
    source: str  #: what generated it: `runs/x/y checkpoints/step-0000150` or the folder


def _from_run(path: Path, step: int | None):
    src = open_source(path, step)
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
        raise RunnerError("neither a run folder nor an exported model folder (no config.json)", file=str(path))
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), str(path)


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
    if temperature < 0:
        raise RunnerError(f"must be >= 0, got {temperature}", key="--temperature")
    with quiet_transformers():
        if is_run_dir(path):
            model, tokenizer, where = _from_run(path, step)
        else:
            if step is not None:
                raise RunnerError(
                    "--step names a checkpoint of a run folder; this is an exported folder", file=str(path)
                )
            model, tokenizer, where = _from_folder(path)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        if ids.shape[1] == 0:
            raise RunnerError("the prompt encodes to no tokens", key="--prompt")
        torch.manual_seed(seed)
        settings = (
            {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
        )
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            **settings,
        )[0, ids.shape[1] :]
    return Sample(prompt, tokenizer.decode(out, skip_special_tokens=False), int(out.shape[0]), where)
