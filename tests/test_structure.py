"""Issue 11's size limits on kvbench/: no file over 600 lines, no function over 60 lines,
counting a function from its `def` line to its last line (signature, docstring and body;
decorators excluded)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvbench"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no Python files under {PACKAGE}"
    return files


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method in `source`, nested ones too."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_function_lengths_counts_def_to_last_line():
    source = "@decorator\ndef f(\n    x,\n):\n    \"\"\"Doc.\"\"\"\n\n    return x\n"
    assert function_lengths(source) == [("f", 2, 6)]


def test_no_file_over_600_lines():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, long


def test_no_function_over_60_lines():
    long = [f"{p.relative_to(PACKAGE.parent)}:{line} {name}: {n} lines" for p in _sources()
            for name, line, n in function_lengths(p.read_text()) if n > MAX_FUNCTION_LINES]
    assert not long, long
