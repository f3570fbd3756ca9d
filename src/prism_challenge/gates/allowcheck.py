"""The allow-list's attribute rule inside the sandbox's checker (a mixin of
:class:`prism_challenge.gates.sandbox.Checker`).

Paths on the allowed modules (``torch.ops``) are judged whole by
:func:`prism_challenge.gates.modulerule.module_rule`. Here: an attribute name used on any other
object (``x.view``, ``self.weight``, ``getattr(m, "numpy")``, ``"{0.numpy}".format(t)``, a
``match`` keyword pattern) must be on the allow-list (:func:`~prism_challenge.gates.allowlist.
is_allowed_attr`) or defined by the bundle itself (:func:`~prism_challenge.gates.owned.
defined_names`); otherwise ``prism:not-allowlisted`` at the name. A line that already breaks a
deny rule reports that rule alone (:meth:`AllowlistChecks.drop_redundant`).
"""

from __future__ import annotations

import ast
import re

from prism_challenge.gates.allowlist import ALLOWLIST_FILE, NOT_ALLOWLISTED, is_allowed_attr
from prism_challenge.gates.astindex import BundleIndex
from prism_challenge.gates.findings import Finding
from prism_challenge.gates.owned import defined_names
from prism_challenge.gates.scopes import ModuleInfo

_FORMAT_FIELD = re.compile(r"\{([^{}]*)\}")
_FIELD_DOT = re.compile(r"\.\s*([A-Za-z_]\w*)")


class AllowlistChecks:
    """The attribute rule; the checker provides ``index``, ``info``, ``findings``, an empty
    ``_seen_messages`` set and :meth:`is_library`."""

    index: BundleIndex
    info: ModuleInfo
    findings: list[Finding]
    _seen_messages: set[tuple[str, int, str]]

    def is_library(self, q: str) -> bool:  # pragma: no cover - provided by the checker
        """Whether ``q`` is a path on an allowed module (judged by the path rule instead)."""
        raise NotImplementedError

    def add_at(self, rule: str, line: int, col: int, message: str) -> None:
        """Record a finding at an explicit position (one per rule and message on a line)."""
        key = (rule, line, message)
        if key not in self._seen_messages:
            self._seen_messages.add(key)
            self.findings.append(Finding(rule, self.info.rel, line, col, message))

    def name_position(self, node: ast.AST, attr: str) -> tuple[int, int]:
        """Where the attribute name of ``node`` (``x.attr``) starts; the node's start otherwise."""
        if isinstance(node, ast.Attribute) and node.end_lineno and node.end_col_offset is not None:
            end = ast.Attribute(lineno=node.end_lineno, col_offset=node.end_col_offset - len(attr.encode("utf-8")))
            return self.info.position(end)
        return self.info.position(node)

    def listed_attr(self, node: ast.AST, attr: str, base_q: frozenset[str]) -> None:
        """The attribute rule for ``attr`` read at ``node`` on an object that resolves to
        ``base_q`` (skipped when that is an allowed module or a listed object: the path rule
        judges ``base.attr`` whole)."""
        if any(self.is_library(q) for q in base_q):
            return
        if is_allowed_attr(attr) or attr in defined_names(self.index):
            return
        line, col = self.name_position(node, attr)
        self.add_at(NOT_ALLOWLISTED, line, col,
                    f"attribute '{attr}' is not on the allow-list ({ALLOWLIST_FILE}) and the bundle does not define it")

    def format_fields(self, node: ast.Attribute) -> None:
        """``"{0.attr}".format(x)`` reads ``attr``: the attribute rule for each field."""
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for fld in _FORMAT_FIELD.findall(node.value.value):
                for attr in _FIELD_DOT.findall(fld):
                    self.listed_attr(node.value, attr, frozenset())

    def drop_redundant(self) -> None:
        """Drop ``prism:not-allowlisted`` findings on lines that break a deny rule: a path or
        name on a deny rule keeps that rule's specific id alone."""
        denied = {f.line for f in self.findings if f.rule != NOT_ALLOWLISTED}
        self.findings[:] = [f for f in self.findings if f.rule != NOT_ALLOWLISTED or f.line not in denied]


__all__ = ["AllowlistChecks"]
