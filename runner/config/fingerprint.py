"""The experiment fingerprint: what a run trains, as one sha256.

Owns: the canonical meaning of a resolved config (labels, recipe references and operational keys
left out) and its hash; the keys two configs differ in. Never reads files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.config.schema import LABEL_KEYS, OMITTED_WHEN_NULL, OPERATIONAL_KEYS
from runner.errors import join_key
from runner.fsio import canonical_json


def _drop(node: Any, pattern: list[str]) -> None:
    if not isinstance(node, dict) or not pattern:
        return
    head, rest = pattern[0], pattern[1:]
    keys = list(node) if head == "*" else [head]
    for k in keys:
        if k not in node:
            continue
        if rest:
            _drop(node[k], rest)
        else:
            del node[k]


def _strip_labels(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_labels(v) for k, v in node.items() if k not in LABEL_KEYS}
    if isinstance(node, list):
        return [_strip_labels(v) for v in node]
    return node


def _drop_null(node: Any, path: list[str]) -> None:
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict) and path[-1] in node and node[path[-1]] is None:
        del node[path[-1]]


def canonical_meaning(cfg) -> dict:
    """What the experiment trains: the resolved config less labels and operational keys, and less
    the keys of OMITTED_WHEN_NULL while null (a dense model's `model.moe`), so that adding them
    changed no earlier fingerprint."""
    data = (
        OmegaConf.to_container(cfg, resolve=True)
        if isinstance(cfg, (DictConfig, ListConfig))
        else json.loads(json.dumps(cfg))
    )
    data = _strip_labels(data)
    for key in OPERATIONAL_KEYS:
        _drop(data, key.split("."))
    for key in OMITTED_WHEN_NULL:
        _drop_null(data, key.split("."))
    return data


def fingerprint(cfg) -> str:
    """sha256 of the canonical resolved form (sorted keys, resolved interpolations, numbers as
    JSON). Labels (name, version, description), recipe references and operational keys
    (OPERATIONAL_KEYS) are left out: two files that resolve to the same training share it."""
    return hashlib.sha256(canonical_json(canonical_meaning(cfg)).encode()).hexdigest()


def diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain configs."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            out += diff_keys(a.get(k), b.get(k), join_key(prefix, k))
        return out
    return [] if a == b else [prefix or "<root>"]
