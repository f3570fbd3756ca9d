"""The sandbox's checks of what an expression is and where its value goes.

Modules and the classes the harness calls (``torch.Tensor``, ``nn.Module``, ``nn.Parameter``,
``type(x)``) used as values the gate could no longer follow; references to blocked objects,
``torch.load``/``torch.save``, calls checked where they are made, and context forging.
"""

from __future__ import annotations

import ast

from prism_challenge.gates.astindex import CTX, TYPE
from prism_challenge.gates.modulerule import namespace_rule, origin_rule
from prism_challenge.gates.policy import (
    BLOCKED_BUILTINS,
    BLOCKED_PREFIXES,
    BLOCKED_QUALNAMES,
    CHECKED_CALLS,
    CTX_FORGE,
    DYN_ATTR,
    HARMLESS_CONSUMERS,
    PATCH,
    PRISM_CONTEXT,
    TORCH_IO,
    TORCH_LOADS,
    TORCH_SAVES,
)
from prism_challenge.gates.qualnames import _harness_class, _is_live_module, _root


class ValueChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: values and references.

    Its host's contract is in :class:`~prism_challenge.gates.sandbox.Checker`'s docstring."""

    def _module_value(self, node: ast.AST, qs: frozenset[str]) -> None:
        """A module used as a value (passed, returned, stored, put in a container, annotated):
        past a call the gate can no longer follow what is reached on it, so only ``mod.attr``,
        ``getattr(mod, "lit")`` and plain aliases (``G = F``) may use a module."""
        mods = sorted(q for q in qs if self._is_module(q))
        if mods and not self._followed(node):
            self.add(DYN_ATTR, node, f"module '{mods[0]}' used as a value hides what is reached on it")

    def _class_value(self, node: ast.AST, qs: frozenset[str]) -> None:
        """``torch.Tensor``, ``nn.Module``, ``nn.Parameter`` and ``type(x)`` (the classes whose
        methods the harness calls) used as a value: past a call the gate could no longer see an
        assignment into them (``next(iter([torch.Tensor])).gather = f``). Allowed: attribute
        access, calls, type tests, annotations, class bases and plain aliases."""
        hit = sorted(q for q in qs if q == TYPE or _harness_class(q))
        if not hit or self._followed(node):
            return
        p = self.parent(node)
        if self._type_use(node) or (isinstance(p, ast.ClassDef) and node in p.bases):
            return
        if isinstance(p, ast.BinOp) and isinstance(p.op, ast.BitOr):
            return  # X | None (a types.UnionType: read-only, its __args__ out of reach)
        if isinstance(p, ast.Tuple):
            p = self.parent(p)
        if isinstance(p, ast.Subscript) and p.value is not node:
            gq = self.q(p.value)
            if gq and all(
                (_root(q) == "typing" and q != "typing.Annotated") or q.startswith("builtins.") for q in gq
            ):
                # Optional[torch.Tensor]: a typing alias forwards attribute stores to its origin
                # (Union, list), never to its arguments; Annotated's origin is its argument
                return
        what = "type(...)" if hit[0] == TYPE else f"'{hit[0]}'"
        self.add(PATCH, node, f"{what} used as a value: an assignment into it could no longer be seen")

    def _followed(self, node: ast.AST) -> bool:
        """Whether the gate keeps following the value of ``node``: ``node.attr``, ``node(...)``,
        ``getattr(node, "lit")``, ``G = node``, a comparison."""
        p = self.parent(node)
        if isinstance(p, ast.Attribute) and p.value is node:
            return True
        if isinstance(p, ast.Call) and p.func is node:
            return True
        if (
            isinstance(p, ast.Call)
            and isinstance(p.func, ast.Name)
            and p.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and self.is_builtin(p.func.id, p.func)
            and len(p.args) >= 2
            and p.args[0] is node
            and isinstance(p.args[1], ast.Constant)
            and isinstance(p.args[1].value, str)
        ):
            return True
        if isinstance(p, (ast.Assign, ast.AnnAssign)) and p.value is node:
            targets = p.targets if isinstance(p, ast.Assign) else [p.target]
            return all(isinstance(t, ast.Name) for t in targets)
        if isinstance(p, ast.Call) and node in p.args and isinstance(p.func, ast.Name):
            if p.func.id in HARMLESS_CONSUMERS and self.is_builtin(p.func.id, p.func):
                return True  # str(x), print(x): nothing comes back but text
        return isinstance(p, (ast.Compare, ast.FormattedValue))

    def _is_module(self, q: str) -> bool:
        if q.startswith("<"):
            return False
        if _root(q) in self.own:
            return q in self.index.modules or q in self.own
        return _is_live_module(q)

    def _reference(self, node: ast.AST, qs: frozenset[str]) -> None:
        """Rules about what an expression *is*: torch.load/save, blocked objects, ctx forging."""
        call = self._call_of(node)
        for q in sorted(qs):
            if q.startswith("builtins.") and not isinstance(node, ast.Name):
                name = q[len("builtins.") :]
                if name in BLOCKED_BUILTINS:
                    self.add(BLOCKED_BUILTINS[name], node, f"'{q}' is blocked")
                elif name in ("getattr", "setattr", "delattr"):
                    self.add(DYN_ATTR, node, f"'{q}' reached through a module")
            if q in TORCH_LOADS or q in TORCH_SAVES:
                if call is None:
                    self.add(TORCH_IO, node, f"'{q}' referenced without calling it directly")
                else:
                    self._torch_io_call(call, q)
            if q in CHECKED_CALLS and call is None and not self._is_decorator(node):
                rule, what = CHECKED_CALLS[q]
                self.add(rule, node, f"'{q}' referenced without calling it directly ({what})")
            rule = BLOCKED_QUALNAMES.get(q)
            if rule:
                self.add(rule, node, f"'{q}' is blocked")
            for prefix, rule in BLOCKED_PREFIXES.items():
                if q == prefix or q.startswith(prefix + "."):
                    self.add(rule, node, f"'{q}' is blocked")
            if not q.startswith("<") and _root(q) not in self.own:
                hit = namespace_rule(q) or origin_rule(q)
                if hit:
                    self.add(hit[0], node, hit[1])
            if q == PRISM_CONTEXT and not self._type_use(node):
                self.add(CTX_FORGE, node, "PrismContext used other than as a type (forging a context)")
            if call is not None and q.startswith(CTX + ".__class__"):
                self.add(CTX_FORGE, node, "calls the context's type (forging a context)")
