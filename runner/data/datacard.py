"""What a domain's data is, where it comes from and under which licence: the data card.

Owns `datacard.json`, written beside a domain's manifest (operational: never pinned, never in a
fingerprint, so describing data moves no experiment), and the descriptions the runner knows itself:
the built-in corpus (what runner/data/builtin/snapshot.py really takes from CPython 3.11) and the Hub
datasets a shipped mixture reads (FineWeb-Edu). The model card states them per domain
(runner.export.card). Never reads or changes a manifest or a pool.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

DATACARD = "datacard.json"
FORMAT = "runner-datacard/1"


@dataclass(frozen=True)
class DataCard:
    description: str  #: what the documents are, in a sentence or two
    source: str  #: where they come from (a project, a dataset id)
    source_url: str
    licence: str  #: an SPDX id or the licence's name
    licence_url: str
    revision: str | None = None  #: the dataset's commit, where one is pinned

    def to_json(self, domain: str) -> dict:
        return {"format": FORMAT, "domain": domain, **asdict(self)}


_PSF = "https://docs.python.org/3.11/license.html"

#: the built-in corpus, as runner/data/builtin/snapshot.py takes it from a CPython 3.11 installation
BUILTIN: dict[str, DataCard] = {
    "code": DataCard(
        "Python source files of CPython 3.11's standard library (Lib/**/*.py of 2-60 kB, tests, IDLE's tests, "
        "turtledemo and ensurepip left out), about 1.5 MB in FineWeb-Edu's parquet columns",
        "CPython 3.11 standard library",
        "https://github.com/python/cpython/tree/3.11/Lib",
        "PSF-2.0",
        _PSF,
    ),
    "prose": DataCard(
        "English prose: the pydoc help topics of CPython 3.11 (pydoc_data.topics, sections of the Python "
        "language reference as plain text)",
        "CPython 3.11 documentation (pydoc_data.topics)",
        "https://github.com/python/cpython/blob/3.11/Lib/pydoc_data/topics.py",
        "PSF-2.0",
        _PSF,
    ),
    "legal": DataCard(
        "Licence texts: CPython 3.11's LICENSE.txt, the LICENSE files of the pip and setuptools wheels "
        "ensurepip bundles (MIT), and the licence comment blocks of standard-library modules; 22 documents",
        "CPython 3.11 (LICENSE.txt, ensurepip's bundled wheels, Lib/ licence notices)",
        "https://github.com/python/cpython/blob/3.11/LICENSE",
        "PSF-2.0 (CPython's texts); MIT (pip's and setuptools' licence files)",
        _PSF,
    ),
}

#: Hub datasets a shipped mixture reads, by repository id (the revision comes from the recipe's pin)
HUB: dict[str, DataCard] = {
    "HuggingFaceFW/fineweb-edu": DataCard(
        "FineWeb-Edu: English web pages from CommonCrawl kept by an educational-quality classifier "
        "(Llama-3-70B annotations distilled into a scorer; pages scoring 3 or more)",
        "HuggingFaceFW/fineweb-edu (Hugging Face Hub dataset)",
        "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu",
        "ODC-By-1.0 (and CommonCrawl's terms of use)",
        "https://opendatacommons.org/licenses/by/1-0/",
    ),
}


def write_datacard(manifest_dir: Path, domain: str, card: DataCard) -> Path:
    path = Path(manifest_dir) / DATACARD
    path.write_text(json.dumps(card.to_json(domain), indent=1) + "\n")
    return path


def read_datacard(manifest_path: Path) -> dict | None:
    """The data card beside a manifest, or None where there is none (or it is not one)."""
    path = Path(manifest_path).parent / DATACARD
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def describe(domain: str, manifest_path: Path, hub_repo: str | None, revision: str | None) -> dict | None:
    """What the model card says of a domain's data: the data card beside its manifest, else the
    runner's own description of its Hub dataset (at the recipe's revision), else None."""
    found = read_datacard(manifest_path)
    if found is not None:
        return {k: found.get(k) for k in ("description", "source", "source_url", "licence", "licence_url", "revision")}
    if hub_repo in HUB:
        return {**asdict(HUB[hub_repo]), "revision": revision}
    return None
