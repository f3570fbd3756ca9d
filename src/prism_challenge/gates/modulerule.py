"""Judging a module or attribute path on the trusted modules: the deny rules, then the allow-list.

:func:`module_rule` is the one judge of an import or a path such as ``torch.nn.functional.gelu``
(also called by the ranks' runtime audit hook, :mod:`prism_challenge.evaluator.audit`, on every
import); :func:`namespace_rule` applies :data:`~prism_challenge.gates.policy.NAMESPACE_ALLOW`,
:func:`origin_rule` judges a re-exported object where it was defined. The allow-list data file is
read once, when this module is imported.
"""

from __future__ import annotations

from prism_challenge.gates.allowlist import ALLOWLIST_FILE, is_allowed_path, load_allowlist
from prism_challenge.gates.determinism import determinism_rule
from prism_challenge.gates.live import live_origin
from prism_challenge.gates.policy import (
    ALLOWED_MODULES,
    ALLOWED_ROOTS,
    BLOCKED_MODULES,
    NAMESPACE_ALLOW,
    NAMESPACE_RULES,
    NOT_ALLOWED,
    NOT_LISTED,
    PRIVATE,
    SAFE_DUNDER_READS,
    TORCH_LOADS,
    TORCH_PRIVATE,
    TORCH_SAVES,
)
from prism_challenge.gates.qualnames import _private, _root

load_allowlist()  # read the data file at import: a runtime audit hook calling module_rule never opens it


def module_rule(modname: str, own: set[str]) -> tuple[str, str] | None:
    """The (rule, reason) an import of ``modname`` breaks, or ``None`` when it is allowed.

    Also judges attribute paths (``torch.nn.functional.gelu``): the deny rules first
    (:data:`BLOCKED_MODULES`, :data:`NAMESPACE_ALLOW`, private names), then, on the allowed
    modules, the allow-list (:func:`prism_challenge.gates.allowlist.is_allowed_path`,
    ``prism:not-allowlisted``)."""
    parts = modname.split(".")
    if parts[0] in own:
        return None
    for i in range(len(parts), 0, -1):
        rule = BLOCKED_MODULES.get(".".join(parts[:i]))
        if rule:
            return rule, f"module '{modname}' is blocked"
    hit = determinism_rule(modname) or namespace_rule(modname)
    if hit:
        return hit
    if any(p.startswith("_") and p not in SAFE_DUNDER_READS for p in parts[1:]):
        if parts[0] == "torch" and any(_private(p) for p in parts[1:]):
            return TORCH_PRIVATE, f"private torch module '{modname}'"
        return PRIVATE, f"private module or name '{modname}'"
    if parts[0] in ALLOWED_ROOTS or modname in ALLOWED_MODULES or _harness_path(modname):
        if is_allowed_path(modname):
            return None
        return NOT_LISTED, f"'{modname}' is not on the allow-list ({ALLOWLIST_FILE})"
    return NOT_ALLOWED, f"module '{modname}' is not on the import allowlist"


def _harness_path(qualname: str) -> bool:
    """Whether ``qualname`` is a path inside one of :data:`ALLOWED_MODULES`."""
    return any(qualname.startswith(m + ".") for m in ALLOWED_MODULES)


def namespace_rule(qualname: str) -> tuple[str, str] | None:
    """The (rule, reason) of a name outside the allow-list of its module
    (:data:`NAMESPACE_ALLOW`), or ``None``."""
    if qualname in NAMESPACE_RULES:
        return NAMESPACE_RULES[qualname]
    for prefix, (rule, allowed) in NAMESPACE_ALLOW.items():
        if qualname.startswith(prefix + "."):
            name = qualname[len(prefix) + 1 :].split(".")[0]
            if name not in allowed and not name.startswith("_"):
                return rule, f"'{prefix}.{name}' is not on the {prefix} allow-list"
    return None


def origin_rule(qualname: str) -> tuple[str, str] | None:
    """The (rule, reason) when the function or class ``qualname`` names on the trusted modules
    was defined in a blocked module or is a blocked name of an allow-listed one (a re-export:
    ``torch.utils.data.IterDataPipe`` is defined in ``torch.utils.data.datapipes``)."""
    if qualname in TORCH_LOADS or qualname in TORCH_SAVES or qualname.startswith("<"):
        return None
    origin = live_origin(qualname)
    if origin is None or _root(origin) == "builtins":  # builtins have rules of their own
        return None
    hit = namespace_rule(origin)
    if hit:
        return hit[0], f"'{qualname}' is {origin}: {hit[1]}"
    parts = origin.split(".")
    for i in range(len(parts) - 1, 0, -1):
        rule = BLOCKED_MODULES.get(".".join(parts[:i]))
        if rule:
            return rule, f"'{qualname}' is defined in the blocked module '{'.'.join(parts[:i])}'"
    return None
