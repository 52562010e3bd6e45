"""The data recipes of the schema: the tokenizer, the mixture's domains and the Hub files they come from.

Owns: `TokenizerRecipe`, `MixtureRecipe` and `DomainRecipe`, the Hub repository and revision rules
(`HubFiles`, `DomainSource`), and each one's `validate`. Part of runner.config.schema (which composes
them into the experiment); imports nothing but the standard library, runner.errors and the base.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from runner.config.section import MISSING, File, Recipe, Section, sha256_format
from runner.errors import Problems, join_key

#: ids a token dtype holds: a vocabulary must fit (SPEC: never silently truncate)
TOKEN_DTYPES = {"uint16": 65_536, "uint32": 4_294_967_296}
#: target ratios must sum to 1 within this (they are written as decimals, so 0.1 + 0.2 is not 0.3)
RATIO_SUM_TOLERANCE = 1e-9
#: a Hub revision that names one commit (a branch or tag is resolved to one by `runner fetch`)
COMMIT_HEX = re.compile(r"^[0-9a-f]{40}$")
#: one part of a Hub repository id, as huggingface_hub's validate_repo_id checks it (ASCII here):
#: 1-96 of [A-Za-z0-9_.-], starting and ending with a letter, digit or underscore
_REPO_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?$")


def repo_id_problem(repo: str) -> str | None:
    """Why `repo` is not an owner/name Hub repository id (the Hub client's rules), or None."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts):
        return "must be a Hub repository id, owner/name"
    if not all(_REPO_PART.match(p) for p in parts):
        return (
            "must be a Hub repository id, owner/name: letters, digits, '-', '_', '.', each part at most 96, "
            "not starting or ending with '-' or '.'"
        )
    if "--" in repo or ".." in repo:
        return "must be a Hub repository id: '--' and '..' are not allowed"
    if repo.endswith(".git"):
        return "must be a Hub repository id: it cannot end in '.git'"
    return None


_GLOB = re.compile(r"[*?\[]")

TokenDtype = Literal["uint16", "uint32"]
RepoType = Literal["model", "dataset"]


@dataclass(frozen=True)
class HubFiles(Section):
    """Files of one Hugging Face Hub repository at one revision: what `runner fetch` downloads."""

    repo: str = MISSING  #: Hub repository id, e.g. EleutherAI/gpt-neox-20b
    repo_type: RepoType = "model"  #: model | dataset
    revision: str = (
        MISSING  #: a 40-hex commit; a branch or tag (main) is resolved by `runner fetch`, written by `runner pin`
    )
    files: list[str] = field(default_factory=list)  #: paths in the repo, or fnmatch patterns (sample/10BT/*.parquet)

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        wrong = repo_id_problem(self.repo)
        if wrong:
            problems.add(file, join_key(prefix, "repo"), f"'{self.repo[:200]}' {wrong}")
        if not self.revision:
            problems.add(
                file, join_key(prefix, "revision"), "must name a commit (40 hex) or a branch or tag to resolve"
            )
        if not self.files:
            problems.add(file, join_key(prefix, "files"), "must list at least one file or pattern")
        for i, f in enumerate(self.files):
            if not f or f.startswith("/") or ".." in f.split("/"):
                problems.add(file, f"{join_key(prefix, 'files')}[{i}]", f"'{f}' must be a path inside the repository")


@dataclass(frozen=True)
class DomainSource(HubFiles):
    """A domain's raw documents on the Hub; `runner data prepare EXPERIMENT` tokenizes them into
    the pool the experiment's manifest pin names."""

    local_dir: str = MISSING  #: where the files land (repo paths kept), relative to the project root or absolute
    #: a relative local_dir that leaves the project (`../data`) is meant: check-pr names it (operational)
    local_dir_outside_project: bool = False

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        super().validate(problems, file, prefix)
        if not self.local_dir:
            problems.add(file, join_key(prefix, "local_dir"), "must name the folder the files land in")
        elif local_dir_leaves_project(self.local_dir) and not self.local_dir_outside_project:
            problems.add(
                file,
                join_key(prefix, "local_dir"),
                f"'{self.local_dir[:200]}' leaves the project: give an absolute path (a data disk), or set "
                "local_dir_outside_project: true if that is meant",
            )


def local_dir_leaves_project(local_dir: str) -> bool:
    """A relative path whose `..` parts climb above the project root (an absolute one is a data disk)."""
    if Path(local_dir).is_absolute():
        return False
    depth = 0
    for part in Path(local_dir).parts:
        depth += -1 if part == ".." else (0 if part == "." else 1)
        if depth < 0:
            return True
    return False


@dataclass(frozen=True)
class TokenizerRecipe(Recipe):
    path: str = MISSING  #: tokenizer.json, relative to the project root or absolute
    sha256: str | None = MISSING  #: sha256 of that file; null = not pinned yet (launch refuses)
    vocab_size: int = MISSING  #: ids the tokenizer emits, EOS included
    eos_id: int = MISSING  #: the id appended after every document
    token_dtype: TokenDtype = MISSING  #: uint16 (vocab <= 65,536) or uint32
    hub: HubFiles | None = (
        None  #: where `runner fetch` downloads the file at `path` from (one file); null = not on the Hub
    )

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        super().validate(problems, file, prefix)
        limit = TOKEN_DTYPES[self.token_dtype]
        if self.vocab_size > limit:
            problems.add(
                file,
                join_key(prefix, "token_dtype"),
                f"{self.token_dtype} holds ids below {limit:,} but vocab_size is {self.vocab_size:,}: use uint32",
            )
        if self.vocab_size < 1:
            problems.add(file, join_key(prefix, "vocab_size"), f"must be >= 1, got {self.vocab_size}")
        elif not 0 <= self.eos_id < self.vocab_size:
            problems.add(
                file, join_key(prefix, "eos_id"), f"{self.eos_id} is outside the vocabulary (size {self.vocab_size})"
            )
        sha256_format(problems, file, join_key(prefix, "sha256"), self.sha256)
        if self.hub is not None:
            key = join_key(prefix, "hub")
            self.hub.validate(problems, file, key)
            if len(self.hub.files) != 1 or _GLOB.search(self.hub.files[0]):
                problems.add(file, join_key(key, "files"), f"a tokenizer is one file, not {list(self.hub.files)}")


@dataclass(frozen=True)
class DomainRecipe(Section):
    target_ratio: float = MISSING  #: share of the exposure tokens, in (0, 1]; a mixture's sum to 1
    max_repetition_ratio: float = 1.0  #: max epochs over the domain's pool (>= 1.0)
    source: DomainSource | None = None  #: the raw documents on the Hub; null = prepared by hand or built in

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        if not 0.0 < self.target_ratio <= 1.0:
            problems.add(file, join_key(prefix, "target_ratio"), f"must be in (0, 1], got {self.target_ratio}")
        if self.max_repetition_ratio < 1.0:
            problems.add(
                file,
                join_key(prefix, "max_repetition_ratio"),
                f"must be >= 1.0 (epochs), got {self.max_repetition_ratio}",
            )
        if self.source is not None:
            self.source.validate(problems, file, join_key(prefix, "source"))


# A domain names MLflow metrics (val_loss.<domain>), report columns, the model card's rows and, in the
# built-in corpus, a folder: `co de/..` or `a|b` was taken and broke them.
DOMAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
DOMAIN_NAME_RULE = "a letter or digit, then letters, digits, '_', '.' and '-'; at most 100"


@dataclass(frozen=True)
class MixtureRecipe(Recipe):
    domains: dict[str, DomainRecipe] = field(default_factory=dict)  #: domain name -> its ratio and cap

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        super().validate(problems, file, prefix)
        key = join_key(prefix, "domains")
        if not self.domains:
            problems.add(file, key, "at least one domain is required")
            return
        for d, spec in self.domains.items():
            if not DOMAIN_NAME.fullmatch(str(d)):
                problems.add(file, join_key(key, str(d)[:120]), f"not a domain name ({DOMAIN_NAME_RULE})")
            spec.validate(problems, file, join_key(key, d))
        total = sum(spec.target_ratio for spec in self.domains.values())
        if abs(total - 1.0) > RATIO_SUM_TOLERANCE:
            problems.add(file, key, f"target ratios sum to {total:.6g}, not 1")
