"""Indexing one parsed bundle module: its scopes, bindings, parents and annotation nodes.

:func:`build_module` walks the module once (:class:`_Builder`), opening scopes the way CPython's
symbol table does and recording every binding in the :class:`~prism_challenge.gates.scopes.Scope`
it lands in; the result is a :class:`~prism_challenge.gates.scopes.ModuleInfo`.
"""

from __future__ import annotations

import ast

from prism_challenge.gates.scopes import ModuleInfo, Scope, absolute_module, module_name

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


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
