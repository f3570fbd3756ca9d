"""The sandbox's checks of bare names, keyword arguments and string constants.

Blocked module globals and builtins, builtins off the allow-list, ``getattr``/``type`` passed
around uncalled, and what a name resolves to; ``artifacts_dir`` as a keyword or in a string;
``str.format`` fields in string literals that reach introspection or private attributes.
"""

from __future__ import annotations

import ast
import builtins
import re

from prism_challenge.gates.allowlist import ALLOWLIST_FILE, is_allowed_path
from prism_challenge.gates.policy import (
    BLOCKED_BUILTINS,
    BLOCKED_NAMES,
    CTX_FORGE,
    DYN_ATTR,
    INTRO,
    INTROSPECTION_ATTRS,
    NOT_LISTED,
    PATCH,
    PRIVATE,
    SAFE_DUNDER_READS,
)

_BUILTIN_NAMES = frozenset(vars(builtins))
_FORMAT_FIELD = re.compile(r"\{([^{}]*)\}")
_FIELD_ATTR = re.compile(r"[.\[]\s*([A-Za-z_]\w*)")
_FIELD_DOT = re.compile(r"\.\s*([A-Za-z_]\w*)")
_ARTIFACTS_WORD = re.compile(r"\bartifacts_dir\b")


class NameChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: names, keywords and string constants.

    Its host's contract is in :class:`~prism_challenge.gates.sandbox.Checker`'s docstring."""

    def _on_Name(self, node: ast.Name) -> None:
        if node.id in BLOCKED_NAMES:
            self.add(BLOCKED_NAMES[node.id], node, f"'{node.id}' reaches the interpreter's internals")
            return
        if isinstance(node.ctx, ast.Store):
            scope = self.info.scope_for(node)
            if scope.kind == "class":
                self._class_member(node, node.id)
            elif node.id == "__name__":
                self.add(PATCH, node, "rebinds the module's '__name__'")
            return
        if not isinstance(node.ctx, ast.Load):
            return
        if node.id in BLOCKED_BUILTINS and self.is_builtin(node.id, node):
            self.add(BLOCKED_BUILTINS[node.id], node, f"builtin '{node.id}' is blocked")
            return
        if node.id in _BUILTIN_NAMES and self.is_builtin(node.id, node) and not is_allowed_path(f"builtins.{node.id}"):
            self.add(NOT_LISTED, node, f"builtin '{node.id}' is not on the allow-list ({ALLOWLIST_FILE})")
        if node.id in ("getattr", "setattr", "delattr", "hasattr") and self.is_builtin(node.id, node):
            if not self._is_call_func(node) and node.id != "hasattr":
                self.add(DYN_ATTR, node, f"'{node.id}' passed around uncalled hides attribute names")
            return
        if node.id == "type" and self.is_builtin(node.id, node):
            if not (self._is_call_func(node) or self._type_test_use(node)):
                self.add(PATCH, node, "builtin 'type' passed around uncalled (type(name, bases, ns) builds classes)")
            return
        qs = self.q(node)
        self._module_value(node, qs)
        self._class_value(node, qs)
        self._reference(node, qs)

    def _on_keyword(self, node: ast.keyword) -> None:
        if node.arg == "artifacts_dir":
            self.add(CTX_FORGE, self.parent(node) or node, "passes an 'artifacts_dir' of its own")

    def _on_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str) or id(node) in self._docstrings:
            return
        text = node.value
        for fld in _FORMAT_FIELD.findall(text):
            for attr in _FIELD_ATTR.findall(fld):
                if attr in INTROSPECTION_ATTRS:
                    self.add(INTRO, node, f"format field reaches '{attr}'")
            for attr in _FIELD_DOT.findall(fld):
                if attr.startswith("_") and attr not in SAFE_DUNDER_READS and attr not in INTROSPECTION_ATTRS:
                    self.add(PRIVATE, node, f"format field reads the private attribute '{attr}'")
        if _ARTIFACTS_WORD.search(text) and not self._is_attr_literal(node):
            self.add(CTX_FORGE, node, "string names 'artifacts_dir' (building a context of one's own)")

    def _is_attr_literal(self, node: ast.Constant) -> bool:
        p = self.parent(node)
        return (
            isinstance(p, ast.Call)
            and isinstance(p.func, ast.Name)
            and p.func.id in ("getattr", "hasattr")
            and len(p.args) >= 2
            and p.args[1] is node
        )
