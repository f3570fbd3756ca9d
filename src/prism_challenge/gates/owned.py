"""Names a bundle defines itself, for the allow-list's attribute rule.

An attribute name that is not on the allow-list (:mod:`prism_challenge.gates.allowlist`) may
still be used on an object when the bundle defines that name somewhere: it assigns or deletes
``obj.name``, calls ``setattr(obj, "name", v)``, defines a function, method or class called
``name``, binds ``name`` in a class body (class attributes, dataclass and ``NamedTuple``
fields), binds it at the top level of one of its modules, names a ``namedtuple`` field
``name``, registers a buffer, parameter or submodule ``name`` (``register_buffer("name", t)``),
keys a ``ModuleDict``/``ParameterDict``/``Sequential``/``OrderedDict`` with ``name``, or has a
module or package called ``name``.
"""

from __future__ import annotations

import ast
import re
import weakref

from prism_challenge.gates.astindex import BundleIndex

_REGISTERS = frozenset({"register_buffer", "register_parameter", "register_module", "add_module"})
"""Module methods whose first argument names an attribute of the module."""
_KEYED = frozenset({"ModuleDict", "ParameterDict", "Sequential", "OrderedDict"})
"""Containers whose keys (keywords, dict keys, ``(key, value)`` pairs) become attributes."""
_FIELD_SPLIT = re.compile(r"[\s,]+")
_CACHE: weakref.WeakKeyDictionary[BundleIndex, frozenset[str]] = weakref.WeakKeyDictionary()


def defined_names(index: BundleIndex) -> frozenset[str]:
    """Every attribute name the bundle of ``index`` defines itself (see the module doc)."""
    hit = _CACHE.get(index)
    if hit is not None:
        return hit
    out: set[str] = set()
    for name, info in index.modules.items():
        out.update(p for p in name.split(".") if p)
        out.update(info.scope.bindings)
        for scope in info.scope_of.values():
            if scope.kind == "class":
                out.update(scope.bindings)
        for node in info.walk():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.add(node.attr)
            elif isinstance(node, ast.Call):
                out.update(_call_names(node))
    result = frozenset(out)
    _CACHE[index] = result
    return result


def _call_names(node: ast.Call) -> set[str]:
    """Names a call defines: ``setattr(x, "lit", v)`` and ``namedtuple("T", fields)``."""
    func = node.func
    fname = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if fname == "setattr" and len(node.args) >= 2:
        arg = node.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return {arg.value}
    if fname in _REGISTERS and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return {arg.value}
    if fname in _KEYED:
        out = {kw.arg for kw in node.keywords if kw.arg}
        for sub in node.args:
            for item in ast.walk(sub):
                if isinstance(item, ast.Dict):
                    out.update(k.value for k in item.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
                elif isinstance(item, ast.Tuple) and item.elts:
                    k = item.elts[0]
                    if isinstance(k, ast.Constant) and isinstance(k.value, str):
                        out.add(k.value)
        return out
    if fname in ("namedtuple", "NamedTuple") and len(node.args) >= 2:
        out: set[str] = set()
        for sub in ast.walk(node.args[1]):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                out.update(p for p in _FIELD_SPLIT.split(sub.value) if p)
        return out
    return set()


__all__ = ["defined_names"]
