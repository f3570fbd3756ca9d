"""The sandbox's checks of what a bundle's functions and classes define.

Class members that patch (``__torch_function__``, ``__reduce__``), override a method the harness
relies on or define a dunder other than the ordinary protocols; ``artifacts_dir`` of one's own;
class bases the gate cannot name, ``torch.Tensor`` subclasses and metaclasses; ``match`` class
patterns that read private attributes or ``__match_args__``.
"""

from __future__ import annotations

import ast

from prism_challenge.gates.policy import (
    BUILTIN_MATCH_TYPES,
    CTX_FORGE,
    DYN_ATTR,
    HARNESS_FACING_METHODS,
    PATCH,
    PATCH_DEFS,
    PRIVATE,
    PROTOCOL_DUNDERS,
    TENSOR_CLASSES,
)
from prism_challenge.gates.qualnames import _live_class_kind
from prism_challenge.gates.scopes import lookup


class ClassChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: function and class definitions.

    Its host's contract is in :class:`~prism_challenge.gates.sandbox.Checker`'s docstring."""

    def _class_member(self, node: ast.AST, name: str) -> None:
        in_class = self.info.scope_for(node).kind == "class"
        if not (in_class or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            return
        if name in PATCH_DEFS:
            self.add(PATCH_DEFS[name], node, f"a bundle class may not define '{name}'")
        if name == "artifacts_dir":
            self.add(CTX_FORGE, node, "defines an 'artifacts_dir' of its own")
        if not in_class or name in PATCH_DEFS:
            return
        if name in HARNESS_FACING_METHODS:
            self.add(PATCH, node, f"a bundle class may not override '{name}' (the harness relies on it)")
        elif _dunder(name) and name not in PROTOCOL_DUNDERS:
            self.add(PATCH, node, f"a bundle class may not define '{name}' (not a standard protocol method)")

    def _on_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._class_member(node, node.name)
        self.module_level_def(node)

    def _on_ClassDef(self, node: ast.ClassDef) -> None:
        self.module_level_def(node)
        for base in node.bases:
            if isinstance(base, ast.Starred):
                self.add(DYN_ATTR, node, "class bases from a starred expression hide the base classes")
                continue
            qs = self.q(base)
            if qs & TENSOR_CLASSES:
                self.add(PATCH, node, "a torch.Tensor subclass would run its own methods inside the harness")
                continue
            if not self._static_base(base, 0):
                self.add(DYN_ATTR, node, "a class base the gate cannot name (computed or passed in)")
                continue
            for q in sorted(qs):
                what = _live_class_kind(q)
                if what == "tensor":
                    self.add(PATCH, node, f"'{q}' is a torch.Tensor subclass: its methods would run inside the harness")
                elif what == "meta":
                    self.add(PATCH, node, f"'{q}' is a metaclass: a subclass can intercept class and instance checks")
        for kw in node.keywords:
            if kw.arg == "metaclass":
                self.add(PATCH, node, "a custom metaclass can intercept class and instance checks")

    _on_AsyncFunctionDef = _on_FunctionDef

    def _static_base(self, expr: ast.AST, depth: int) -> bool:
        """Whether a class base is a name the gate can follow: a bundle class, an imported name,
        a builtin, an attribute path on one of those, a subscript of one (``Generic[T]``) or a
        ``collections.namedtuple(...)`` call."""
        if depth > 8:
            return False
        if isinstance(expr, ast.Name):
            where = lookup(expr.id, self.info.scope_for(expr))
            if where is None:
                return True
            bindings = where.bindings.get(expr.id, [])
            if not bindings:
                return False
            for b in bindings:
                if b[0] == "def" and isinstance(b[1], ast.ClassDef) or b[0] == "import":
                    continue
                if b[0] == "expr" and self._static_base(b[1], depth + 1):
                    continue
                return False
            return True
        if isinstance(expr, ast.Attribute):
            return self._static_base(expr.value, depth + 1)
        if isinstance(expr, ast.Subscript):
            return self._static_base(expr.value, depth + 1)
        if isinstance(expr, ast.Call):
            return "collections.namedtuple" in self.q(expr.func)
        return False

    def _on_MatchClass(self, node: ast.MatchClass) -> None:
        for attr in node.kwd_attrs:
            if attr.startswith("_"):
                self.add(PRIVATE, node, f"class pattern reads the private attribute '{attr}'")
            self.listed_attr(node, attr, frozenset())
        if node.patterns:
            qs = self.q(node.cls)
            if not qs or not all(q[len("builtins.") :] in BUILTIN_MATCH_TYPES for q in qs if q.startswith("builtins.")) or any(
                not q.startswith("builtins.") for q in qs
            ):
                self.add(PRIVATE, node, "positional class pattern reads the attributes named by __match_args__")


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")
