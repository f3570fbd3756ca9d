"""The AST sandbox: every ``.py`` in a bundle is parsed and checked before anything runs.

Nothing here executes bundle code. Each check yields a :class:`~prism_challenge.gates.Finding`
with a stable rule id (see :mod:`prism_challenge.gates.rules`). The checks:

* imports only from the allowlist (:data:`ALLOWED_ROOTS`, :data:`ALLOWED_MODULES` and the
  bundle's own modules); known network/process/filesystem/FFI/... modules get their specific
  rule (:data:`prism_challenge.gates.policy.BLOCKED_MODULES`), reached by import or by attribute (``torch.hub.load``);
* the allow-list (``gates/allowlist.toml``, :mod:`prism_challenge.gates.allowlist`), after
  the deny rules: every path a bundle reaches on an allowed module (import, ``from`` import,
  attribute, ``getattr``/``hasattr`` literal) must be listed (:func:`prism_challenge.gates.modulerule.module_rule`), so must
  every builtin it reaches, and every attribute name used on any other object must be listed
  or defined by the bundle itself
  (:mod:`prism_challenge.gates.allowcheck`, :mod:`prism_challenge.gates.owned`); else
  ``prism:not-allowlisted``, reported only on lines that break no deny rule;
* a file nested too deep for the gate (or that makes any check fail) is ``prism:too-complex``
  (:mod:`prism_challenge.gates.complexity`): the gate never crashes;
* builtins :data:`BLOCKED_BUILTINS` (``open``, ``eval``, ...) whenever the name is not a
  function-local variable (a module- or class-level rebinding does not count: a load before
  the rebinding still reaches the builtin);
* introspection attributes :data:`INTROSPECTION_ATTRS` on any object, also as ``getattr``
  literals and inside ``str.format`` fields; blocked attribute names :data:`BLOCKED_ATTRS`;
* ``getattr``/``setattr``/``delattr`` with a non-literal name, or passed around uncalled;
* ``torch.load``/``torch.save`` (and the ``jit``/``export`` variants) unless called directly on
  a path built from ``ctx.artifacts_dir`` (:func:`artifacts_path`); ``weights_only=False``;
* paths on allowed modules are looked up on the real modules (``torch.os`` is :mod:`os`,
  ``F.np`` is numpy, ``F.torch.load`` is ``torch.load``; :mod:`prism_challenge.gates.live`);
* monkeypatching: attribute or item assignment/deletion on anything that resolves to an
  imported module or object, ``type(x)``, ``ctx`` or the harness (also through aliases,
  containers, parameters and attributes of bundle objects); ``__torch_function__`` and
  ``__array_function__`` overrides, global module hooks, op ``py_impl``; ``torch.Tensor``
  subclasses (their methods would run inside the harness's scoring) and overrides of the
  ``nn.Module`` methods the harness relies on (:data:`HARNESS_FACING_METHODS`);
* private attributes of ``ctx`` and the harness; private torch modules and attributes;
* any attribute whose name starts with an underscore, on any expression (``next(iter([ctx]))
  ._runtime``), also as ``getattr``/``hasattr``/``setattr``/``delattr`` literals, ``from X import
  _name``, ``str.format`` fields and ``match`` class patterns (``prism:private-attr``); the only
  exceptions are the string dunders :data:`SAFE_DUNDER_READS`, ``super().__init__`` and names of
  the bundle's own modules. ``str.format``/``format_map`` only on string literals;
* allow-listed names only in ``typing``, ``dataclasses``, ``functools`` and ``torch.jit``
  (:data:`NAMESPACE_ALLOW`), so string-evaluating helpers are blocked by default; objects
  re-exported by allowed modules are judged where they were defined (:func:`origin_rule`);
* modules, and the classes whose methods the harness calls (``torch.Tensor``, ``nn.Module``,
  ``nn.Parameter``, ``type(x)``), used as values (returned, passed, stored): past a call the gate
  could no longer follow what is reached on them or assigned into them;
* classes the gate cannot see: ``type(name, bases, ns)``, computed bases, ``torch.Tensor``
  subclasses and metaclasses looked up on the real modules, dunder members other than the
  ordinary protocols (:data:`PROTOCOL_DUNDERS`); ``torch.compile`` with a callable backend or
  ``options``; ``DataLoader`` worker processes;
* forging a context: calling ``PrismContext``, ``dataclasses.replace``, defining an
  ``artifacts_dir`` of one's own (attribute, keyword, class member or string).

Name resolution is static (:mod:`prism_challenge.gates.astindex`); what it cannot see (objects
passed through calls to unknown functions, containers mutated by method calls) is left to the
runtime sandbox.

Where it lives: this module holds :class:`Checker` (the driver and the helpers every check uses)
and :func:`check_modules`; the tables named above (``:data:``) are in
:mod:`prism_challenge.gates.policy`, :func:`module_rule` and :func:`origin_rule` in
:mod:`prism_challenge.gates.modulerule`, :func:`artifacts_path` in
:mod:`prism_challenge.gates.ctxpath`, and the checks are mixins, one
module per kind of node: :mod:`~prism_challenge.gates.importcheck`,
:mod:`~prism_challenge.gates.namecheck`, :mod:`~prism_challenge.gates.classcheck`,
:mod:`~prism_challenge.gates.attrcheck`, :mod:`~prism_challenge.gates.valuecheck`,
:mod:`~prism_challenge.gates.callcheck` (with :mod:`~prism_challenge.gates.ctxpath` for the
artifacts path), beside the allow-list, binding and set-order mixins. Parsing a file is
:mod:`prism_challenge.gates.parsing`.
"""

from __future__ import annotations

import ast

