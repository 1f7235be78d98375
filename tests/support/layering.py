"""The layering rule of the project, read from the source: which module may import which.

Every module of the installed ``elastic`` namespace belongs to one layer. Imports point down
only; the shared vocabulary (``elastic.foundation``: errors, timeouts, settings, events,
signals) may be imported by every layer of ``elastic`` but imports none of them. The cluster
layer is three rooms and the facade above them: the etcd client (``elastic.cluster.etcd``), the
round protocol on it (``elastic.cluster.rounds``), one round's links (``elastic.cluster.links``),
and ``elastic.cluster`` itself, which puts them together. Imports of a bare ``state`` or
``checkpoint`` are always wrong: installed, those packages live under ``elastic`` only, and a
user's own ``state.py`` would answer such an import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.parsed_source import import_statements

# Source folder -> the package it installs as (pyproject.toml's package-dir).
SOURCES = {"elastic": "elastic", "state": "elastic.state", "checkpoint": "elastic.checkpoint"}

FOUNDATION = frozenset({"elastic.foundation"})

# What each layer may import (besides itself, and the standard library and third parties).
_CLUSTER_ROOMS = {"links", "rounds", "etcd", "foundation"}
ALLOWED = {
    "checkpoint": {"checkpoint"},
    "state": {"state", "checkpoint"},
    "foundation": {"foundation"},
    "etcd": {"etcd", "foundation"},
    "rounds": {"rounds", "etcd", "foundation"},
    "links": {"links", "rounds", "etcd", "foundation", "state", "checkpoint"},
    "cluster": {"cluster"} | _CLUSTER_ROOMS | {"state", "checkpoint"},
    "run_loop": {"run_loop", "cluster"} | _CLUSTER_ROOMS | {"state", "checkpoint"},
    "launch": {"launch", "run_loop", "cluster"} | _CLUSTER_ROOMS | {"state", "checkpoint"},
}

# Package prefix -> layer, the most specific first.
_PREFIXES = (("elastic.checkpoint", "checkpoint"), ("elastic.state", "state"),
             ("elastic.cluster.etcd", "etcd"), ("elastic.cluster.rounds", "rounds"),
             ("elastic.cluster.links", "links"), ("elastic.cluster", "cluster"),
             ("elastic.launch", "launch"))


def layer_of(module: str) -> str | None:
    """The layer of an ``elastic`` module, or None for a module outside the project."""
    if module in ("elastic", "elastic.__main__"):
        return "launch"  # the public face and ``python -m elastic`` sit on top of everything
    if not module.startswith("elastic."):
        return None
    if module in FOUNDATION or any(module.startswith(f + ".") for f in FOUNDATION):
        return "foundation"
    for prefix, layer in _PREFIXES:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "run_loop"


@dataclass(frozen=True)
class Violation:
    """One import against the rule."""

    path: Path
    line: int
    importer: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported} ({self.why})"


def module_name(root: Path, path: Path) -> str:
    """The installed module name of a source file under ``root``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts[0] = SOURCES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at any depth of the file), with its line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for statement in import_statements(path, package):
        line, base = statement.line, statement.base
        if base is None:
            found += [(line, name) for name in statement.names]
            continue
        found.append((line, base))
        if base != "elastic":  # the root's names are re-exports, judged as the root
            found += [(line, f"{base}.{name}") for name in statement.names
                      if layer_of(f"{base}.{name}") != layer_of(base)]
    return found


def violations(root: Path) -> list[Violation]:
    """Every import under ``root``'s source folders that breaks the layering rule."""
    found = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(root, path)
            mine = layer_of(module)
            for line, imported in imports_of(path, module):
                top = imported.split(".")[0]
                if top in ("state", "checkpoint"):
                    found.append(Violation(path, line, module, imported,
                                           f"use elastic.{imported}: a bare {top} can be "
                                           f"shadowed by a user's file"))
                    continue
                theirs = layer_of(imported)
                if theirs is None or mine is None or theirs == mine:
                    continue
                if theirs not in ALLOWED[mine]:
                    found.append(Violation(path, line, module, imported,
                                           f"the {mine} layer may not import the {theirs} layer"))
    return found
