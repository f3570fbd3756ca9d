"""Rules for a run that is the same every time: no wall clock, no profiler, no set order.

Two runs of one bundle on one seed must give the same score to the last bit (issue 15: two runs
of a bundle differed, 3.3719 vs 3.3722 bpb, and 3.324 vs 3.309). Two sources the gate can see:

* **Timing.** The wall clock (``time``, ``datetime``, ``timeit``) and the profilers
  (``torch.profiler``, ``torch.autograd.profiler``, ``torch.cuda.Event``) give a different
  value on every run; code that branches on them (a schedule by elapsed seconds, a step skipped
  when it was slow) trains differently. Refused as ``prism:wall-clock``.
* **Set order.** A ``set`` or ``frozenset`` is iterated in the order of its elements' hashes.
  A tensor's, a parameter's or a module's hash is its memory address, which differs between
  runs, so ``AdamW({*model.parameters()})`` or ``for p in set(params)`` builds the optimizer's
  groups, or sums the gradients, in a different order each time. Refused as
  ``prism:set-order``.

The gate cannot see what a set holds, so it refuses every order-dependent use of a set-valued
expression except a literal set of constants (a ``str``'s hash is fixed by the harness's
``PYTHONHASHSEED=0``, an ``int``'s is its value). Order-free uses stay allowed: ``len``,
membership, ``sorted(...)`` without ``key`` (with one, equal keys keep the set's order), the set
algebra (``|``, ``&``, ``-``, ``^`` and the methods), building another set, a ``list``/``tuple``
copy that goes straight into one of those (minGPT's ``sorted(list(decay))``), and any use in an
``assert``'s message in a module that catches no ``AssertionError`` (the message is built only
when the run ends with the error). Order-dependent uses are refused: a ``for`` or a
comprehension over it, unpacking it (``*s``), ``s.pop()``, ``yield from s``, and passing it to
any other call (``list``, ``tuple``, ``sum``, ``enumerate``, an optimizer, a function of the
bundle's own).

Set-valued expressions: ``set(...)``, ``frozenset(...)``, a set display or comprehension, the
set algebra on one of them (including ``dict.keys() - s``), a name whose binding in its scope is
one of them, and an attribute whose name is assigned one anywhere in the module
(``self.groups = set()``). A set that leaves through a return value or a container is not
followed: the rule catches the direct idiom, not a program built to hide one.
"""

from __future__ import annotations

import ast
import builtins

from prism_challenge.gates.scopes import lookup

SET_ORDER = "prism:set-order"
WALL_CLOCK = "prism:wall-clock"

CLOCK_MODULES = "time datetime timeit torch.profiler torch.autograd.profiler " \
    "torch.autograd.profiler_util torch.cuda.Event torch.Event torch.cpu.Event torch.xpu.Event"
"""Wall-clock and profiler modules and classes (space-separated), refused as
:data:`WALL_CLOCK`."""

ORDER_FREE_BUILTINS = frozenset({"builtins.len", "builtins.sorted", "builtins.set", "builtins.frozenset",
                                 "builtins.bool", "builtins.isinstance"})
"""Builtins that may take a set: their result does not depend on the iteration order."""

COPY_BUILTINS = frozenset({"builtins.list", "builtins.tuple"})
"""Builtins that copy an iterable in its order: fine only when what takes the copy ignores it."""

ORDER_FREE_CONSUMERS = frozenset({"builtins.len", "builtins.sorted", "builtins.set", "builtins.frozenset",
                                  "builtins.bool"})
"""Builtins whose result ignores the order of their first argument (``sorted`` without ``key``)."""

SET_RESULT_METHODS = frozenset({"union", "intersection", "difference", "symmetric_difference", "copy"})
"""Set methods whose result is again a set."""

ORDER_FREE_METHODS = SET_RESULT_METHODS | frozenset(
    {"add", "discard", "remove", "update", "intersection_update", "difference_update",
     "symmetric_difference_update", "issubset", "issuperset", "isdisjoint", "clear"})
"""Set methods (called on a set) that may take a set argument and do not depend on order."""

SET_OPS = (ast.BitOr, ast.BitAnd, ast.Sub, ast.BitXor)
MAX_DEPTH = 32


class SetOrderChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: ``prism:set-order`` for each
    order-dependent use of a set-valued expression (see the module docstring).

    The host class provides ``index`` and ``info`` (the bundle and the module; it is built as
    ``type(self)(index, info)``), ``q(node)`` (canonical qualified names), ``parent(node)`` and
    ``add(rule, node, message)``; :meth:`order_check` is called on every node of the module."""

    _set_attrs: frozenset[str] | None = None

    def order_check(self, node: ast.AST) -> None:
        """Record ``prism:set-order`` if ``node`` consumes a set in an order-dependent way."""
        if isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            self._refuse_set(node.iter, "iterating it")
        elif isinstance(node, ast.Starred | ast.YieldFrom):
            self._refuse_set(node.value, "unpacking it" if isinstance(node, ast.Starred) else "yield from it")
        elif isinstance(node, ast.Call):
            self._set_call(node)

    def _set_call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "pop" and self.set_valued(func.value):
            self.add(SET_ORDER, node, "set.pop() takes an arbitrary element: " + _HINT)
        if isinstance(func, ast.Attribute) and func.attr in ORDER_FREE_METHODS and self.set_valued(func.value):
            return
        if self.q(func) and self.q(func) <= ORDER_FREE_BUILTINS:
            if self.q(func) == {"builtins.sorted"} and any(k.arg == "key" for k in node.keywords) and node.args:
                self._refuse_set(node.args[0], "sorted(..., key=...): ties keep the set's order")
            return
        if self._copied_for_order_free(node):
            return
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if not isinstance(arg, ast.Starred):  # a starred set is refused as unpacking
                self._refuse_set(arg, f"passing it to {_callee(func)}")

    def _copied_for_order_free(self, node: ast.Call) -> bool:
        """Whether ``node`` is ``list(x)`` or ``tuple(x)`` (one positional argument) whose result
        goes straight into an order-free consumer: ``sorted(list(s))`` (no ``key``), ``len``,
        ``set``, ``frozenset``, ``bool``, possibly through more such copies
        (``sorted(tuple(list(s)))``). The copy is in hash order, but nothing sees that order."""
        for _ in range(MAX_DEPTH):
            if not (self.q(node.func) <= COPY_BUILTINS and self.q(node.func)
                    and len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred)):
                return False
            parent = self.parent(node)
            if not (isinstance(parent, ast.Call) and parent.args and parent.args[0] is node):
                return False
            q = self.q(parent.func)
            if q and q <= ORDER_FREE_CONSUMERS and not any(k.arg == "key" for k in parent.keywords):
                return True
            node = parent
        return False

    def _refuse_set(self, expr: ast.AST, how: str) -> None:
        if self.set_valued(expr) and not self._in_assert_message(expr):
            self.add(SET_ORDER, expr, f"a set is iterated in hash order ({how}): " + _HINT)

    def _in_assert_message(self, node: ast.AST) -> bool:
        """Whether ``node`` lies in the message of an ``assert`` (``assert not s, str(s)``) of a
        bundle that catches no ``AssertionError`` (no ``except`` that may, in any of its modules,
        and no ``__exit__`` of its own): the message is built only when the assertion fails, and
        then the error ends the run, so its order reaches nothing."""
        child, parent = node, self.parent(node)
        while parent is not None and not isinstance(parent, ast.Assert):
            child, parent = parent, self.parent(parent)
        if not (isinstance(parent, ast.Assert) and parent.msg is child):
            return False
        for info in self.index.modules.values():  # the error may be caught in any module of the bundle
            checker = self if info is self.info else type(self)(self.index, info)
            for n in ast.walk(info.tree):
                if isinstance(n, ast.ExceptHandler) and checker._may_catch_assertion(n.type):
                    return False
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and (
                        n.name in ("__exit__", "__aexit__", "__del__") or _finalizes_when_collected(n)):
                    return False  # a context manager sees the error and may swallow it; one raised in a
                    # __del__, or in a generator's finally run as it is collected, is ignored
        return True

    def _may_catch_assertion(self, kind: ast.AST | None) -> bool:
        """Whether an ``except`` clause of this type may catch an ``AssertionError``: anything
        but a builtin exception class (the name resolving to the builtin) that is not
        ``AssertionError`` or one of its bases; a tuple when any member may."""
        if kind is None:
            return True
        if isinstance(kind, ast.Tuple):
            return any(self._may_catch_assertion(e) for e in kind.elts)
        q = self.q(kind)
        cls = getattr(builtins, next(iter(q))[len("builtins."):], None) if len(q) == 1 and next(
            iter(q)).startswith("builtins.") else None
        return not (isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(AssertionError, cls))

    def set_valued(self, node: ast.AST, depth: int = 0) -> bool:
        """Whether ``node`` evaluates to a set or frozenset the gate must treat as unordered."""
        if depth > MAX_DEPTH:
            return False
        if isinstance(node, ast.Set):
            return not all(isinstance(e, ast.Constant) for e in node.elts)
        if isinstance(node, ast.SetComp):
            return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, SET_OPS):
            return self.set_valued(node.left, depth + 1) or self.set_valued(node.right, depth + 1)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in SET_RESULT_METHODS:
                return self.set_valued(func.value, depth + 1)
            return bool(self.q(func) & {"builtins.set", "builtins.frozenset"})
        if isinstance(node, ast.Name):
            return self._name_is_set(node, depth)
        if isinstance(node, ast.Attribute):
            return node.attr in self._assigned_set_attrs()
        return False

    def _name_is_set(self, node: ast.Name, depth: int) -> bool:
        scope = lookup(node.id, self.info.scope_for(node))
        if scope is None:
            return False
        return any(b[0] == "expr" and b[1] is not node and self.set_valued(b[1], depth + 1)
                   for b in scope.bindings.get(node.id, ()))

    def _assigned_set_attrs(self) -> frozenset[str]:
        if self._set_attrs is None:
            self._set_attrs = frozenset()  # no attribute is a set while the module is scanned
            names = set()
            for n in ast.walk(self.info.tree):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                    n, ast.AnnAssign | ast.AugAssign) and n.value is not None else []
                if any(isinstance(t, ast.Attribute) for t in targets) and self.set_valued(n.value):
                    names |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
            self._set_attrs = frozenset(names)
        return self._set_attrs


_HINT = ("the order of tensors, parameters and modules in a set is their memory addresses, which "
         "differ between runs; keep a list (or a dict), or iterate sorted(...) of names")


def _callee(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return f"{func.id}()"
    if isinstance(func, ast.Attribute):
        return f".{func.attr}()"
    return "a call"


def _finalizes_when_collected(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``fn`` is a generator with a ``finally`` or a ``with`` block: closed as it is
    garbage-collected, it runs that code, and Python ignores (prints) what it raises there, so an
    ``AssertionError`` there (or in anything it calls) does not end the run."""
    nodes = list(ast.walk(fn))
    return any(isinstance(n, ast.Yield | ast.YieldFrom) for n in nodes) and any(
        (isinstance(n, ast.Try) and n.finalbody) or isinstance(n, ast.With | ast.AsyncWith) for n in nodes)
