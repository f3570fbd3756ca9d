"""Static name resolution over a bundle's modules, for the sandbox and the multi-GPU contract.

Each module is parsed once (:class:`ModuleInfo`) and split into Python's scopes (module,
function/lambda, class, comprehension) with every binding of every name recorded. A
:class:`BundleIndex` then answers, for an expression, which *qualified names* it may evaluate to
(:meth:`BundleIndex.resolve`): ``F.cross_entropy`` after ``import torch.nn.functional as F`` is
``{"torch.nn.functional.cross_entropy"}``. The analysis is flow-insensitive and over-approximates:
a name stands for the union of everything it is ever bound to in its scope, assignments
propagate (``G = F``), containers stand for their elements (``[F][0]``), an attribute of a
bundle object stands for every value ever stored under that attribute name anywhere in the
bundle (``self.f = F`` ... ``self.f.cross_entropy = ...``), a function parameter
stands for the arguments passed at every call site of a function of that name anywhere in the
bundle, re-exports through the bundle's own modules are followed (``helpers.load`` ->
``torch.load``), and paths on the trusted allowed modules are looked up on the real modules
(``torch.os`` -> ``os``, see :mod:`prism_challenge.gates.live`). Values produced by calls are opaque (empty set), except ``getattr(x, "lit")``
and ``type(x)``.

Markers: ``<ctx>`` is the challenge context (the first parameter of an entrypoint function, a
parameter annotated with a ``prism_challenge`` type, and whatever they are passed on to);
``<type>`` is the result of ``type(x)``; ``builtins.NAME`` is a name bound nowhere in the bundle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from prism_challenge.gates.live import live_name

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

CTX = "<ctx>"
TYPE = "<type>"


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


def build_module(rel: str, source: str, tree: ast.Module, entry_symbols=frozenset()) -> ModuleInfo:
    """Index one parsed module: scopes, bindings, parents and annotation nodes."""
    info = ModuleInfo(rel, module_name(rel), source, tree, entry_symbols=frozenset(entry_symbols))
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            info.parents[id(child)] = node
    info.scope = Scope("module", None, tree)
    _Builder(info).visit_body(tree.body, info.scope)
    for node in ast.walk(tree):
        ann: list[ast.AST | None] = []
        if isinstance(node, ast.arg):
            ann.append(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            ann.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ann.append(node.returns)
        for a in ann:
            if a is not None:
                info.annotation_nodes.update(id(n) for n in ast.walk(a))
    return info


class _Builder:
    """Walks a module once, opening scopes the way CPython's symbol table does."""

    def __init__(self, info: ModuleInfo) -> None:
        self.info = info

    def visit_body(self, body: list[ast.stmt], scope: Scope) -> None:
        for stmt in body:
            self.visit(stmt, scope)

    def visit(self, node: ast.AST | None, scope: Scope) -> None:
        if node is None:
            return
        self.info.scope_of[id(node)] = scope
        handler = getattr(self, "v_" + type(node).__name__, None)
        if handler is not None:
            handler(node, scope)
        else:
            for child in ast.iter_child_nodes(node):
                self.visit(child, scope)

    # -- binding helpers -------------------------------------------------------------------
    def bind_target(
        self, target: ast.AST, value: ast.AST | None, scope: Scope, eval_scope: Scope | None = None
    ) -> None:
        ev = eval_scope or scope
        if isinstance(target, ast.Name):
            scope.bind(target.id, ("expr", value, ev) if value is not None else ("opaque",))
        elif isinstance(target, (ast.Tuple, ast.List)):
            if (
                isinstance(value, (ast.Tuple, ast.List))
                and len(value.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in [*value.elts, *target.elts])
            ):
                for t, v in zip(target.elts, value.elts):
                    self.bind_target(t, v, scope, ev)
            else:
                for t in target.elts:
                    self.bind_target(t, value, scope, ev)
        elif isinstance(target, ast.Starred):
            self.bind_target(target.value, value, scope, ev)

    def _bind_params(self, fn: ast.AST, args: ast.arguments, scope: Scope, is_method: bool) -> None:
        positional = [*args.posonlyargs, *args.args]
        for i, a in enumerate(positional):
            scope.bind(a.arg, ("param", fn, a.arg, i, is_method))
            self.info.scope_of[id(a)] = scope
        for a in args.kwonlyargs:
            scope.bind(a.arg, ("param", fn, a.arg, -1, is_method))
            self.info.scope_of[id(a)] = scope
        for a in (args.vararg, args.kwarg):
            if a is not None:
                scope.bind(a.arg, ("opaque",))
                self.info.scope_of[id(a)] = scope

    def _visit_arg_exprs(self, args: ast.arguments, scope: Scope) -> None:
        for d in [*args.defaults, *args.kw_defaults]:
            self.visit(d, scope)
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if a is not None and a.annotation is not None:
                self.visit(a.annotation, scope)

    # -- scopes ----------------------------------------------------------------------------
    def v_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef, scope: Scope) -> None:
        scope.bind(node.name, ("def", node))
        for d in node.decorator_list:
            self.visit(d, scope)
        self._visit_arg_exprs(node.args, scope)
        self.visit(node.returns, scope)
        inner = Scope("function", scope, node)
        self.info.scope_of[id(node.args)] = inner
        is_method = scope.kind == "class" and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list
        )
        self._bind_params(node, node.args, inner, is_method)
        self.visit_body(node.body, inner)

    v_AsyncFunctionDef = v_FunctionDef

    def v_Lambda(self, node: ast.Lambda, scope: Scope) -> None:
        self._visit_arg_exprs(node.args, scope)
        inner = Scope("function", scope, node)
        self.info.scope_of[id(node.args)] = inner
        self._bind_params(node, node.args, inner, False)
        self.visit(node.body, inner)

    def v_ClassDef(self, node: ast.ClassDef, scope: Scope) -> None:
        scope.bind(node.name, ("def", node))
        for n in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(n, scope)
        inner = Scope("class", scope, node)
        self.visit_body(node.body, inner)

    def _comprehension(self, node: ast.AST, scope: Scope, results: list[ast.AST]) -> None:
        gens: list[ast.comprehension] = node.generators  # type: ignore[attr-defined]
        self.visit(gens[0].iter, scope)
        inner = Scope("comprehension", scope, node)
        for i, g in enumerate(gens):
            self.info.scope_of[id(g)] = inner
            iter_scope = scope if i == 0 else inner
            if i:
                self.visit(g.iter, inner)
            # a target stands for the elements of the iterable: over-approximated by the iterable
            self.bind_target(g.target, g.iter, inner, iter_scope)
            self.visit(g.target, inner)
            for cond in g.ifs:
                self.visit(cond, inner)
        for r in results:
            self.visit(r, inner)

    def v_ListComp(self, node: ast.ListComp, scope: Scope) -> None:
        self._comprehension(node, scope, [node.elt])

    v_SetComp = v_ListComp
    v_GeneratorExp = v_ListComp

    def v_DictComp(self, node: ast.DictComp, scope: Scope) -> None:
        self._comprehension(node, scope, [node.key, node.value])

    # -- statements that bind ---------------------------------------------------------------
    def v_Global(self, node: ast.Global, scope: Scope) -> None:
        scope.declared_global.update(node.names)

    def v_Nonlocal(self, node: ast.Nonlocal, scope: Scope) -> None:
        scope.declared_nonlocal.update(node.names)

    def v_Import(self, node: ast.Import, scope: Scope) -> None:
        for alias in node.names:
            if alias.asname:
                scope.bind(alias.asname, ("import", alias.name))
            else:
                root = alias.name.split(".")[0]
                scope.bind(root, ("import", root))

    def v_ImportFrom(self, node: ast.ImportFrom, scope: Scope) -> None:
        base = absolute_module(node, self.info)
        for alias in node.names:
            if alias.name == "*":
                continue
            scope.bind(alias.asname or alias.name, ("import", f"{base}.{alias.name}"))

    def v_Assign(self, node: ast.Assign, scope: Scope) -> None:
        self.visit(node.value, scope)
        for t in node.targets:
            self.bind_target(t, node.value, scope)
            self.visit(t, scope)

    def v_AnnAssign(self, node: ast.AnnAssign, scope: Scope) -> None:
        self.visit(node.annotation, scope)
        self.visit(node.value, scope)
        self.bind_target(node.target, node.value, scope)
        self.visit(node.target, scope)

    def v_AugAssign(self, node: ast.AugAssign, scope: Scope) -> None:
        self.visit(node.value, scope)
        self.bind_target(node.target, node.value, scope)
        self.visit(node.target, scope)

    def v_For(self, node: ast.For | ast.AsyncFor, scope: Scope) -> None:
        self.visit(node.iter, scope)
        self.bind_target(node.target, node.iter, scope)
        self.visit(node.target, scope)
        self.visit_body(node.body, scope)
        self.visit_body(node.orelse, scope)

    v_AsyncFor = v_For

    def v_withitem(self, node: ast.withitem, scope: Scope) -> None:
        self.visit(node.context_expr, scope)
        if node.optional_vars is not None:
            self.bind_target(node.optional_vars, None, scope)
            self.visit(node.optional_vars, scope)

    def v_ExceptHandler(self, node: ast.ExceptHandler, scope: Scope) -> None:
        self.visit(node.type, scope)
        if node.name:
            scope.bind(node.name, ("opaque",))
        self.visit_body(node.body, scope)

    def v_NamedExpr(self, node: ast.NamedExpr, scope: Scope) -> None:
        self.visit(node.value, scope)
        target_scope = scope
        while target_scope.kind == "comprehension" and target_scope.parent is not None:
            target_scope = target_scope.parent
        target_scope.bind(node.target.id, ("expr", node.value, scope))
        self.info.scope_of[id(node.target)] = target_scope

    def v_Name(self, node: ast.Name, scope: Scope) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)) and node.id not in scope.target(node.id).bindings:
            scope.bind(node.id, ("opaque",))

    def _bind_capture(self, name: str | None, scope: Scope) -> None:
        if name:
            scope.bind(name, ("opaque",))

    def v_MatchAs(self, node: ast.MatchAs, scope: Scope) -> None:
        self._bind_capture(node.name, scope)
        self.visit(node.pattern, scope)

    def v_MatchStar(self, node: ast.MatchStar, scope: Scope) -> None:
        self._bind_capture(node.name, scope)

    def v_MatchMapping(self, node: ast.MatchMapping, scope: Scope) -> None:
        self._bind_capture(node.rest, scope)
        for child in [*node.keys, *node.patterns]:
            self.visit(child, scope)


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


