"""What the warm-start template imports before it forks workers: ``torch``, the package, the
worker script's top-level imports, and the modules the user names with ``--preload``.

The script's imports are read with ``ast``, never by running it: the ``import`` and ``from ...
import`` statements of its module body (and of top-level ``try``/``if`` blocks), absolute ones
only. Its body is not run in the template; every worker runs it after the fork. Owns the list;
importing is the template's (``elastic.launch.template_process``).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

#: Imported by every template: what every worker of ``elastic run`` imports anyway, including
#: what torch and the package import only when first used (an optimizer imports
#: ``torch._dynamo``, ElasticState the etcd client and the collectives): seconds of imports.
ALWAYS = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
          "elastic.elastic_state")


def script_imports(path: str) -> list[str]:
    """The modules that ``path``'s top-level import statements name, in order, once each; []
    when the file cannot be read or parsed (the worker reports that itself)."""
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []
    for node in _top_level(tree.body):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return list(dict.fromkeys(found))


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of ``body`` and of the ``try``/``if`` blocks in it (not functions)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.Try):
            out += _top_level(node.body)
        elif isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
    return out


def module_file(name: str) -> str | None:
    """The source file of module ``name`` (for ``-m name``), without running it; None when it
    cannot be found (its parent packages are imported to look)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if spec.submodule_search_locations:  # a package: `-m pkg` runs pkg/__main__.py
        main = Path(spec.origin).with_name("__main__.py")
        return str(main) if main.is_file() else None
    return spec.origin


def parse_preload(raw: str) -> tuple[str, ...]:
    """``--preload a,b.c``: the module names, checked.

    Raises:
        ValueError: a name is not a dotted Python module name.
    """
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    for name in names:
        if not all(piece.isidentifier() for piece in name.split(".")):
            raise ValueError(f"--preload {raw!r}: {name!r} is not a module name; give "
                             "comma-separated module names such as torch,transformers.")
    return names
