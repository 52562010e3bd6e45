"""The experiment fingerprint: what a run trains, as one sha256.

Owns: the canonical meaning of a resolved config (labels, recipe references and operational keys
left out) and its hash; the keys two configs differ in. Never reads files.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.config.schema import LABEL_KEYS, OMITTED_AT_DEFAULT, OPERATIONAL_KEYS
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


def _drop_at_default(data: dict) -> None:
    """Keys added after runs were recorded mean nothing new while they hold their default."""
    for dotted, default in OMITTED_AT_DEFAULT.items():
        *parents, leaf = dotted.split(".")
        node = data
        for k in parents:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and node[leaf] == default:
            del node[leaf]


def canonical_meaning(cfg) -> dict:
    """What the experiment trains: the resolved config less labels, operational keys and the keys
    of OMITTED_AT_DEFAULT that hold their default."""
    data = (
        OmegaConf.to_container(cfg, resolve=True)
        if isinstance(cfg, (DictConfig, ListConfig))
        else json.loads(json.dumps(cfg))
    )
    data = _strip_labels(data)
    for key in OPERATIONAL_KEYS:
        _drop(data, key.split("."))
    _drop_at_default(data)
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
