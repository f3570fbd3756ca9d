"""Whether a path is built from ``ctx.artifacts_dir``, and whether a name is certainly the context.

``torch.save``/``torch.load`` are admitted only on such a path (``prism:torch-io``,
:meth:`prism_challenge.gates.callcheck.CallChecks._torch_io_call`). :func:`is_context` follows a
parameter back through every call of its function in the bundle (:func:`may_call`, also used by
the multi-GPU contract); the suffix after the directory is judged by
:mod:`prism_challenge.gates.artifactpath`.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from prism_challenge.gates.artifactpath import template
from prism_challenge.gates.astindex import CTX, BundleIndex
from prism_challenge.gates.scopes import ModuleInfo, lookup

if TYPE_CHECKING:
    from prism_challenge.gates.sandbox import Checker


def artifacts_path(node: ast.AST, checker: Checker, depth: int = 0) -> bool:
    """Whether a path expression is built from ``ctx.artifacts_dir``.

    Accepted: ``ctx.artifacts_dir`` itself (``ctx`` resolving to the context and nothing else),
    optionally followed (``+`` or an f-string) by string literals and integers
    (:mod:`prism_challenge.gates.artifactpath`: ``{step:06d}``, ``str(int(x))``, a loop index
    over ``range``) that together, each integer read as ``0``, start with ``/`` and hold no
    ``..``; or a function-local name every binding of which is accepted.
    """
    if depth > 8:
        return False
    if isinstance(node, ast.Attribute) and node.attr == "artifacts_dir":
        return is_context(node.value, checker)
    if isinstance(node, ast.Name):
        where = lookup(node.id, checker.info.scope_for(node))
        if where is None or where.kind not in ("function", "comprehension"):
            return False
        bindings = where.bindings.get(node.id, [])
        return bool(bindings) and all(
            b[0] == "expr" and artifacts_path(b[1], checker, depth + 1) for b in bindings
        )
    parts: list[ast.AST]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        parts = _flatten_add(node)
    elif isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if not (
            isinstance(head, ast.FormattedValue)
            and head.conversion == -1
            and head.format_spec is None
        ):
            return False
        parts = [head.value, *node.values[1:]]
    else:
        return False
    if not artifacts_path(parts[0], checker, depth + 1):
        return False
    suffix = template(parts[1:], checker)  # integers as "0": they hold no '/' and no '.'
    if suffix is None:
        return False
    return not suffix or (suffix.startswith("/") and ".." not in suffix and "\0" not in suffix)


def is_context(node: ast.AST, checker: Checker, depth: int = 0) -> bool:
    """Whether ``node`` is certainly the harness context: a function parameter that is the
    first parameter of an entrypoint (or annotated with ``PrismContext``), every call of whose
    function in the bundle passes a name that is itself certainly the context."""
    from prism_challenge.gates.sandbox import Checker  # here: sandbox.py imports this module

    if depth > 6 or not isinstance(node, ast.Name):
        return False
    index = checker.index
    where = lookup(node.id, checker.info.scope_for(node))
    if where is None or where.kind != "function":
        return False
    bindings = where.bindings.get(node.id, [])
    if not bindings or any(b[0] != "param" for b in bindings):
        return False
    for _, fn, name, pos, is_method in bindings:
        if index.resolve(node, where) != frozenset({CTX}):
            return False
        fn_name = getattr(fn, "name", None)
        for call, info in index.calls.get(fn_name or "", ()):
            if not may_call(index, fn, call, info):
                continue
            shift = 1 if is_method and isinstance(call.func, ast.Attribute) else 0
            args = [kw.value for kw in call.keywords if kw.arg == name]
            if 0 <= pos - shift < len(call.args):
                args.append(call.args[pos - shift])
            if any(isinstance(a, ast.Starred) for a in call.args) or any(
                kw.arg is None for kw in call.keywords
            ):
                return False
            sub = Checker(index, info) if info is not checker.info else checker
            if not args or not all(is_context(a, sub, depth + 1) for a in args):
                return False
    return True


def may_call(index: BundleIndex, fn: ast.AST, call: ast.Call, info: ModuleInfo) -> bool:
    """Whether ``call`` (matched by name) may call the bundle function ``fn``.

    A method call on an object the gate cannot name (``model.train()``) may call a top-level
    function of that name only when the bundle stores something under that attribute name
    (modules used as values are refused, so the object is not a bundle module)."""
    qs = index.canonical(index.resolve(call.func, info.scope_for(call)))
    scope = index.scope_of_def(fn)
    if not qs:
        return not (
            isinstance(call.func, ast.Attribute)
            and call.func.attr not in index.fields
            and scope is not None
            and scope.kind == "module"
        )
    if scope is None or scope.kind != "module":
        return False
    return f"{index.info_of(scope).name}.{getattr(fn, 'name', '')}" in qs


def _flatten_add(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [*_flatten_add(node.left), *_flatten_add(node.right)]
    return [node]
