"""The shapes of a downstream task: a request (context, continuation), a document (its requests, one per
choice, and the gold choice) and a task (the documents of the fixed subset and what the recipe pinned).

Their own module so that the readers of each format (runner.training.downstream.tasks, builtin_task)
share them without importing each other. Plain data: no reading, no tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    context: str
    continuation: str


@dataclass(frozen=True)
class Document:
    doc_id: int
    gold: int
    requests: tuple[Request, ...]  #: one per choice, in choice order

    @property
    def choices(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class Task:
    name: str
    format: str
    sha256: str  #: the task file's (builtin: of the texts it was made from)
    config_sha256: str | None
    documents: tuple[Document, ...]  #: the subset, in id order
    total_documents: int  #: before the subset
    limit: int | None
    seed: int
    metrics: tuple[str, ...]
    random_baseline: float | None
    delimiter: str
    source: str  #: the file it was read from (for messages)

    @property
    def requests(self) -> list[tuple[int, int, Request]]:
        """(document position, choice, request) of every request, in order."""
        return [(i, j, r) for i, d in enumerate(self.documents) for j, r in enumerate(d.requests)]
