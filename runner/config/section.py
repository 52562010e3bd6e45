"""The base of the schema: what every section and recipe of runner.config.schema is made of.

Owns: `Section` (a part of the resolved config with its own `validate`), `Recipe` (the labels every
recipe carries), the marker of a required value, the shared per-value checks, and `from_plain`
(a schema dataclass from plain data, for scripts without OmegaConf).
Imports nothing but the standard library and runner.errors.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from runner.errors import Problems, join_key

#: OmegaConf's marker of a value a recipe or experiment must give (no default)
MISSING: Any = "???"
#: numpy's seed range, which torch's and Python's generators also accept.
SEED_MAX = 2**32 - 1
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

File = Path | str | None
S = TypeVar("S")


class Section:
    """A section of the resolved config. `validate` adds a `file: prefix.key: message` problem per
    value its type cannot rule out; a section without such rules keeps this one."""

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        """No rule beyond the field types."""


def at_least_one(problems: Problems, file: File, prefix: str, section: Any, keys: tuple[str, ...]) -> None:
    for k in keys:
        value = getattr(section, k)
        if value < 1:
            problems.add(file, join_key(prefix, k), f"must be >= 1, got {value}")


def within(
    problems: Problems,
    file: File,
    prefix: str,
    section: Any,
    key: str,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    means: str = "",
) -> None:
    """`section.key` in [low, high] ((low, high] where `low_open`; no upper end where `high` is None),
    or one problem naming the range and what the value means. null and a value that is not a number
    (a required one missing, said elsewhere) are left to the other checks."""
    value = getattr(section, key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if (value > low if low_open else value >= low) and (high is None or value <= high):
        return
    top = "" if high is None else f", {_number(high)}]"
    rule = (
        f"must be in {'(' if low_open else '['}{_number(low)}{top}"
        if top
        else f"must be {'>' if low_open else '>='} {_number(low)}"
    )
    problems.add(file, join_key(prefix, key), f"{rule}{f' ({means})' if means else ''}, got {_number(value)}")


def _number(x: float) -> str:
    """1,000,000 for a whole number a person reads at a glance, else Python's shortest (0.5, 1e+24)."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def sha256_format(problems: Problems, file: File, key: str, value: str | None) -> None:
    if value is not None and not SHA256_HEX.match(str(value)):
        problems.add(file, key, "must be 64 lowercase hex characters")


@dataclass(frozen=True)
class Recipe(Section):
    """The labels every recipe carries; the experiment's `recipes:` names it as name@version."""

    name: str = MISSING  #: = the recipe's file name
    version: int = MISSING  #: an integer >= 1, bumped on every change
    description: str = MISSING  #: what it is for, in a sentence

    def validate(self, problems: Problems, file: File, prefix: str) -> None:
        if self.version < 1:
            problems.add(file, join_key(prefix, "version"), f"must be an integer >= 1, got {self.version!r}")


def from_plain(schema: type[S], data: Mapping[str, Any]) -> S:
    """A schema dataclass from plain data, every key it lacks at its default; no validation and no
    OmegaConf (for scripts that carry only torch, and for callers holding a plain resolved config)."""
    hints = typing.get_type_hints(schema)
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        if k not in hints:
            continue
        typ = hints[k]
        args = typing.get_args(typ)
        if type(None) in args:
            typ = next(a for a in args if a is not type(None))
        if isinstance(v, Mapping) and isinstance(typ, type) and is_dataclass(typ):
            v = from_plain(typ, v)
        elif isinstance(v, Mapping) and typing.get_origin(typ) is dict:
            item = typing.get_args(typ)[1]
            if isinstance(item, type) and is_dataclass(item):
                v = {name: from_plain(item, x) if isinstance(x, Mapping) else x for name, x in v.items()}
        kwargs[k] = v
    return schema(**kwargs)
