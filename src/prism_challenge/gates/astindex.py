"""Static name resolution over a bundle's modules, for the sandbox and the multi-GPU contract.

Each module is parsed once (:class:`~prism_challenge.gates.scopes.ModuleInfo`, built by
:func:`prism_challenge.gates.scopebuild.build_module`) and split into Python's scopes (module,
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

from prism_challenge.gates.live import live_name
from prism_challenge.gates.scopes import ModuleInfo, Scope, lookup

CTX = "<ctx>"
TYPE = "<type>"


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
