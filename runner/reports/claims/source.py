"""Where a claim was published: its `source`, structured so that a reader can find it.

Owns: what a structured source states (`title`, `year`, and at least one of `url`, `doi`, `arxiv`,
optionally `section`: the table or section the figures come from), checking each field's form, the
one line a verdict prints it as, and the warning for a claims file whose sources are free text
(today's format, still read) or missing. A source is recorded, not fetched: nothing here reaches
the network or proves that the document says what the claim transcribes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from runner.errors import RunnerError

FIELDS = ("title", "year", "url", "doi", "arxiv", "section")
LOCATORS = ("url", "doi", "arxiv")
_URL = re.compile(r"^https?://[^\s/$.?#][^\s]*$")
_DOI = re.compile(r"^10\.\d{4,9}/\S+$")
_ARXIV = re.compile(r"^(\d{4}\.\d{4,5}|[a-z][a-z.-]*(\.[A-Z]{2})?/\d{7})(v\d+)?$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
YEARS = (1900, 2100)


@dataclass(frozen=True)
class Source:
    title: str
    year: int
    url: str | None = None
    doi: str | None = None
    arxiv: str | None = None
    section: str | None = None

    def render(self) -> str:
        where = [f"arXiv:{self.arxiv}" if self.arxiv else "", f"doi:{self.doi}" if self.doi else "", self.url or ""]
        part = f", {self.section}" if self.section else ""
        return f"{self.title} ({self.year}){part}; {', '.join(w for w in where if w)}"


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip() or _CONTROL.search(value):
        raise RunnerError(
            f"must be a non-empty one-line string, got {str(value)[:40]!r}", file=where, key=f"source.{key}"
        )
    return value.strip()


def parse_source(value: Any, where: str) -> Source | str | None:
    """A structured Source, the free text of a claim in today's format, or None (no source);
    RunnerError naming `source.<field>` for a structured source that is malformed."""
    if value is None:
        return None
    if isinstance(value, str):
        return _text(value, where, "")[:200] if value.strip() else None
    if not isinstance(value, dict):
        raise RunnerError(
            "must be {title, year, and url, doi or arxiv} (or free text, read with a warning)",
            file=where,
            key="source",
        )
    unknown = sorted(set(map(str, value)) - set(FIELDS))
    if unknown:
        raise RunnerError(f"unknown keys {unknown} (known: {', '.join(FIELDS)})", file=where, key="source")
    title = _text(value.get("title"), where, "title")
    year = value.get("year")
    if isinstance(year, bool) or not isinstance(year, int) or not YEARS[0] <= year <= YEARS[1]:
        raise RunnerError(
            f"must be a year ({YEARS[0]}-{YEARS[1]}), got {str(year)[:20]!r}", file=where, key="source.year"
        )
    got = {k: _text(value[k], where, k) for k in (*LOCATORS, "section") if value.get(k) is not None}
    if not any(k in got for k in LOCATORS):
        raise RunnerError("names no url, doi or arxiv id: a reader could not find it", file=where, key="source")
    for key, pattern, form in (
        ("url", _URL, "an http(s) URL"),
        ("doi", _DOI, "a DOI (10.NNNN/...)"),
        ("arxiv", _ARXIV, "an arXiv id (2302.13971, hep-th/9901001)"),
    ):
        if key in got and not pattern.match(got[key]):
            raise RunnerError(f"must be {form}, got {got[key][:60]!r}", file=where, key=f"source.{key}")
    return Source(title, year, **got)


def source_line(source: Source | str | None) -> str:
    """The line printed under a claim's verdict."""
    if isinstance(source, Source):
        return f"source: {source.render()} (recorded, not fetched)"
    if isinstance(source, str):
        return f"source: {source!r} (free text: not checked)"
    return "source: none stated"


def free_text_warning(file: str, sources: list[Source | str | None]) -> str | None:
    """One warning for a claims file whose claims state a free-text source or none, naming them."""
    loose = [(i, s) for i, s in enumerate(sources) if not isinstance(s, Source)]
    if not loose:
        return None
    named = ", ".join(f"claims[{i}] {s!r}" if s else f"claims[{i}] (none)" for i, s in loose[:3])
    more = f" and {len(loose) - 3} more" if len(loose) > 3 else ""
    return (
        f"warning: {file}: {len(loose)} of {len(sources)} claims state no structured source ({named}{more}): "
        "state source: {title, year, url or doi or arxiv} so a reader can find it"
    )
