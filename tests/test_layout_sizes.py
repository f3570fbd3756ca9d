"""Small modules with one job each (issue 30, item 1): no module of the package is over 600 lines
and no function over 100; the aim is 400 and 60, and the figures are printed when they fail."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "prism_challenge"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to the body's last line) of every function in ``path``."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{prefix}{child.name}", child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def test_the_size_rules_see_the_whole_package():
    names = {str(p.relative_to(PACKAGE)) for p in _modules()}
    assert {"pipeline/__init__.py", "evaluator/feeder.py", "gates/param_count.py", "service/app.py"} <= names
    assert len(names) > 150
    lengths = dict(_functions(PACKAGE / "pipeline" / "__init__.py"))
    source = (PACKAGE / "pipeline" / "__init__.py").read_text().splitlines()
    start = next(i for i, line in enumerate(source) if line.startswith("def evaluate("))
    end = next(i for i, line in enumerate(source[start + 1:], start + 1) if line.startswith("def "))
    while not source[end - 1].strip():
        end -= 1
    assert lengths["evaluate"] == end - start  # counted by hand: from its def to its last line


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_100_lines():
    long = {f"{p.relative_to(PACKAGE)}:{name}": n for p in _modules() for name, n in _functions(p)
            if n > MAX_FUNCTION_LINES}
    assert long == {}
