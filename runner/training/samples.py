"""Fixed-prompt greedy samples at every evaluation (`export.samples`), as MLflow text artifacts.

Owns: the greedy continuation of the recipe's prompts with the model being trained (an argmax per
new token over the full sequence, no cache: what transformers' `generate` with `do_sample=False`
computes), the text file `samples/step-NNNNNN.txt` in the run folder and its MLflow artifact.
Every rank runs the same forwards (a sharded model gathers its weights collectively in each, as
in validation); rank 0's tokens are the ones kept, and only rank 0 writes. Never changes the
model's weights or any RNG state; operational (not in the fingerprint).
"""

from __future__ import annotations

from pathlib import Path

import torch

from runner.data.tokenizer import load_tokenizer
from runner.training.accelerator import AttentionBackend
from runner.training.callbacks import Callback
from runner.training.evaluate import eager_forwards


@torch.no_grad()
def greedy(model, acc, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """The new tokens of a greedy continuation, up to and including the first EOS (as `generate`
    stops). Always `max_new_tokens` forwards, so every rank runs as many."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=acc.device)
    was_training = model.training
    model.eval()
    with eager_forwards():
        for _ in range(max_new_tokens):
            with acc.autocast():
                logits = model(input_ids=ids).logits[:, -1]
            nxt = logits.float().argmax(-1, keepdim=True)
            if acc.num_processes > 1:  # one continuation: rank 0's, should ranks' kernels disagree on a tie
                torch.distributed.broadcast(nxt, src=0)
            ids = torch.cat([ids, nxt], dim=1)
    if was_training:
        model.train()
    new = ids[0, len(prompt_ids) :].tolist()
    if eos_id is not None and eos_id in new:
        new = new[: new.index(eos_id) + 1]
    return new


def render(step: int, exposure_tokens: int, pairs: list[tuple[str, str]]) -> str:
    """The artifact's text: a header line, then each prompt and its continuation."""
    parts = [f"step {step}, exposure {exposure_tokens} tokens, greedy\n"]
    for i, (prompt, text) in enumerate(pairs, 1):
        parts.append(f"\n=== prompt {i}: {prompt!r}\n{prompt}{text}\n")
    return "".join(parts)


def filename(step: int) -> str:
    return f"step-{step:06d}.txt"


class SamplesCallback(Callback):
    """`export.samples`: at each evaluation, every rank continues each prompt; rank 0 writes
    `<run>/samples/step-NNNNNN.txt` and logs it as the MLflow artifact `samples/<that name>`."""

    def __init__(
        self, model, acc, attention: AttentionBackend, tokenizer, eos_id: int | None, samples, run_dir: Path, tracker
    ):
        self.model, self.acc, self.attention = model, acc, attention
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.prompts = list(samples.prompts)
        self.max_new_tokens = int(samples.max_new_tokens)
        self.dir = Path(run_dir) / "samples"
        self.tracker = tracker

    def on_eval(self, step, exposure_tokens, rows):
        pairs = []
        with self.attention.context():
            for prompt in self.prompts:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
                new = greedy(self.model, self.acc, ids, self.max_new_tokens, self.eos_id)
                pairs.append((prompt, self.tokenizer.decode(new, skip_special_tokens=False)))
        if not self.acc.is_main_process:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / filename(step)
        path.write_text(render(step, exposure_tokens, pairs))
        if self.tracker is not None:
            self.tracker.log_artifacts(path, "samples")


def samples_callback(exp, model, acc, attention: AttentionBackend, run_dir: Path, tracker) -> SamplesCallback | None:
    """The callback of `export.samples`, or None when it lists no prompts."""
    cfg = exp.config
    if not cfg.export.samples.prompts:
        return None
    tok = load_tokenizer(exp.resolve_path(cfg.tokenizer.path), cfg.tokenizer.sha256)
    return SamplesCallback(model, acc, attention, tok, cfg.tokenizer.eos_id, cfg.export.samples, run_dir, tracker)
