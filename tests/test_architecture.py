"""The tree's rules, read from the source's imports (every import statement, type-only ones included):
extract and train never import each other and meet only in shards; shards imports neither stage; nothing
outside tools imports tools; and no two modules import each other, directly or around a longer circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("extract", "shards", "train", "tools")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports: `from a.b import c` counts as a.b.c where that is a module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in modules}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


@pytest.mark.parametrize(
    "importer, forbidden",
    [("extract", "train"), ("train", "extract"), ("shards", "extract"), ("shards", "train")]
    + [(package, "tools") for package in ("extract", "shards", "train")],
)
def test_packages_import_only_what_the_layout_allows(graph, importer, forbidden):
    bad = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.split(".")[0] == importer
        for target in targets
        if target.split(".")[0] == forbidden
    )
    assert not bad, "\n".join(bad)


def test_no_import_circle(graph):
    """Depth-first search for a back edge; a package's __init__ re-exporting its own modules is no circle."""

    def edges(module: str) -> list[str]:
        return sorted(t for t in graph[module] if not module.startswith(t + "."))

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in edges(module):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            pytest.fail("import circle: " + " -> ".join(circle))
