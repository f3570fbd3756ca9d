"""Numbers in a checkpoint name under ``ctx.artifacts_dir`` (``prism:torch-io``).

``torch.save``/``torch.load`` are admitted only on a path the gate can prove lies inside
``ctx.artifacts_dir`` (:func:`prism_challenge.gates.ctxpath.artifacts_path`): the directory,
then string literals and, from this module, **integers**. An integer renders as ``-?[0-9]+``:
it holds no ``/`` and no ``.``, so it cannot climb out of the folder or make a ``..`` with the
literals around it. What the gate accepts as an integer (nothing else: a ``str(x)`` or a bare
``{x}`` of an object the gate cannot type would run that object's ``__str__``, which a bundle
class may define to return ``"/../.."``):

* an f-string field with an integer format spec, ``{step:06d}``, ``{step:d}``, ``{step:>8d}``
  (no ``!s``/``!r`` conversion): ``format(x, "06d")`` raises ``ValueError`` for anything but an
  ``int`` (or ``bool``, or a 0-dim integer tensor, which formats its ``int``); a bundle class
  may not define ``__format__`` (:data:`~prism_challenge.gates.policy.PROTOCOL_DUNDERS`), and an
  ``int`` subclass formats with ``int.__format__``;
* ``int(x)``, as a field (``{int(x)}``) or in ``str(int(x))``: ``int()`` returns an exact ``int``
  whatever ``__int__``/``__index__`` return;
* a function-local name the gate proves is always an ``int`` (:func:`proven_int`): every
  binding of it is ``for name in range(...)``, the index of ``for name, _ in enumerate(...)``
  (no ``start``, or an integer literal), ``name = <int literal>`` or ``name += <int literal>``
  (also ``-=``, ``*=``), as a field (``{step}``) or in ``str(step)``.

The literals are checked with every integer replaced by ``0`` (:func:`template`): together they
must start with ``/`` and hold no ``..`` and no NUL.
"""

from __future__ import annotations

import ast
import re
from typing import Protocol

from prism_challenge.gates.scopes import lookup

INT_SPEC = re.compile(r"[<>=^]?[+\- ]?0?[0-9]{0,3}[_,]?d")
"""Format specs of an integer in decimal: optional align, sign, zero-padding, width, grouping, ``d``."""


class _Checker(Protocol):
    info: object

    def q(self, node: ast.AST) -> frozenset[str]: ...


def template(parts: list[ast.AST], checker: _Checker) -> str | None:
    """The text of ``parts`` (what follows ``ctx.artifacts_dir``) with each integer part as
    ``"0"``; ``None`` when a part is neither a string literal nor a proven integer.

    ``parts``: the pieces of a ``+`` chain or of an f-string (``ast.FormattedValue`` kept)."""
    out = []
    for part in parts:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            out.append(part.value)
        elif integer_part(part, checker):
            out.append("0")
        else:
            return None
    return "".join(out)


def integer_part(part: ast.AST, checker: _Checker) -> bool:
    """Whether ``part`` (a ``+`` operand or an f-string piece) renders as an integer: an f-string
    field with an integer spec or an integer value, or ``str(<integer value>)``."""
    if isinstance(part, ast.FormattedValue):
        if part.conversion != -1:
            return False
        if part.format_spec is None:
            return integer_value(part.value, checker)
        spec = part.format_spec
        return (isinstance(spec, ast.JoinedStr) and len(spec.values) == 1
                and isinstance(spec.values[0], ast.Constant) and isinstance(spec.values[0].value, str)
                and INT_SPEC.fullmatch(spec.values[0].value) is not None)
    return (isinstance(part, ast.Call) and checker.q(part.func) == {"builtins.str"} and len(part.args) == 1
            and not part.keywords and integer_value(part.args[0], checker))


def integer_value(node: ast.AST, checker: _Checker) -> bool:
    """Whether ``node`` is certainly an exact ``int``: an ``int`` literal, ``int(x)`` (one
    positional argument), or a name :func:`proven_int`."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Call):
        return (checker.q(node.func) == {"builtins.int"} and len(node.args) == 1 and not node.keywords
                and not isinstance(node.args[0], ast.Starred))
    return isinstance(node, ast.Name) and proven_int(node, checker)


def proven_int(node: ast.Name, checker: _Checker) -> bool:
    """Whether the function-local name ``node`` is an ``int`` at every binding (see the module
    docstring). Every place in its function (nested functions included) that could bind the
    name is looked at; one the gate does not know makes the answer ``False``."""
    where = lookup(node.id, checker.info.scope_for(node))  # type: ignore[attr-defined]
    if where is None or where.kind != "function" or not where.bindings.get(node.id):
        return False
    name = node.id
    for n in ast.walk(where.node):
        if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load):
            if not _int_binding(n, checker):
                return False
        elif _other_binding(n, name):
            return False
    return True


def _other_binding(n: ast.AST, name: str) -> bool:
    """Whether ``n`` binds or declares ``name`` other than through an ``ast.Name`` target."""
    if isinstance(n, ast.arg):
        return n.arg == name
    if isinstance(n, ast.alias):
        return (n.asname or n.name.split(".")[0]) == name
    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return n.name == name
    if isinstance(n, ast.ExceptHandler | ast.MatchAs | ast.MatchStar):
        return n.name == name
    if isinstance(n, ast.MatchMapping):
        return n.rest == name
    if isinstance(n, ast.Global | ast.Nonlocal):
        return name in n.names
    return False


def _int_binding(target: ast.Name, checker: _Checker) -> bool:
    parents = checker.info.parents  # type: ignore[attr-defined]
    p = parents.get(id(target))
    if isinstance(p, ast.For | ast.AsyncFor) and p.target is target:
        return _call_of(p.iter, "builtins.range", checker)
    if isinstance(p, ast.Tuple) and p.elts and p.elts[0] is target and len(p.elts) == 2:
        loop = parents.get(id(p))
        return (isinstance(loop, ast.For | ast.AsyncFor) and loop.target is p
                and _call_of(loop.iter, "builtins.enumerate", checker)
                and all(k.arg == "start" and isinstance(k.value, ast.Constant) and type(k.value.value) is int
                        for k in loop.iter.keywords) and len(loop.iter.args) == 1)  # type: ignore[attr-defined]
    int_literal = isinstance(getattr(p, "value", None), ast.Constant) and type(p.value.value) is int  # type: ignore[union-attr]
    if isinstance(p, ast.Assign):
        return p.targets == [target] and int_literal
    if isinstance(p, ast.AugAssign):
        return p.target is target and isinstance(p.op, ast.Add | ast.Sub | ast.Mult) and int_literal
    return False


def _call_of(node: ast.AST, qualname: str, checker: _Checker) -> bool:
    return (isinstance(node, ast.Call) and checker.q(node.func) == {qualname}
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and not any(k.arg is None for k in node.keywords))
