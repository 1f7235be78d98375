"""Finds literal timeouts in the source: every duration must come from ``Timeouts``
(``elastic.foundation.timeouts``).

Read from the AST, so that comments, strings and docstrings never count. What counts as a
literal timeout (a literal: a number other than 0, or arithmetic of numbers only):

- a ``timedelta(...)`` call with a literal argument;
- a ``timeout=`` keyword (any keyword naming a timeout) that is a literal, or a sum with one;
- a literal passed positionally to a wait: ``wait``, ``join``, ``sleep``, ``settimeout``,
  ``result``, ``wait_for``;
- a literal argument of a retry policy's pause or deadline (``wait_*``, ``stop_after_delay``);
- a name (constant, attribute, variable, field; unpacked ones too) or a parameter default
  whose name says it is a duration (``*_s``, ``*_ms``, ``*timeout*``, ``*ttl*``, ``*grace*``,
  ``*interval*``, ``*backoff*``, ``*deadline*``, ``*poll*``, any case) bound to a literal;
- a dict entry whose string key names a timeout, keepalive or backoff, with a literal value.

- ``min``/``max`` of a literal and a name that says it is a duration (``min(1.0, backoff_s)``).

Clamps such as ``max(deadline - now, 0.001)`` (never pass zero or less) are not timeouts and do
not count.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from tests.support.parsed_source import cached_by_text

_WAITS = {"wait", "join", "sleep", "settimeout", "result", "wait_for"}
_DURATION_NAME = re.compile(r"(_S|_MS)$|TIMEOUT|TTL|GRACE|INTERVAL|BACKOFF|DEADLINE|POLL")
_DURATION_KEY = re.compile(r"timeout|keepalive|backoff|interval", re.IGNORECASE)


@dataclass(frozen=True)
class Finding:
    """One literal timeout in the source."""

    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _is_literal(node: ast.AST) -> bool:
    """A non-zero number, or arithmetic of numbers only (``5``, ``2 * 60``, ``-1.5``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool) \
            and node.value != 0
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        numbers = [n for n in (node.left, node.right) if not _is_zero(n)]
        return bool(numbers) and all(_is_literal(n) or _is_zero(n)
                                     for n in (node.left, node.right))
    return False


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _has_literal_term(node: ast.AST) -> bool:
    """A literal, or a sum/difference with a literal term (``rpc_s + 5``)."""
    if _is_literal(node):
        return True
    return isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and (
        _has_literal_term(node.left) or _has_literal_term(node.right))


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _name_of(node: ast.AST) -> str:
    return getattr(node, "id", None) or getattr(node, "attr", None) or ""


def _in_call(call: ast.Call) -> list[str]:
    name = _call_name(call)
    found = []
    arguments = list(call.args) + [k.value for k in call.keywords]
    if name == "timedelta" and any(_is_literal(a) for a in arguments):
        found.append("timedelta(...) with a literal")
    if (name.startswith("wait_") or name == "stop_after_delay") and any(
            _is_literal(a) for a in arguments):
        found.append(f"{name}(...) with a literal pause or deadline")
    if name in _WAITS and any(_is_literal(a) for a in call.args):
        found.append(f"{name}(<literal>)")
    if name in ("min", "max") and any(_is_literal(a) for a in call.args) and any(
            _DURATION_NAME.search(_name_of(a).upper()) for a in call.args):
        found.append(f"{name}(...) bounds a duration by a literal")
    for keyword in call.keywords:
        if keyword.arg and "timeout" in keyword.arg and _has_literal_term(keyword.value):
            found.append(f"{keyword.arg}=<literal>")
    return found


def _in_defaults(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return [f"parameter {a.arg} defaults to a literal" for a, d in pairs
            if _DURATION_NAME.search(a.arg.upper()) and _is_literal(d)]


def _in_assignment(node: ast.Assign | ast.AnnAssign) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    if node.value is None:
        return []
    pairs = [(t, node.value) for t in targets]
    for target in targets:  # unpacking: ``first_s, most_s = 1.0, 5.0``
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                and len(target.elts) == len(node.value.elts):
            pairs += zip(target.elts, node.value.elts)
    return [f"{_name_of(t)} = <literal>" for t, value in pairs
            if _is_literal(value) and _DURATION_NAME.search(_name_of(t).upper())]


def _in_dict(node: ast.Dict) -> list[tuple[int, str]]:
    return [(key.lineno, f"{key.value!r}: <literal>")
            for key, value in zip(node.keys, node.values)
            if isinstance(key, ast.Constant) and isinstance(key.value, str)
            and _DURATION_KEY.search(key.value) and _is_literal(value)]


def _findings_in_tree(tree: ast.Module) -> tuple[tuple[int, str], ...]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        whats: list[str] = []
        if isinstance(node, ast.Call):
            whats = _in_call(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            whats = _in_defaults(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            whats = _in_assignment(node)
        elif isinstance(node, ast.Dict):
            found += _in_dict(node)
        found += [(node.lineno, what) for what in whats]
    return tuple(sorted(found, key=lambda f: f[0]))


_findings_of = cached_by_text(_findings_in_tree)


def findings_in(path: Path) -> list[Finding]:
    """Every literal timeout in one source file."""
    return [Finding(path, line, what) for line, what in _findings_of(path)]


def literal_timeouts(root: Path, places: tuple[str, ...],
                     allowed: frozenset[tuple[str, str]] = frozenset()) -> list[Finding]:
    """Every literal timeout under ``places`` (folders or files relative to ``root``), except
    ``allowed`` (relative path, finding) pairs."""
    found = []
    for place in places:
        target = root / place
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            relative = path.relative_to(root).as_posix()
            found += [f for f in findings_in(path) if (relative, f.what) not in allowed]
    return found
