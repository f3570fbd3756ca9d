"""The sandbox's checks of attribute access, attribute and item stores, and blocked paths.

Introspection, blocked and private attribute names (with the exceptions: safe dunders,
``super().__init__``, the bundle's own modules), ``str.format`` only on literals, stores into
imported objects, ``ctx`` or ``type(x)``, and an attribute path that leaves the allow-list.
"""

from __future__ import annotations

import ast

from prism_challenge.gates.allowlist import ALLOWLIST_FILE
from prism_challenge.gates.astindex import CTX
from prism_challenge.gates.determinism import DETERMINISM
from prism_challenge.gates.modulerule import module_rule
from prism_challenge.gates.policy import (
    BLOCKED_ATTRS,
    CTX_FORGE,
    CTX_PRIVATE,
    DYN,
    DYN_ATTR,
    HOOK_PREFIX,
    INTRO,
    INTROSPECTION_ATTRS,
    NOT_LISTED,
    PATCH,
    PRIVATE,
    SAFE_DUNDER_READS,
    TORCH_PRIVATE,
)
from prism_challenge.gates.qualnames import _describe, _private, _root
from prism_challenge.gates.scopes import lookup


class AttributeChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: attributes, stores and blocked paths.

    Its host's contract is in :class:`~prism_challenge.gates.sandbox.Checker`'s docstring."""

    def _on_Attribute(self, node: ast.Attribute) -> None:
        base_q = self.q(node.value)
        store = isinstance(node.ctx, (ast.Store, ast.Del))
        self._attr_name_rules(node, node.attr, base_q, node.value, store=store)
        if store:
            self._store(node, node.attr, base_q, isinstance(node.ctx, ast.Del))
            return
        if node.attr in ("format", "format_map") and not self._literal_str(node.value):
            self.add(DYN_ATTR, node, f"str.{node.attr} on a string that is not a literal can read any attribute")
        elif node.attr in ("format", "format_map"):
            self.format_fields(node)
        if node.attr == "compile" and self._call_of(node) is None and not self._is_decorator(node):
            self.add(DYN, node, "'.compile' referenced without calling it directly (its backend and options are checked at the call)")
        full = self.q(node)
        self._blocked_prefix(node, base_q, full)
        self._module_value(node, full)
        self._class_value(node, full)
        self._reference(node, full)
        self.listed_attr(node, node.attr, base_q)

    def _attr_name_rules(
        self,
        node: ast.AST,
        attr: str,
        base_q: frozenset[str],
        base: ast.AST | None = None,
        *,
        store: bool = False,
        own: bool = False,
    ) -> None:
        flagged = True
        if attr in INTROSPECTION_ATTRS:
            self.add(INTRO, node, f"attribute '{attr}' reaches the interpreter's internals")
        elif attr in BLOCKED_ATTRS:
            self.add(BLOCKED_ATTRS[attr], node, f"attribute '{attr}' is blocked")
        elif attr.startswith(HOOK_PREFIX):
            self.add(PATCH, node, f"'{attr}' installs a global hook over every module")
        else:
            flagged = False
        if not attr.startswith("_"):
            return
        if any(_root(b) in (CTX, "prism_challenge") for b in base_q):
            self.add(CTX_PRIVATE, node, f"private attribute '{attr}' of the context or harness")
            return
        if own or (base is not None and self._own_module(base, 0)):
            return
        if not store and attr in SAFE_DUNDER_READS:
            return
        if not store and attr == "__init__" and base is not None and self._is_super(base):
            return
        if _private(attr) and any(_root(b) == "torch" for b in base_q):
            self.add(TORCH_PRIVATE, node, f"private torch attribute '{attr}'")
        elif not flagged:
            self.add(PRIVATE, node, f"attribute '{attr}' starts with an underscore (private or interpreter hook; rename bundle attributes)")

    def _own_module(self, expr: ast.AST, depth: int) -> bool:
        """Whether ``expr`` is certainly one of the bundle's own modules (``helpers``,
        ``layers.blocks``): names bound only by imports of bundle modules."""
        if depth > 8:
            return False
        if isinstance(expr, ast.Attribute):
            return self._own_module(expr.value, depth + 1) and all(
                q in self.index.modules for q in self.q(expr)
            )
        if not isinstance(expr, ast.Name):
            return False
        where = lookup(expr.id, self.info.scope_for(expr))
        if where is None:
            return False
        bindings = where.bindings.get(expr.id, [])
        return bool(bindings) and all(
            b[0] == "import" and (b[1] in self.index.modules or b[1] in self.own) for b in bindings
        )

    def _is_super(self, expr: ast.AST) -> bool:
        """``super()`` or ``super(C, x)`` with ``C`` a bundle class: its ``__init__`` is the next
        class's in the MRO of a bundle class (never the harness's)."""
        if not (
            isinstance(expr, ast.Call)
            and isinstance(expr.func, ast.Name)
            and expr.func.id == "super"
            and self.is_builtin("super", expr.func)
            and not expr.keywords
        ):
            return False
        if not expr.args:
            return True
        if len(expr.args) != 2 or not isinstance(expr.args[0], ast.Name):
            return False
        where = lookup(expr.args[0].id, self.info.scope_for(expr))
        bindings = where.bindings.get(expr.args[0].id, []) if where is not None else []
        return bool(bindings) and all(b[0] == "def" and isinstance(b[1], ast.ClassDef) for b in bindings)

    def _literal_str(self, expr: ast.AST) -> bool:
        """Whether ``expr`` is a string literal, or a name bound only to string literals."""
        if isinstance(expr, ast.Constant):
            return isinstance(expr.value, str)
        if not isinstance(expr, ast.Name):
            return False
        where = lookup(expr.id, self.info.scope_for(expr))
        bindings = where.bindings.get(expr.id, []) if where is not None else []
        for b in bindings:
            if not (b[0] == "expr" and isinstance(b[1], ast.Constant) and isinstance(b[1].value, str)):
                return False
            parents = self.index.info_of(b[2]).parents
            if not isinstance(parents.get(id(b[1])), (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                return False  # fmt += "..." joins literals into a format string of its own
        return bool(bindings)

    def _store(self, node: ast.AST, attr: str, base_q: frozenset[str], delete: bool) -> None:
        if attr == "artifacts_dir":
            self.add(CTX_FORGE, node, "sets an 'artifacts_dir' of its own")
        if base_q:
            what = _describe(base_q)
            verb = "deletes" if delete else "assigns"
            self.add(PATCH, node, f"{verb} attribute '{attr}' of {what}")

    def _on_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            base_q = self.q(node.value, containers=False)
            if base_q:
                self.add(PATCH, node, f"assigns an item of {_describe(base_q)}")

    def _blocked_prefix(self, node: ast.AST, base_q: frozenset[str], full: frozenset[str]) -> None:
        def rule_of(q: str) -> str | None:
            if _root(q) in self.own or q.startswith("<") or _root(q) == "builtins":
                return None
            hit = module_rule(q, self.own)
            return hit[0] if hit else None

        if any(rule_of(b) for b in base_q):
            return  # already reported where the path first left the allowlist
        hits = [(q, rule_of(q)) for q in sorted(full)]
        hits = [h for h in hits if h[1]]
        if hits:  # what the path really is (its live name) before its spelling (a private name)
            q, rule = min(hits, key=lambda h: (h[1] in (PRIVATE, TORCH_PRIVATE), h[1] == NOT_LISTED))
            if rule == NOT_LISTED:
                attr = q.rsplit(".", 1)[-1]
                line, col = self.name_position(node, attr)
                self.add_at(rule, line, col, f"'{q}' is not on the allow-list ({ALLOWLIST_FILE})")
            elif rule == DETERMINISM:  # its reason names what the path switches
                self.add(rule, node, module_rule(q, self.own)[1])
            else:
                self.add(rule, node, f"'{q}' is blocked")