from prism_challenge.gates.allowcheck import AllowlistChecks
from prism_challenge.gates.astindex import BundleIndex
from prism_challenge.gates.attrcheck import AttributeChecks
from prism_challenge.gates.bindings import BindingChecks
from prism_challenge.gates.callcheck import CallChecks
from prism_challenge.gates.classcheck import ClassChecks
from prism_challenge.gates.complexity import guarded
from prism_challenge.gates.findings import Finding
from prism_challenge.gates.importcheck import ImportChecks
from prism_challenge.gates.modulerule import _harness_path
from prism_challenge.gates.namecheck import NameChecks
from prism_challenge.gates.policy import ALLOWED_MODULES, ALLOWED_ROOTS, SHARDED, SHARDED_WHY
from prism_challenge.gates.qualnames import _root
from prism_challenge.gates.reproducible import SetOrderChecks
from prism_challenge.gates.scopes import ModuleInfo, lookup
from prism_challenge.gates.valuecheck import ValueChecks



class Checker(
    ImportChecks,
    NameChecks,
    ClassChecks,
    AttributeChecks,
    ValueChecks,
    CallChecks,
    AllowlistChecks,
    BindingChecks,
    SetOrderChecks,
):
    """Runs every sandbox rule over one module of an indexed bundle.

    Each check is a mixin of one kind of node (importcheck, namecheck, classcheck, attrcheck,
    valuecheck, callcheck). This class provides them ``index``, ``info``, ``own``, ``q(node)``,
    ``parent(node)``, ``is_builtin(name, node)``, ``add(rule, node, message)`` and each other's
    methods; its ``run`` calls each ``_on_<NodeType>`` handler on every node of the module.

    Args:
        index: the whole bundle (for cross-module resolution).
        info: the module to check.
    """

    def __init__(self, index: BundleIndex, info: ModuleInfo) -> None:
        self.index = index
        self.info = info
        self.own = index.top_level_names
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._seen_messages: set[tuple[str, int, str]] = set()
        self._docstrings = _docstring_ids(info.tree)
        self.current: ast.AST = info.tree

    # -- helpers ---------------------------------------------------------------------------
    def add(self, rule: str, node: ast.AST, message: str) -> None:
        """Record a finding at ``node`` (one per rule and position)."""
        line, col = self.info.position(node)
        key = (rule, line, col)
        if key in self._seen:
            return
        self._seen.add(key)
        if rule == SHARDED:
            message += f" ({SHARDED_WHY})"
        self.findings.append(Finding(rule, self.info.rel, line, col, message))

    def q(self, node: ast.AST, containers: bool = True) -> frozenset[str]:
        """Canonical qualified names of an expression (see :class:`BundleIndex`)."""
        scope = self.info.scope_for(node)
        return self.index.canonical(self.index.resolve(node, scope, containers))

    def parent(self, node: ast.AST) -> ast.AST | None:
        """The parent node, or ``None`` for the module."""
        return self.info.parents.get(id(node))

    def is_builtin(self, name: str, node: ast.AST) -> bool:
        """Whether a load of ``name`` at ``node`` may reach the builtin (not a function local)."""
        where = lookup(name, self.info.scope_for(node))
        return where is None or where.kind in ("module", "class")

    # -- driver ----------------------------------------------------------------------------
    def run(self) -> list[Finding]:
        """Check the module; return its findings."""
        for node in self.info.walk():
            self.current = node
            handler = getattr(self, "_on_" + type(node).__name__, None)
            if handler is not None:
                handler(node)
            self.order_check(node)
        self.drop_redundant()
        return self.findings

    def is_library(self, q: str) -> bool:
        """Whether ``q`` is a path on an allowed (trusted) module rather than a bundle object."""
        if q.startswith("<") or _root(q) in self.own or _root(q) == "builtins":
            return False
        return _root(q) in ALLOWED_ROOTS or q in ALLOWED_MODULES or _harness_path(q)

    def _is_decorator(self, node: ast.AST) -> bool:
        p = self.parent(node)
        return isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in p.decorator_list

    def _type_use(self, node: ast.AST) -> bool:
        if id(node) in self.info.annotation_nodes:
            return True
        p = self.parent(node)
        if isinstance(p, ast.Tuple):
            p = self.parent(p)
        return (
            isinstance(p, ast.Call)
            and isinstance(p.func, ast.Name)
            and p.func.id in ("isinstance", "issubclass")
            and len(p.args) == 2
            and node is not p.args[0]
        )

    def _type_test_use(self, node: ast.AST) -> bool:
        return self._type_use(node) or isinstance(self.parent(node), ast.Compare)

    def _is_call_func(self, node: ast.AST) -> bool:
        p = self.parent(node)
        return isinstance(p, ast.Call) and p.func is node

    def _call_of(self, node: ast.AST) -> ast.Call | None:
        p = self.parent(node)
        return p if isinstance(p, ast.Call) and p.func is node else None


def _docstring_ids(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def check_modules(index: BundleIndex) -> list[Finding]:
    """Run the sandbox over every module of ``index``; findings in file order. A module whose
    check raises (a recursion too deep for the gate) gets a ``prism:too-complex`` finding at
    the node being checked, after what was found before."""
    out: list[Finding] = []
    for name in sorted(index.modules, key=lambda n: index.modules[n].rel):
        checker = Checker(index, index.modules[name])
        found, failed = guarded(checker.info.rel, lambda: checker.info.position(checker.current)[0], checker.run)
        out.extend(checker.findings if found is None else found)
        if failed is not None:  # what was found before the failure stands
            out.append(failed)
    return out


__all__ = [
    "Checker",
    "check_modules",
]
