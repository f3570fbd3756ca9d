"""Python's scopes of one bundle module and the names bound in them (no resolution here).

A :class:`ModuleInfo` is one parsed bundle module, split into :class:`Scope` objects (module,
function/lambda, class, comprehension) with every binding of every name recorded (built by
:func:`prism_challenge.gates.scopebuild.build_module`). :func:`lookup` finds the scope a name
refers to from another, the way CPython's symbol table does; :func:`absolute_module` resolves a
relative ``from`` import. The resolver over all modules is
:class:`prism_challenge.gates.astindex.BundleIndex`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Scope:
    """One Python scope.

    Attributes:
        kind: ``"module"``, ``"function"`` (functions and lambdas), ``"class"`` or
            ``"comprehension"``.
        parent: the enclosing scope (``None`` for the module).
        node: the AST node that opens the scope.
        bindings: name -> every binding in this scope, each a tuple whose first item is
            ``"import"`` (qualified name), ``"expr"`` (value node, scope it evaluates in),
            ``"param"`` (function node, parameter name, position, is-method), ``"def"`` or
            ``"opaque"``.
        declared_global: names declared ``global`` here; declared_nonlocal likewise.
    """

    kind: str
    parent: Scope | None
    node: ast.AST
    bindings: dict[str, list[tuple]] = field(default_factory=dict)
    declared_global: set[str] = field(default_factory=set)
    declared_nonlocal: set[str] = field(default_factory=set)

    def bind(self, name: str, binding: tuple) -> None:
        """Record one binding of ``name`` in the scope it lands in: this one, the module for a
        name declared ``global`` here, the enclosing function for one declared ``nonlocal``."""
        self.target(name).bindings.setdefault(name, []).append(binding)

    def target(self, name: str) -> Scope:
        """The scope a binding of ``name`` made here lands in."""
        if name in self.declared_global:
            return self.module()
        if name in self.declared_nonlocal:
            s = self.parent
            first: Scope | None = None
            while s is not None and s.kind != "module":
                if s.kind != "class":
                    if name in s.bindings and name not in s.declared_nonlocal:
                        return s
                    first = first or s
                s = s.parent
            if first is not None:
                return first
        return self

    def module(self) -> Scope:
        """The module scope this scope belongs to."""
        s = self
        while s.parent is not None:
            s = s.parent
        return s


@dataclass(eq=False)
class ModuleInfo:
    """A parsed bundle module.

    Attributes:
        rel: bundle-relative POSIX path (``pkg/mod.py``).
        name: dotted module name (``pkg.mod``; ``pkg`` for ``pkg/__init__.py``).
        source: the decoded source text.
        tree: the parsed module.
        scope: its module scope; ``scope_of`` maps ``id(node)`` to the scope a node evaluates in;
            ``parents`` maps ``id(node)`` to its parent node.
        annotation_nodes: ids of every node inside an annotation.
        entry_symbols: names of entrypoint functions defined in this file (their first parameter
            is the context).
    """

    rel: str
    name: str
    source: str
    tree: ast.Module
    scope: Scope = field(init=False)
    scope_of: dict[int, Scope] = field(default_factory=dict)
    parents: dict[int, ast.AST] = field(default_factory=dict)
    annotation_nodes: set[int] = field(default_factory=set)
    entry_symbols: frozenset[str] = frozenset()
    _lines: list[str] = field(default_factory=list, repr=False)

    @property
    def package(self) -> str:
        """The package relative imports start from."""
        if self.rel.endswith("__init__.py"):
            return self.name
        return self.name.rpartition(".")[0]

    def scope_for(self, node: ast.AST) -> Scope:
        """The scope ``node`` evaluates in (its nearest recorded ancestor's, at worst the module)."""
        n: ast.AST | None = node
        while n is not None:
            s = self.scope_of.get(id(n))
            if s is not None:
                return s
            n = self.parents.get(id(n))
        return self.scope

    def position(self, node: ast.AST) -> tuple[int, int]:
        """(1-based line, 1-based column in characters) of ``node``; (0, 0) if it has none."""
        line = getattr(node, "lineno", 0) or 0
        off = getattr(node, "col_offset", None)
        if not line or off is None:
            return line, 0
        if not self._lines:
            self._lines = self.source.splitlines()
        text = self._lines[line - 1] if 0 < line <= len(self._lines) else ""
        return line, len(text.encode("utf-8")[:off].decode("utf-8", "replace")) + 1

    def walk(self) -> Iterator[ast.AST]:
        """Every node of the module."""
        return ast.walk(self.tree)


def module_name(rel: str) -> str:
    """Dotted module name of a bundle-relative ``.py`` path."""
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def absolute_module(node: ast.ImportFrom, info: ModuleInfo) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = info.package.split(".") if info.package else []
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)] if node.level - 1 <= len(base) else []
    parts = [*base, *([node.module] if node.module else [])]
    return ".".join(p for p in parts if p)


def lookup(name: str, scope: Scope) -> Scope | None:
    """The scope whose binding ``name`` refers to from ``scope``; ``None`` for a builtin."""
    module = scope.module()
    s: Scope | None = scope
    first = True
    while s is not None:
        if name in s.declared_global:
            return module if name in module.bindings else None
        if s.kind == "module":
            return s if name in s.bindings else None
        if (first or s.kind != "class") and name in s.bindings and name not in s.declared_nonlocal:
            return s
        first = False
        s = s.parent
    return None
