"""The gate never crashes: sources too deep or too large to check become ``prism:too-complex``.

A hostile bundle can make the gate's own recursion fail (a 1500-level attribute chain
``a.b.b.b...``, a deeply nested expression) or exhaust memory while parsing. Such a file is
refused with a blocking finding at its file and line, never with a traceback:

* :func:`nesting_finding`: a parsed tree nested deeper than :data:`MAX_DEPTH` (checked
  iteratively, before any recursive pass sees it);
* :func:`too_complex`: the finding for any exception raised while parsing, indexing or checking
  a file (:func:`guarded` wraps a gate step).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import TypeVar

from prism_challenge.gates.findings import Finding

TOO_COMPLEX = "prism:too-complex"

MAX_DEPTH = 200
"""Deepest AST nesting (node levels) a bundle file may have. Model code stays far below it
(the kitchen-sink GPT in the tests nests about 20 levels; the parser itself refuses 200 nested
brackets); the gate's recursive passes stay well inside Python's recursion limit at this
depth."""

PARSER_LIMITS = ("too many nested parentheses", "too many levels of indentation", "too many statically nested blocks")
"""``SyntaxError`` messages of the parser's own nesting limits: reported as too complex."""

T = TypeVar("T")


def too_complex(rel: str, line: int, what: str) -> Finding:
    """The blocking ``prism:too-complex`` finding for file ``rel`` at ``line``."""
    return Finding(TOO_COMPLEX, rel, line, 0, f"too complex for the gate to check: {what}")


def describe(exc: BaseException) -> str:
    """One line naming an exception (type and first line of its message)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def deepest(tree: ast.AST) -> tuple[int, int]:
    """(depth, line) of the deepest node of ``tree``, walked without recursion; ``line`` is
    the line of the deepest node that has one (0 when none)."""
    best_depth, best_line = 0, 0
    stack: list[tuple[ast.AST, int, int]] = [(tree, 1, 0)]
    while stack:
        node, depth, line = stack.pop()
        line = getattr(node, "lineno", None) or line
        if depth > best_depth:
            best_depth, best_line = depth, line
        for child in ast.iter_child_nodes(node):
            stack.append((child, depth + 1, line))
    return best_depth, best_line


def nesting_finding(rel: str, tree: ast.AST, limit: int = MAX_DEPTH) -> Finding | None:
    """``prism:too-complex`` when ``tree`` nests deeper than ``limit`` levels, else ``None``."""
    depth, line = deepest(tree)
    if depth <= limit:
        return None
    return too_complex(rel, line, f"expressions nested {depth} levels deep (at most {limit})")


def busiest_line(text: str) -> int:
    """The line where brackets nest deepest (else the longest line): where a parser that ran
    out of stack most likely was."""
    depth = best = 0
    best_line = 0
    line = 1
    for ch in text:
        if ch == "\n":
            line += 1
        elif ch in "([{":
            depth += 1
            if depth > best:
                best, best_line = depth, line
        elif ch in ")]}":
            depth = max(0, depth - 1)
    if best > 1:
        return best_line
    lines = text.splitlines() or [""]
    return max(range(len(lines)), key=lambda i: len(lines[i])) + 1


def guarded(rel: str, line_of: Callable[[], int], step: Callable[[], T]) -> tuple[T | None, Finding | None]:
    """Run one gate ``step`` over file ``rel``; an exception becomes ``prism:too-complex``.

    Returns ``(result, None)``, or ``(None, finding)`` at the line ``line_of()`` names.
    """
    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001 - any failure of the gate refuses the file
        try:
            line = line_of()
        except Exception:  # noqa: BLE001
            line = 0
        return None, too_complex(rel, line, describe(exc))


__all__ = [
    "MAX_DEPTH",
    "PARSER_LIMITS",
    "TOO_COMPLEX",
    "busiest_line",
    "deepest",
    "describe",
    "guarded",
    "nesting_finding",
    "too_complex",
]
