"""The experiment fingerprint: what a run trains, as one sha256.

Owns: the canonical meaning of a resolved config (labels, recipe references and operational keys
left out) and its hash; the keys two configs differ in. Never reads files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from typing import Any

from runner.config.schema import ABSENT_WHEN_NULL, LABEL_KEYS, OMITTED_AT_DEFAULT, OPERATIONAL_KEYS, ExperimentSchema
from runner.errors import RunnerError, join_key
from runner.fsio import canonical_json


def _drop(node: Any, pattern: list[str], *, only_null: bool = False) -> None:
    if not isinstance(node, dict) or not pattern:
        return
    head, rest = pattern[0], pattern[1:]
    keys = list(node) if head == "*" else [head]
    for k in keys:
        if k not in node:
            continue
        if rest:
            _drop(node[k], rest, only_null=only_null)
        elif not only_null or node[k] is None:
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
        node: Any = data
        for k in parents:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and node[leaf] == default:
            del node[leaf]


def canonical_meaning(cfg: ExperimentSchema | dict[str, Any]) -> dict[str, Any]:
    """What the experiment trains: the resolved config (typed, or as saved in a checkpoint) less
    labels, operational keys, the optional sections that are null (ABSENT_WHEN_NULL) and the keys
    of OMITTED_AT_DEFAULT that hold their default."""
    data = dataclasses.asdict(cfg) if isinstance(cfg, ExperimentSchema) else json.loads(json.dumps(cfg))
    data = _strip_labels(data)
    for key in OPERATIONAL_KEYS:
        _drop(data, key.split("."))
    for key in ABSENT_WHEN_NULL:
        _drop(data, key.split("."), only_null=True)
    _drop_at_default(data)
    _same_checkpointing(data)
    return data


def _same_checkpointing(data: dict) -> None:
    """model.activation_checkpointing full is true, none is false: one meaning, one fingerprint
    (true and false, what every earlier experiment says, hash as they always did)."""
    model = data.get("model")
    if isinstance(model, dict) and model.get("activation_checkpointing") in ("full", "none"):
        model["activation_checkpointing"] = model["activation_checkpointing"] == "full"


def fingerprint(cfg: ExperimentSchema | dict[str, Any]) -> str:
    """sha256 of the canonical resolved form (sorted keys, resolved interpolations, numbers as
    JSON). Labels (name, version, description), recipe references and operational keys
    (OPERATIONAL_KEYS) are left out: two files that resolve to the same training share it."""
    meaning = canonical_meaning(cfg)
    try:
        text = canonical_json(meaning)
    except ValueError:  # NaN or infinity: no JSON, so no fingerprint (validation says so first)
        raise RunnerError("must be a finite number", key=_nonfinite_key(meaning)) from None
    return hashlib.sha256(text.encode()).hexdigest()


def _nonfinite_key(node: Any, prefix: str = "") -> str:
    """The dotted key of the first NaN or infinity in a plain config."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = ((f"[{i}]", v) for i, v in enumerate(node))
    else:
        return prefix if isinstance(node, float) and not math.isfinite(node) else ""
    for k, v in items:
        found = _nonfinite_key(v, f"{prefix}{k}" if str(k).startswith("[") else join_key(prefix, k))
        if found:
            return found
    return ""


def diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain configs."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            out += diff_keys(a.get(k), b.get(k), join_key(prefix, k))
        return out
    return [] if a == b else [prefix or "<root>"]
