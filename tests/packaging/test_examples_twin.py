"""The promise "a few lines make it elastic", held to a number: the elastic twin of the
single-process digits example differs from it in at most 8 lines of code (docstrings,
comments and blank lines aside)."""

from __future__ import annotations

import ast
import difflib
import io
import tokenize
from pathlib import Path

import pytest

from tests.support.harness import REPO

pytestmark = pytest.mark.unit
EXAMPLES = REPO / "examples"


def code_lines(path: Path) -> list[str]:
    """The file's lines of code: without its docstrings, comments and blank lines."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    comments = {tok.start[0]: tok.start[1] for tok in
                tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        line = line[:comments[number]] if number in comments else line
        if line.strip() and number not in docstrings:
            lines.append(line.rstrip())
    return lines


def test_the_elastic_digits_example_differs_from_the_single_one_in_at_most_8_lines_of_code():
    single = code_lines(EXAMPLES / "digits_single.py")
    elastic = code_lines(EXAMPLES / "digits_elastic.py")
    diff = [line for line in difflib.ndiff(single, elastic) if line[:2] in ("- ", "+ ")]
    added = [line for line in diff if line.startswith("+ ")]
    removed = [line for line in diff if line.startswith("- ")]
    assert max(len(added), len(removed)) <= 8, "\n".join(diff)
