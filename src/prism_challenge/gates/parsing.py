"""Reading one bundle file for the gates: decoded as Python would, parsed, and top-level names.

Nothing here executes bundle code. :func:`parse_source` refuses anything but UTF-8, reports
syntax errors with their position and turns a file too deep for the parser or the gate into
``prism:too-complex``; :func:`defines_symbol` says whether a module binds an entrypoint name.
"""

from __future__ import annotations

import ast
import tokenize
from io import BytesIO

from prism_challenge.gates.complexity import PARSER_LIMITS, busiest_line, describe, nesting_finding, too_complex
from prism_challenge.gates.findings import Finding


def parse_source(rel: str, data: bytes) -> tuple[str | None, ast.Module | None, list[Finding]]:
    """Decode and parse one bundle file.

    The encoding Python itself would use is detected (BOM, ``coding:`` cookie); anything but
    UTF-8 is refused, so the text checked is the text that runs.

    Returns:
        (source text, module tree, findings): text/tree are ``None`` with a ``prism:encoding``
        or ``prism:syntax`` finding (line and 1-based column of the error) when unreadable,
        and the tree is ``None`` with a ``prism:too-complex`` finding when the file nests too
        deep for the parser or the gate (:mod:`prism_challenge.gates.complexity`).
    """
    try:
        encoding, _ = tokenize.detect_encoding(BytesIO(data).readline)
    except SyntaxError as exc:
        return None, None, [Finding("prism:encoding", rel, 1, 0, f"bad encoding declaration: {exc.msg}")]
    if encoding not in ("utf-8", "utf-8-sig"):
        return None, None, [
            Finding("prism:encoding", rel, 1, 0, f"source declares encoding {encoding!r}; only UTF-8")
        ]
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return None, None, [Finding("prism:encoding", rel, line, 0, f"not valid UTF-8: {exc.reason}")]
    try:
        tree = ast.parse(text, filename=rel)
    except SyntaxError as exc:
        if any(limit in (exc.msg or "") for limit in PARSER_LIMITS):
            return text, None, [too_complex(rel, exc.lineno or 0, exc.msg)]
        return text, None, [
            Finding("prism:syntax", rel, exc.lineno or 0, exc.offset or 0, f"syntax error: {exc.msg}")
        ]
    except ValueError as exc:  # e.g. null bytes on older interpreters
        return text, None, [Finding("prism:syntax", rel, 0, 0, f"syntax error: {exc}")]
    except (RecursionError, MemoryError) as exc:  # the parser ran out of stack or memory
        return text, None, [too_complex(rel, busiest_line(text), describe(exc))]
    deep = nesting_finding(rel, tree)
    if deep is not None:
        return text, None, [deep]
    return text, tree, []


def defines_symbol(tree: ast.Module, symbol: str) -> bool:
    """Whether a module binds ``symbol`` at top level (def, class, assignment or import),
    looking inside top-level ``if``/``try``/``with`` blocks."""

    def scan(body: list[ast.stmt]) -> bool:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if stmt.name == symbol:
                    return True
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    if any(isinstance(n, ast.Name) and n.id == symbol for n in ast.walk(t)):
                        return True
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    if bound == symbol:
                        return True
            elif isinstance(stmt, (ast.If, ast.With, ast.Try)):
                blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])]
                blocks += [h.body for h in getattr(stmt, "handlers", [])]
                if any(scan(b) for b in blocks):
                    return True
        return False

    return scan(tree.body)
