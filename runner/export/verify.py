"""An exported folder, loaded back by transformers alone, compared with the runner's model.

Owns the comparison an export must pass before it is moved into place, on fixed inputs: the first
validation window of each domain (the same ones at every export of a run), cut to
`VERIFY_POSITIONS` positions.
- Tokenizer: `AutoTokenizer` encodes each window's text to the ids the run's data preparation
  gives that text (the pinned tokenizer, special-token strings split, nothing added), and decodes
  the window's ids to the same text.
- Logits: `AutoModelForCausalLM`'s, against the runner's model with the checkpoint's weights.
  fp32: within 1e-5 absolute. bf16: against the runner's model cast to bf16 (the same rounded
  weights), within `BF16_ATOL` x max(1, max |logit|): a bf16 number holds 8 significant bits
  (relative spacing 2^-7 at worst), and two kernel orders may round each partial sum differently;
  2^-5 of the logits' scale bounds that on every model tested here, while a wrong weight, a
  transposed matrix or a lost tie moves logits by their whole scale.
- Greedy generation (`generate`, KV cache) of `GREEDY_TOKENS` tokens from each window's first
  `PROMPT_TOKENS`: identical to the runner's model's argmax at every position whose top-2 margin
  exceeds twice the tolerance (each of the two logits may move by it: a closer pair is a tie the
  tolerance allows either way, and the comparison of that sequence stops there), up to its EOS.
Never writes anything; a mismatch is a RunnerError naming what differs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runner.data.tokenizer import load_tokenizer
from runner.errors import RunnerError
from runner.export.source import Source, reference_model
from runner.training.batches import load_data

VERIFY_POSITIONS = 64
PROMPT_TOKENS = 8
GREEDY_TOKENS = 4
FP32_ATOL = 1e-5
BF16_ATOL = 2.0**-5


def tolerance(dtype: str, scale: float) -> float:
    """Largest logit difference accepted for `dtype` at logits of magnitude `scale`."""
    return FP32_ATOL if dtype == "fp32" else BF16_ATOL * max(1.0, scale)


def fixed_inputs(src: Source) -> tuple[list[str], torch.Tensor]:
    """(domains, ids [domains, positions]): the first validation window of each domain, cut."""
    data = load_data(src.exp, src.exp.config.train.seq_len)
    if data.val_reader is None or not data.val_samples:
        raise RunnerError("the run's pools hold no validation windows to verify the export on", file=str(src.run_dir))
    names = sorted(data.val_samples)
    batch = data.val_reader.read([(data.val_reader.domains.index(d), 0) for d in names])
    ids = torch.as_tensor(np.asarray(batch.input_ids), dtype=torch.long)
    return names, ids[:, : min(VERIFY_POSITIONS, ids.shape[1])]


def check_tokenizer(src: Source, folder: Path, domains: list[str], ids: torch.Tensor) -> dict:
    """AutoTokenizer of the folder against the pinned tokenizer, as data preparation encodes."""
    cfg = src.exp.config.tokenizer
    pinned = load_tokenizer(src.exp.resolve_path(cfg.path), cfg.sha256)
    pinned.encode_special_tokens = True  # runner.data.prepare's rule
    exported = AutoTokenizer.from_pretrained(folder)
    problems = []
    for d, row in zip(domains, ids.tolist()):
        text = pinned.decode(row, skip_special_tokens=False)
        want = pinned.encode(text, add_special_tokens=False).ids
        got = exported(text)["input_ids"]
        if got != want:
            problems.append(
                f"{d}: AutoTokenizer gives {len(got)} ids, the run's encoding {len(want)} (first diff at {_first_diff(got, want)})"
            )
        if exported.decode(row, skip_special_tokens=False) != text:
            problems.append(f"{d}: AutoTokenizer decodes the window to other text")
    if exported.eos_token_id != cfg.eos_id:
        problems.append(f"AutoTokenizer's eos_token_id is {exported.eos_token_id}, the recipe's eos_id {cfg.eos_id}")
    if problems:
        raise RunnerError("tokenizer mismatch: " + "; ".join(problems), file=str(folder))
    return {"windows": len(domains), "ids_identical": True}


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _greedy(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [batch, steps], top-2 margins [batch, steps]) by argmax over full forwards (no cache)."""
    ids, tokens, margins = prompt, [], []
    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, -1].float()
        top = logits.topk(2, dim=-1).values
        nxt = logits.argmax(dim=-1)
        tokens.append(nxt)
        margins.append(top[:, 0] - top[:, 1])
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return torch.stack(tokens, 1), torch.stack(margins, 1)


@torch.no_grad()
def check_model(src: Source, folder: Path, dtype: str, ids: torch.Tensor) -> dict:
    """Logits and greedy tokens of the folder's model against the runner's model; the record."""
    reference = reference_model(src)
    if dtype == "bf16":
        reference = copy.deepcopy(reference).to(torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    want = reference(input_ids=ids).logits.float()
    got = loaded(input_ids=ids).logits.float()
    if got.shape != want.shape:
        raise RunnerError(
            f"the exported model's logits have shape {tuple(got.shape)}, the run's {tuple(want.shape)}",
            file=str(folder),
        )
    diff = float((got - want).abs().max())
    tol = tolerance(dtype, float(want.abs().max()))
    if not diff <= tol:  # NaN fails too
        raise RunnerError(
            f"exported logits differ from the run's model by {diff:.3g} (> {tol:.3g}, {dtype})", file=str(folder)
        )
    prompt = ids[:, :PROMPT_TOKENS]
    ref_tokens, margins = _greedy(reference, prompt, GREEDY_TOKENS)
    out = loaded.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=GREEDY_TOKENS,
        do_sample=False,
    )[:, prompt.shape[1] :]
    eos = src.exp.config.tokenizer.eos_id
    compared = 0
    for row in range(prompt.shape[0]):
        for i in range(min(GREEDY_TOKENS, out.shape[1])):
            if float(margins[row, i]) <= 2 * tol:  # a near-tie: either token is right within the tolerance
                break
            if int(out[row, i]) != int(ref_tokens[row, i]):
                raise RunnerError(
                    f"greedy generation differs at token {i} of window {row}: exported {int(out[row, i])}, "
                    f"the run's model {int(ref_tokens[row, i])} (top-2 margin {float(margins[row, i]):.3g})",
                    file=str(folder),
                )
            compared += 1
            if int(ref_tokens[row, i]) == eos:  # generate stops a sequence at EOS (then pads it)
                break
    return {
        "inputs": f"first validation window of each domain, {ids.shape[1]} positions",
        "dtype": dtype,
        "max_abs_logit_diff": diff,
        "tolerance": tol,
        "greedy_tokens_compared": compared,
        "greedy_tokens_asked": GREEDY_TOKENS * prompt.shape[0],
    }