class BundleIndex:
    """All modules of a bundle and the resolver over them.

    Args:
        modules: the indexed modules (any order).
    """

    def __init__(self, modules: list[ModuleInfo]) -> None:
        self.modules: dict[str, ModuleInfo] = {m.name: m for m in modules}
        self.calls: dict[str, list[tuple[ast.Call, ModuleInfo]]] = {}
        for m in modules:
            for node in m.walk():
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if name:
                        self.calls.setdefault(name, []).append((node, m))
        self._memo: dict[tuple[int, bool], frozenset[str]] = {}
        self._active: set[tuple[int, bool]] = set()
        self._module_of_scope: dict[int, ModuleInfo] = {id(m.scope): m for m in modules}
        self.fields: dict[str, list[tuple[ast.AST, Scope]]] = {}
        self._field_memo: dict[tuple[str, bool], frozenset[str]] = {}
        self._field_active: set[tuple[str, bool]] = set()
        for m in modules:
            self._collect_fields(m)

    def _collect_fields(self, info: ModuleInfo) -> None:
        """Record every value stored into an attribute (``x.a = v``, ``setattr(x, "a", v)``,
        class-body ``a = v``), keyed by attribute name only (object-insensitive)."""

        def store(target: ast.AST, value: ast.AST | None, scope: Scope) -> None:
            if value is None:
                return
            if isinstance(target, ast.Attribute):
                self.fields.setdefault(target.attr, []).append((value, scope))
            elif isinstance(target, (ast.Tuple, ast.List)):
                if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                    for t, v in zip(target.elts, value.elts):
                        store(t, v, scope)
                else:
                    for t in target.elts:
                        store(t, value, scope)
            elif isinstance(target, ast.Starred):
                store(target.value, value, scope)

        class_scopes: dict[int, Scope] = {}
        for node in info.walk():
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    store(t, node.value, info.scope_for(node))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                store(node.target, node.value, info.scope_for(node))
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                store(node.target, node.iter, info.scope_for(node))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) >= 3
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                scope = info.scope_for(node)
                self.fields.setdefault(node.args[1].value, []).append((node.args[2], scope))
        for scope in info.scope_of.values():
            if scope.kind == "class":
                class_scopes[id(scope)] = scope
        for scope in class_scopes.values():
            for name, bindings in scope.bindings.items():
                for b in bindings:
                    if b[0] == "expr":
                        self.fields.setdefault(name, []).append((b[1], b[2]))
                    elif b[0] == "import":
                        self.fields.setdefault(name, []).append((None, scope))

    def _resolve_field(self, attr: str, containers: bool) -> frozenset[str]:
        key = (attr, containers)
        if key in self._field_memo:
            return self._field_memo[key]
        if key in self._field_active:
            return frozenset()
        self._field_active.add(key)
        out: set[str] = set()
        try:
            for value, scope in self.fields.get(attr, ()):
                if value is None:  # an import in a class body
                    for b in scope.bindings.get(attr, ()):
                        if b[0] == "import":
                            out |= self._resolve_binding(b, containers)
                else:
                    out |= self.resolve(value, scope, containers)
        finally:
            self._field_active.discard(key)
        result = frozenset(out)
        self._field_memo[key] = result
        return result

    @property
    def top_level_names(self) -> set[str]:
        """First components of every bundle module name."""
        return {name.split(".")[0] for name in self.modules if name}

    def is_own(self, qualname: str) -> bool:
        """Whether a qualified name starts with one of the bundle's own modules."""
        return qualname.split(".")[0] in self.top_level_names

    def info_of(self, scope: Scope) -> ModuleInfo:
        """The module a scope belongs to."""
        return self._module_of_scope[id(scope.module())]

    # -- resolution ------------------------------------------------------------------------
    def resolve(self, node: ast.AST | None, scope: Scope, containers: bool = True) -> frozenset[str]:
        """Qualified names ``node`` may evaluate to, evaluated in ``scope`` (see module doc).

        With ``containers=False``, list/tuple/dict literals and subscripts resolve to nothing
        (used where an element of a local container is not the object itself).
        """
        if node is None:
            return frozenset()
        if isinstance(node, ast.Name):
            where = lookup(node.id, scope)
            if where is None:
                return frozenset({f"builtins.{node.id}"})
            out: set[str] = set()
            for binding in where.bindings.get(node.id, ()):
                out |= self._resolve_binding(binding, containers)
            return frozenset(out)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value, scope, containers)
            if not base:  # a bundle object: whatever was ever stored under that attribute name
                return self._resolve_field(node.attr, containers)
            return frozenset(f"{q}.{node.attr}" for q in base)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and lookup(func.id, scope) is None:
                if (
                    func.id == "getattr"
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                ):
                    base = self.resolve(node.args[0], scope, containers)
                    if not base:
                        return self._resolve_field(node.args[1].value, containers)
                    return frozenset(f"{q}.{node.args[1].value}" for q in base)
                if func.id == "type" and len(node.args) == 1:
                    base = self.resolve(node.args[0], scope, containers)
                    return frozenset({TYPE, *(f"{q}.__class__" for q in base)})
            return frozenset()
        if isinstance(node, (ast.NamedExpr, ast.Starred)):
            return self.resolve(node.value, scope, containers)
        if isinstance(node, ast.IfExp):
            return self.resolve(node.body, scope, containers) | self.resolve(
                node.orelse, scope, containers
            )
        if isinstance(node, ast.BoolOp):
            return frozenset().union(*(self.resolve(v, scope, containers) for v in node.values))
        if not containers:
            return frozenset()
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return frozenset().union(*(self.resolve(e, scope, containers) for e in node.elts))
        if isinstance(node, ast.Dict):
            return frozenset().union(*(self.resolve(v, scope, containers) for v in node.values))
        if isinstance(node, ast.Subscript):
            return self.resolve(node.value, scope, containers)
        return frozenset()

    def canonical(self, qualnames: frozenset[str]) -> frozenset[str]:
        """``qualnames`` plus what names reached through the bundle's own modules stand for."""
        out = set(qualnames)
        for q in qualnames:
            out |= self._expand_own(q, 0)
        for q in list(out):
            if not q.startswith("<"):
                live = live_name(q)
                if live is not None:
                    out.add(live)
        return frozenset(out)

    def _expand_own(self, q: str, depth: int) -> set[str]:
        if depth > 8 or not self.is_own(q):
            return set()
        parts = q.split(".")
        for i in range(len(parts), 0, -1):
            mod = self.modules.get(".".join(parts[:i]))
            if mod is None:
                continue
            rest = parts[i:]
            if not rest:
                return set()
            out: set[str] = set()
            for binding in mod.scope.bindings.get(rest[0], ()):
                for r in self._resolve_binding(binding, True):
                    full = ".".join([r, *rest[1:]])
                    out.add(full)
                    out |= self._expand_own(full, depth + 1)
            return out
        return set()

    def _resolve_binding(self, binding: tuple, containers: bool) -> frozenset[str]:
        key = (id(binding), containers)
        if key in self._memo:
            return self._memo[key]
        if key in self._active:
            return frozenset()
        self._active.add(key)
        try:
            kind = binding[0]
            if kind == "import":
                result = frozenset({binding[1]})
                result = result | self._expand_own(binding[1], 0)
            elif kind == "expr":
                result = self.resolve(binding[1], binding[2], containers)
            elif kind == "param":
                result = self._resolve_param(*binding[1:], containers=containers)
            else:
                result = frozenset()
        finally:
            self._active.discard(key)
        self._memo[key] = result
        return result

    def _resolve_param(
        self, fn: ast.AST, name: str, pos: int, is_method: bool, containers: bool
    ) -> frozenset[str]:
        out: set[str] = set()
        scope = self.scope_of_def(fn)
        if scope is not None and pos == 0 and isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info = self.info_of(scope)
            if scope.kind == "module" and fn.name in info.entry_symbols:
                out.add(CTX)
        arg = _find_arg(fn, name)
        if arg is not None and arg.annotation is not None and scope is not None:
            ann = arg.annotation
            if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                if "PrismContext" in ann.value:
                    out.add(CTX)
            elif any(q.startswith("prism_challenge.") for q in self.canonical(self.resolve(ann, scope))):
                out.add(CTX)
        fn_name = getattr(fn, "name", None)
        if fn_name is None:
            return frozenset(out)
        sites = [(c, i, 1 if is_method and isinstance(c.func, ast.Attribute) else 0) for c, i in self.calls.get(fn_name, ())]
        if fn_name == "__init__" and scope is not None and isinstance(scope.node, ast.ClassDef):
            # Cls(args) calls Cls.__init__(self, args)
            sites += [(c, i, 1) for c, i in self.calls.get(scope.node.name, ())]
        for call, info, shift in sites:
            call_scope = info.scope_for(call)
            if pos >= 0 and pos - shift >= 0:
                idx = pos - shift
                if idx < len(call.args) and not any(
                    isinstance(a, ast.Starred) for a in call.args[: idx + 1]
                ):
                    out |= self.resolve(call.args[idx], call_scope, containers)
            for kw in call.keywords:
                if kw.arg == name:
                    out |= self.resolve(kw.value, call_scope, containers)
        return frozenset(out)

    def scope_of_def(self, fn: ast.AST) -> Scope | None:
        """The scope a ``def``/``lambda`` node is defined in (``None`` if not in the bundle)."""
        for m in self.modules.values():
            s = m.scope_of.get(id(fn))
            if s is not None:
                return s
        return None


def _find_arg(fn: ast.AST, name: str) -> ast.arg | None:
    args: ast.arguments = fn.args  # type: ignore[attr-defined]
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        if a.arg == name:
            return a
    return None
