"""The import graph of runner/: every arrow points down the layers, and no two modules import each other.

The layer order (bottom first) is `LAYERS` below; docs/DESIGN.md ("Map") says the same in prose. Why this order:

- base (`errors`, then `fsio`, `hashcache`, `bytecode`, `progress`, `mdtext` and `host`): the error format,
  atomic writes, the cache of files already hashed, where compiled modules are cached, the escaping of
  strings put into Markdown, and the cores this process may use, used by everything.
- config: the typed experiment and the rules that need nothing but the experiment; a saved experiment.yaml
  in a run folder is configuration too, so config may read it.
- data: tokenizers, fetch and pins, manifests, the mixture and the sampler; they read configs.
- planning: pure arithmetic over recipes and numbers (FLOPs, hardware peaks, plan, scaling-law fits of
  given points). It sits below training because the trainer computes its MFU and its plan with the very
  functions the planner uses, and the planner never reads a run folder: what reads run folders (a pilot
  run's points, a run's measured throughput) lives in training/ or reports/ and hands numbers down.
- runs: the run folder's format (its layout and lock, run.json's typed record, what a run recorded, its
  checkpoints as a reader sees them, the step record, the resume identity): training writes through it; reports, export and cli read through it.
- training: the loop and its components, and what they write into the run folder (records).
- reports: tables, audit, claims, publish, compare; they read run folders and MLflow.
- export: reads audited reports. cli (and `python -m runner`): argument parsing on top, imported by nothing.

Every import counts: module level, deferred (inside a function) and `if TYPE_CHECKING:` ones, since a
type-only import is still a dependency a reader has to hold in the head, and a type-only circle is a
circle. The failure message names each offending arrow or circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Bottom to top. A module belongs to the layer whose prefix names it most exactly (`runner.data` holds
#: runner.data.sampler); the bare package name `runner` (its __init__) names only itself.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors", ("runner", "runner.errors")),
    ("base", ("runner.fsio", "runner.hashcache", "runner.bytecode", "runner.progress", "runner.mdtext", "runner.host")),
    ("config", ("runner.config",)),
    ("data", ("runner.data",)),
    ("planning", ("runner.planning",)),
    ("runs", ("runner.runs",)),
    ("training", ("runner.training",)),
    ("reports", ("runner.reports",)),
    ("export", ("runner.export",)),
    ("cli", ("runner.cli", "runner.__main__")),
)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, every import statement anywhere in the file counted."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    targets.add(_known_prefix(alias.name, files))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    # `from runner.reports import targets` imports the module runner.reports.targets
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in files else _known_prefix(source, files))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def _known_prefix(dotted: str, files: Mapping[str, Path]) -> str:
    """The longest prefix of `dotted` that is a module of the package ('' for a third-party import)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in files:
            return ".".join(parts[:n])
    return ""


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int:
    best = (-1, -1)  # (length of the matching prefix, layer index)
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            inside = module == prefix or ("." in prefix and module.startswith(prefix + "."))
            if inside and len(prefix) > best[0]:
                best = (len(prefix), index)
    if best[1] < 0:
        raise AssertionError(f"{module}: in no layer of tests/repo/test_import_graph.py LAYERS; give it one")
    return best[1]


def upward_arrows(
    graph: Mapping[str, Iterable[str]], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS
) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets if layer_of(a, layers) < layer_of(b, layers)}


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(graph) | {b for targets in graph.values() for b in targets})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def graph_problems(
    graph: Mapping[str, Iterable[str]],
    layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS,
) -> list[str]:
    """One line per upward arrow and per circle."""
    names = [name for name, _ in layers]
    up = upward_arrows(graph, layers)
    lines = [
        f"upward arrow {a} -> {b} ({names[layer_of(a, layers)]} imports {names[layer_of(b, layers)]})"
        for a, b in sorted(up)
    ]
    lines += ["import circle: " + " <-> ".join(c) for c in circles(graph)]
    return lines


def test_every_import_points_down_and_no_circles():
    problems = graph_problems(import_graph(REPO / "runner"))
    assert not problems, "\n".join(problems)


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "runner"


def test_the_check_finds_an_upward_arrow_and_a_type_only_circle(tmp_path):
    runner = _write(
        tmp_path,
        {
            "runner/__init__.py": "",
            "runner/errors.py": "",
            "runner/config/__init__.py": "",
            # deferred, upward: config reads data
            "runner/config/pin.py": "def f():\n    from runner.data.fetch import g  # noqa\n",
            "runner/data/__init__.py": "",
            "runner/data/fetch.py": "from runner.errors import X\n",
            # a circle only through a type hint, one side relative
            "runner/reports/__init__.py": "",
            "runner/reports/audit.py": "from runner.reports import evidence\n",
            "runner/reports/evidence.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .audit import AuditInput\n"
            ),
        },
    )
    graph = import_graph(runner)
    assert graph["runner.config.pin"] == {"runner.data.fetch"}
    assert graph["runner.reports.evidence"] == {"runner.reports.audit"}
    assert graph_problems(graph) == [
        "upward arrow runner.config.pin -> runner.data.fetch (config imports data)",
        "import circle: runner.reports.audit <-> runner.reports.evidence",
    ]


def test_a_module_outside_every_layer_is_named():
    with pytest.raises(AssertionError, match="runner.somewhere: in no layer"):
        layer_of("runner.somewhere", (("config", ("runner.config",)),))
