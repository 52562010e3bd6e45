"""The built-in downstream task: which passage truly precedes a held-out passage of the built-in
corpus, among passages of other documents (offline, deterministic: the CPU demo's task).

Owns: how the task is cut from the corpus. Held-out documents are those `prepare` puts in the
validation split (so the model never trained on them); each is cut at whitespace into (context,
continuation) pairs. A document's choices are contexts (the Winogrande / schema layout): the true
one and those of 3 pairs from other documents, drawn by `numpy.random.default_rng(0)`, each
followed by the same true continuation. Every choice scores the same string, so the figure
measures how much the context helps predict it, never how likely the string is on its own: with
the continuations as choices instead (v1 of the task), cpu-tiny@2 at step 150, a model close to
unigram statistics, scored acc 0.212 against the baseline 0.25 (the likelier string won whatever
the context); with contexts as choices, 0.570. The same corpus gives the same task, byte for byte.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import lru_cache

import numpy as np
import pyarrow.parquet as pq

from runner.data.builtin.build import ASSETS, VALIDATION_FRACTION
from runner.data.prepare import is_validation
from runner.training.downstream.documents import Document, Request

CONTEXT_CHARS = 240  #: a context is this many characters, cut back to a whitespace
CONTINUATION_CHARS = 80  #: a continuation likewise, and starts at that whitespace (a leading " ")
CHOICES = 4
SEED = 0


def _held_out_texts() -> list[tuple[str, str]]:
    """(id, text) of the prose and code documents in the validation split, sorted by id."""
    with gzip.open(ASSETS / "prose.jsonl.gz", "rt", encoding="utf-8") as f:
        prose = [json.loads(line) for line in f]
    code = pq.read_table(ASSETS / "code.parquet", columns=["id", "text"]).to_pylist()
    docs = [(r["id"], r["text"]) for r in prose + code if is_validation(r["id"], VALIDATION_FRACTION)]
    return sorted(docs)


def _cut(text: str, start: int, chars: int) -> int:
    """The last whitespace at or before start + chars (past start), else start + chars."""
    end = min(len(text), start + chars)
    space = text.rfind(" ", start + 1, end + 1)
    return space if space > start else end


def _pairs(text: str) -> list[tuple[str, str]]:
    """(context, continuation) pairs along a text, each continuation beginning at a space."""
    text = " ".join(text.split())  # one space between words: passages end and begin cleanly
    out, start = [], 0
    while start + CONTEXT_CHARS + CONTINUATION_CHARS <= len(text):
        mid = _cut(text, start, CONTEXT_CHARS)
        end = _cut(text, mid, CONTINUATION_CHARS)
        context, continuation = text[start:mid], text[mid:end]
        if context.strip() and continuation.strip():
            out.append((context, continuation))
        start = end + 1
    return out


@lru_cache(maxsize=1)
def builtin_documents() -> tuple[list[Document], str]:
    """The task's documents (gold at a drawn position among CHOICES) and the sha256 of their
    canonical JSON, which stands for the task file."""
    pairs = [(source, c, k) for source, (_, text) in enumerate(_held_out_texts()) for c, k in _pairs(text)]
    rng = np.random.default_rng(SEED)
    docs = []
    for i, (source, context, continuation) in enumerate(pairs):
        others = [j for j, p in enumerate(pairs) if p[0] != source]
        distractors = [pairs[int(j)][1] for j in rng.choice(others, size=CHOICES - 1, replace=False)]
        gold = int(rng.integers(CHOICES))
        options = distractors[:gold] + [context] + distractors[gold:]
        docs.append(Document(i, gold, tuple(Request(o, continuation) for o in options)))
    canonical = json.dumps(
        [[d.gold, [[r.context, r.continuation] for r in d.requests]] for d in docs], ensure_ascii=False
    ).encode("utf-8")
    return docs, hashlib.sha256(canonical).hexdigest()
