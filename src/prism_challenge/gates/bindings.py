"""Names a bundle may not bind: the module's interpreter-facing dunders, in every binding form.

``import torch as __builtins__`` rebinds the builtins every later function of the module
resolves its free names in (CPython takes them from ``globals()['__builtins__']``), so ``sys``,
``os`` or ``ctypes`` would read as unknown builtins; ``from x import y as __name__`` (or
``__package__``, ``__path__``, ``__spec__``, ``__loader__``) redirects the module's relative
imports. The gate already refuses these names as plain :class:`ast.Name` nodes
(``BLOCKED_NAMES``); this mixin refuses them, and any other dunder bound outside a class body,
wherever else Python binds a name: ``import ... as``, ``from ... import``, ``except ... as``,
``match`` captures, ``global``/``nonlocal``, parameters, and module-level ``def``/``class``.
"""

from __future__ import annotations

import ast

RULE = "prism:no-monkeypatch"
ALLOWED_DUNDERS = frozenset({"__all__", "__version__"})
"""Dunder names a module may bind (plain data the interpreter never reads for name lookup)."""


def bound_names(node: ast.AST) -> list[str]:
    """The names ``node`` binds, for the binding forms that are not :class:`ast.Name`."""
    if isinstance(node, ast.alias):
        return [node.asname or node.name.partition(".")[0]] if node.name != "*" else []
    if isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar):
        return [node.name] if node.name else []
    if isinstance(node, ast.MatchMapping):
        return [node.rest] if node.rest else []
    if isinstance(node, ast.Global | ast.Nonlocal):
        return list(node.names)
    if isinstance(node, ast.arg):
        return [node.arg]
    return []


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


class BindingChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: ``prism:no-monkeypatch`` for a
    dunder bound by an import alias, an ``except``/``match`` capture, ``global``/``nonlocal``,
    a parameter, or a module-level function or class."""

    def _bind_check(self, node: ast.AST, names: list[str]) -> None:
        for name in names:
            if _dunder(name) and name not in ALLOWED_DUNDERS:
                self.add(RULE, node, f"binds '{name}', which the interpreter reads for the module's name lookup "
                                     "and imports")

    def _on_alias(self, node: ast.AST) -> None:
        self._bind_check(node, bound_names(node))

    _on_ExceptHandler = _on_MatchAs = _on_MatchStar = _on_MatchMapping = _on_alias
    _on_Global = _on_Nonlocal = _on_arg = _on_alias

    def module_level_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        """A dunder ``def``/``class`` outside a class body (``def __getattr__`` at module level
        is PEP 562's hook on every missing attribute of the module)."""
        if self.info.scope_for(node).kind != "class":
            self._bind_check(node, [node.name])
