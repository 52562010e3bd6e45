"""Requests to tokens, as lm-evaluation-harness's HFLM makes them (SPEC "Downstream evaluation").

Owns: encode (the tokenizer's own special-token template, its BOS left out when the string
already starts with it; special-token strings in the text split as text), the pair rule
(trailing whitespace of the context moves to the continuation; the continuation's tokens are
those of context + continuation past the context's), the empty-context rule (BOS, else EOS, as
the context), the window (the last seq_len + 1 tokens) and the refusals made when a task is
loaded. Never runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from runner.data.tokenizer import eos_id_of
from runner.errors import RunnerError
from runner.training.downstream.documents import Task


def bos_id_of(tokenizer: Tokenizer) -> int | None:
    """The id the tokenizer's template puts first (its BOS), or None when it adds none in front."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    templated = tokenizer.encode("a", add_special_tokens=True).ids
    if len(templated) > len(plain) and templated[1 : 1 + len(plain)] == plain:
        return templated[0]
    return None


@dataclass(frozen=True)
class Encoded:
    """One request's tokens: `inputs` (the window's inputs) and the `targets` of its last
    `len(targets)` input positions."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]


class Encoder:
    def __init__(self, tokenizer: Tokenizer, seq_len: int) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: its special-token mode is ours
        self.tokenizer.encode_special_tokens = True  # "<|endoftext|>" inside a text is text
        self.seq_len = seq_len
        self.bos = bos_id_of(self.tokenizer)
        self.eos = eos_id_of(self.tokenizer)
        self.prefix = self.bos if self.bos is not None else self.eos
        self.bos_text = self.tokenizer.decode([self.bos], skip_special_tokens=False) if self.bos is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens and self.bos_text and text.startswith(self.bos_text):
            add_special_tokens = False
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(c, k): the context's tokens and the continuation's."""
        if context == "":
            k = self.encode(continuation, add_special_tokens=False)
            if k and k[0] == self.prefix:
                return k[:1], k[1:]
            return [self.prefix], k
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, c = self.encode(context + continuation), self.encode(context)
        return c, whole[len(c) :]

    def window(self, context: str, continuation: str) -> Encoded:
        c, k = self.pair(context, continuation)
        t = (c + k)[-(self.seq_len + 1) :]
        return Encoded(tuple(t[:-1]), tuple(k))

    def encode_task(self, task: Task) -> list[Encoded]:
        """Every request of the task, in `task.requests` order; refuses (RunnerError naming the task
        file) a whitespace-only context, an empty continuation and one longer than seq_len."""
        out = []
        for i, j, r in task.requests:
            where = f"task {task.name}: document {task.documents[i].doc_id} choice {j}"
            if r.context and not r.context.strip():
                raise RunnerError(f"{where}: the context is whitespace only", file=task.source)
            enc = self.window(r.context, r.continuation)
            if not enc.targets:
                raise RunnerError(f"{where}: the continuation {r.continuation!r} encodes to no token", file=task.source)
            if len(enc.targets) > self.seq_len:
                raise RunnerError(
                    f"{where}: the continuation is {len(enc.targets)} tokens, above seq_len {self.seq_len}",
                    file=task.source,
                )
            out.append(enc)
        return out
