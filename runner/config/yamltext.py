"""Edit a value of a YAML file in place, keeping every comment, blank line and the layout.

Owns: finding a key path in YAML text through PyYAML's node marks (block or flow mappings alike),
replacing the scalar there, or adding the key to its mapping, and proving the edit by parsing the
result (exactly the intended value changed, nothing else). Never decides what to write (the pin
module does) and never writes files.
"""

from __future__ import annotations

from typing import Any

import yaml

from runner.errors import RunnerError


def render_scalar(value: Any) -> str:
    """A scalar as YAML reads it back unchanged: plain where that is safe, quoted where a plain
    string would read as something else (an all-digit hex, `null`, `yes`)."""
    text = yaml.safe_dump([value], default_flow_style=True, width=1 << 20).strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError(f"not a scalar: {value!r}")
    return text[1:-1]


def _find(node: yaml.Node, keys: list[str]) -> tuple[yaml.MappingNode, yaml.Node | None]:
    """(the mapping that holds keys[-1], its value node or None when the key is absent)."""
    for i, k in enumerate(keys):
        if not isinstance(node, yaml.MappingNode):
            raise KeyError(".".join(keys[:i]))
        value = next((v for kn, v in node.value if isinstance(kn, yaml.ScalarNode) and kn.value == k), None)
        if i == len(keys) - 1:
            return node, value
        if value is None:
            raise KeyError(".".join(keys[: i + 1]))
        node = value
    raise KeyError("")


def _insert(text: str, mapping: yaml.MappingNode, key: str, rendered: str) -> str:
    if mapping.flow_style:
        at = len(text[: mapping.end_mark.index - 1].rstrip())  # after the last item, before `}`
        sep = "" if text[:at].endswith("{") else ", "
        return f"{text[:at]}{sep}{key}: {rendered}{text[at:]}"
    if not mapping.value:
        raise KeyError(key)
    first_key, last = mapping.value[0][0], mapping.value[-1][1]
    while isinstance(last, (yaml.MappingNode, yaml.SequenceNode)) and not last.flow_style and last.value:
        last = last.value[-1][1] if isinstance(last, yaml.MappingNode) else last.value[-1]
    line_end = text.find("\n", last.end_mark.index - 1)  # the end of the mapping's last line of content
    line_end = len(text) if line_end == -1 else line_end
    line = f"\n{' ' * first_key.start_mark.column}{key}: {rendered}"
    return text[:line_end] + line + text[line_end:]


def set_value(text: str, keys: list[str], value: Any, *, file: str = "") -> str:
    """`text` with the scalar at `keys` set to `value` (added to its mapping when absent)."""
    rendered = render_scalar(value)
    try:
        mapping, node = _find(yaml.compose(text), keys)
        if node is None:
            out = _insert(text, mapping, keys[-1], rendered)
        elif isinstance(node, yaml.ScalarNode) and node.start_mark.line == node.end_mark.line:
            out = text[: node.start_mark.index] + rendered + text[node.end_mark.index :]
        else:
            raise KeyError(".".join(keys))
    except (KeyError, yaml.YAMLError) as e:
        raise RunnerError(
            f"cannot edit this key in place ({e}): edit it by hand", file=file, key=".".join(keys)
        ) from None
    _prove(text, out, keys, value, file)
    return out


def _prove(before: str, after: str, keys: list[str], value: Any, file: str) -> None:
    """The edit changed exactly `keys` to `value`: parse both and compare."""
    expected = yaml.safe_load(before)
    node = expected
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    if yaml.safe_load(after) != expected:
        raise RunnerError(
            "an in-place edit would change more than this key: edit it by hand", file=file, key=".".join(keys)
        )
