"""Strings a recipe or a data card carries into the model card are text there: no HTML, no link,
image or emphasis of their own (rendered by markdown-it, HTML on, as the Hub renders cards)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from runner.export import card_prose

REPO = Path(__file__).resolve().parents[2]
HOSTILE = "Tiny. ![t](http://evil.example/p.png) <script>alert(1)</script> [x](javascript:alert(1)) <!-- hidden"


def _html(lines: list[str]) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    return markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render("\n".join(lines) + "\n")


def test_a_recipes_description_and_a_data_cards_fields_are_plain_text_in_the_card():
    """`description: '... <!-- ...'` hid the rest of the card (its proof included) where the Hub renders
    it; `![t](url)` made every reader's browser fetch that url; a data card's `source_url` of
    `javascript:...` was a link. Each is text now, and a plain https link stays a link."""
    from runner.config.load import load_experiment

    cfg = load_experiment(REPO / "experiments" / "cpu-tiny.yaml", check_files=False).config
    cfg = dataclasses.replace(cfg, description=HOSTILE)
    f = {
        "accounting": [{"domain": "code", "exposure_tokens": 1000, "epochs": 0.5}],
        "checkpoint": {"exposure_tokens": 1000},
        "data": [
            {
                "domain": "code",
                "description": HOSTILE,
                "source": "<b>src</b>",
                "source_url": "javascript:alert(1)",
                "licence": "MIT",
                "licence_url": "https://opensource.org/license/mit",
                "revision": "main`; <!--",
            }
        ],
    }
    html = _html(card_prose.description(cfg, f) + [""] + card_prose.training_data(f) + [""] + ["## Audit", "", "proof"])
    for forbidden in ("<script", "<img", "<!--", "<b>", 'href="javascript', 'href="http://evil'):
        assert forbidden not in html, forbidden
    assert "proof" in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert '<a href="https://opensource.org/license/mit">MIT</a>' in html  # a plain link stays one
    assert card_prose.text("pydoc_data.topics, Lib/**/*.py") == "pydoc\\_data.topics, Lib/\\*\\*/\\*.py"
    assert "<em>" not in _html([card_prose.text("Lib/**/*.py of 2-60 kB, _private_ names")])


def test_a_hardware_recipes_peak_source_is_plain_text_in_report_md():
    """peak_source is a hardware recipe's own words, printed in report.md's convention table."""
    import pandas as pd

    from runner.reports.markdown import CONVENTION_KEYS, _md_definitions

    row = pd.Series({k: "x" for k in CONVENTION_KEYS} | {"peak_source": "datasheet <img src=x> | ![t](http://e/p.png)"})
    html = _html(_md_definitions(row))
    assert "<img" not in html and "datasheet &lt;img src=x&gt; | ![t](http://e/p.png)</td>" in html
