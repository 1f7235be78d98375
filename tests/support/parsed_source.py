"""What the source checkers read from a file, worked out once per distinct text for the session.

The source checkers (literal timeouts, layering, import cycles) read every file of the package,
and their planted-fault tests read a fresh copy of it per case in which all files but one are
unchanged: keyed by the text, each file is parsed and walked once.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ImportStatement:
    """One ``import`` or ``from ... import`` anywhere in a file (relative bases resolved)."""

    line: int
    base: str | None  # the module of ``from base import ...``; None for ``import ...``
    names: tuple[str, ...]  # the modules of ``import``, or the names of ``from ... import``


def parse(path: Path) -> ast.Module:
    """The tree of ``path``'s source.

    Raises:
        SyntaxError: the file does not parse; the error names ``path``.
    """
    return ast.parse(path.read_text(), str(path))


def cached_by_text(read: Callable[[ast.Module], T]) -> Callable[[Path], T]:
    """``read`` of a file's tree, computed once per distinct text (``read`` must be pure and
    its result never changed)."""
    @functools.lru_cache(maxsize=None)
    def of_text(text: str) -> T:
        return read(ast.parse(text))

    def of_path(path: Path) -> T:
        text = path.read_text()
        try:
            return of_text(text)
        except SyntaxError:
            return read(parse(path))  # raises again, naming the file

    return of_path


def import_statements(path: Path, package: str) -> tuple[ImportStatement, ...]:
    """Every import of ``path`` (a module of ``package``), at any depth of the file."""
    return tuple(_resolved(_raw_imports(path), package))


_Raw = tuple[tuple[int, int, "str | None", tuple[str, ...]], ...]


def _resolved(raw: _Raw, package: str) -> Iterator[ImportStatement]:
    for line, level, base, names in raw:
        if level:
            anchor = package.split(".")[: len(package.split(".")) - level + 1]
            base = ".".join(anchor + ([base] if base else []))
        yield ImportStatement(line, base, names)


def _imports_of_tree(tree: ast.Module) -> _Raw:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.append((node.lineno, 0, None, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module or "",
                          tuple(alias.name for alias in node.names)))
    return tuple(found)


_raw_imports = cached_by_text(_imports_of_tree)
