"""The sandbox's checks of ``import`` and ``from ... import`` statements.

Each imported module is judged by :func:`prism_challenge.gates.modulerule.module_rule`; each
name imported with ``from`` also where it really lives (a blocked module, a blocked builtin, a
re-export judged at its origin) and by the attribute-name rules.
"""

from __future__ import annotations

import ast

from prism_challenge.gates.live import live_name
from prism_challenge.gates.modulerule import module_rule, namespace_rule, origin_rule
from prism_challenge.gates.policy import ALLOWED_MODULES, BLOCKED_BUILTINS, BLOCKED_MODULES, BLOCKED_QUALNAMES, NOT_ALLOWED
from prism_challenge.gates.qualnames import _root
from prism_challenge.gates.scopes import absolute_module


class ImportChecks:
    """Mixin of :class:`prism_challenge.gates.sandbox.Checker`: imports and ``from`` imports.

    Its host's contract is in :class:`~prism_challenge.gates.sandbox.Checker`'s docstring."""

    def _on_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            hit = module_rule(alias.name, self.own)
            if hit:
                self.add(hit[0], node, f"import {alias.name}: {hit[1]}")
            elif alias.name.startswith("prism_challenge") and not alias.asname:
                self.add(NOT_ALLOWED, node, f"import {alias.name}: use 'from {alias.name} import ...'")
            self._class_member(node, alias.asname or alias.name.split(".")[0])

    def _on_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = absolute_module(node, self.info)
        relative = node.level > 0
        for alias in node.names:
            if alias.name == "*":
                self.add(NOT_ALLOWED, node, f"from {base or '.'} import *: star imports hide names from the gate")
                continue
            self._class_member(node, alias.asname or alias.name)
            full = f"{base}.{alias.name}" if base else alias.name
            if not relative:
                hit = module_rule(base, self.own)
                if hit and module_rule(full, self.own) is None and full in ALLOWED_MODULES:
                    hit = None
                if hit is None:
                    hit = self._from_name_rule(full, alias.name)
                if hit:
                    self.add(hit[0], node, f"from {base} import {alias.name}: {hit[1]}")
                    continue
            own = relative or _root(base) in self.own
            self._attr_name_rules(node, alias.name, frozenset({base}), own=own)

    def _from_name_rule(self, full: str, name: str) -> tuple[str, str] | None:
        parts = full.split(".")
        if parts[0] in self.own:
            return None
        for i in range(len(parts), 1, -1):
            rule = BLOCKED_MODULES.get(".".join(parts[:i]))
            if rule:
                return rule, f"'{full}' is blocked"
        rule = BLOCKED_QUALNAMES.get(full)
        if rule:
            return rule, f"'{full}' is blocked"
        hit = namespace_rule(full) or origin_rule(full)
        if hit:
            return hit
        live = live_name(full)
        if live is not None and live.startswith("builtins."):
            rule = BLOCKED_BUILTINS.get(live[len("builtins.") :])
            if rule:
                return rule, f"'{full}' is {live}"
        elif live is not None:
            hit = module_rule(live, self.own)
            if hit:
                return hit[0], f"'{full}' is {live}"
        return module_rule(full, self.own)  # the allow-list judges the name as spelled
