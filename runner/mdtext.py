"""Strings from recipes, data cards and error messages placed in Markdown the runner writes (the model
card, the pull-request review), so that they read as the text they are and nothing else.

Owns the escaping rules: plain text (no HTML, link, image or emphasis of its own), code spans that no
backtick in the string can close, and links only to plain http(s) addresses.
Never: decides what a document says (runner.export.card_prose, runner.reports.pr_review do).
"""

from __future__ import annotations

import re
from typing import Any

_MARKDOWN = str.maketrans({c: "\\" + c for c in "\\`*_[]!|"} | {"&": "&amp;", "<": "&lt;", ">": "&gt;"})
_URL = re.compile(r"https?://[^\s<>()\[\]\"'`\\|]{1,500}")
_TICKS = re.compile(r"`+")


def text(x: Any) -> str:
    """One line of plain text: HTML (`<img src=...>`, `<!-- ... -->`), links, images (`![t](url)`, a
    tracker fetched wherever the document is read), emphasis and table pipes escaped."""
    return " ".join(str(x).split()).translate(_MARKDOWN)


def link(label: Any, url: Any) -> str:
    """[label](url) where url is a plain http(s) address; else the label alone, as text."""
    shown = text(label)
    return f"[{shown}]({url})" if isinstance(url, str) and _URL.fullmatch(url) else shown


def code(x: Any, in_table: bool = False) -> str:
    """One line as a code span that no backtick inside closes (CommonMark: a fence longer than any run
    of backticks in it); in a table row, its pipes escaped (GFM splits cells at them even in code)."""
    s = " ".join(str(x).split())
    fence = "`" * (max((len(m) for m in _TICKS.findall(s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    span = f"{fence}{pad}{s}{pad}{fence}"
    return span.replace("|", "\\|") if in_table else span
