"""Import cycles in the source, read from the AST: every import counts, at any depth of a file,
``TYPE_CHECKING`` blocks and imports inside functions included.

A cycle is a strongly connected set of two or more modules (or a module importing itself):
``from a.b import c`` is an import of the module ``a.b.c`` when such a file exists, else of
``a.b``. Only the project's own modules (``elastic``, ``state``, ``checkpoint`` as installed)
are nodes; the lazy re-exports of ``elastic/__init__.py`` are not imports.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.layering import SOURCES, module_name
from tests.support.parsed_source import import_statements


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every project module under ``root`` and the project modules it imports."""
    paths = {module_name(root, path): path
             for folder in SOURCES for path in sorted((root / folder).rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for statement in import_statements(path, package):
            base = statement.base
            if base is None:
                found.update(statement.names)
                continue
            for name in statement.names:
                found.add(f"{base}.{name}" if f"{base}.{name}" in paths else base)
        graph[module] = {imported for imported in found if imported in paths}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of ``graph`` that are cycles, each sorted (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)
