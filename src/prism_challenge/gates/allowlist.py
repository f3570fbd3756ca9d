"""The static gate's allow-list: what a bundle may reach on the allowed modules and objects.

The list is data, ``allowlist.toml`` beside this module, in groups that each give a one-line
reason. A group lists any of:

* ``modules``: modules a bundle may import or walk through (``torch.nn.functional``); their
  attributes are allowed one by one, never wholesale;
* ``paths``: objects on those modules (``torch.nn.functional.gelu``, ``torch.optim.AdamW``,
  ``math.pi``); an attribute of a listed object is allowed when its name is under ``attrs``
  (``torch.nn.Module.train``);
* ``attrs``: attribute names a bundle may use on any object it holds (``x.view``,
  ``opt.step``, ``ctx.vocab_size``, ``"".join``), besides the names it defines itself.

The sandbox (:mod:`prism_challenge.gates.sandbox`) refuses everything else as
``prism:not-allowlisted``. How to add an entry, and what to check first: see docs/contract.md,
"The static gate's allow-list".
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

ALLOWLIST_FILE = "allowlist.toml"
"""The data file, in this package."""

NOT_ALLOWLISTED = "prism:not-allowlisted"
"""The rule id of a path or attribute name that is not on the list."""


@dataclass(frozen=True)
class Allowlist:
    """The parsed allow-list.

    Attributes:
        modules: dotted module names.
        paths: dotted object paths.
        attrs: attribute names allowed on any object.
        reasons: group name -> its one-line reason.
    """

    modules: frozenset[str]
    paths: frozenset[str]
    attrs: frozenset[str]
    reasons: dict[str, str]


def parse_allowlist(text: str) -> Allowlist:
    """Parse the TOML text of an allow-list.

    Raises:
        ValueError: a group without a one-line ``reason``, an unknown key, or an entry that is
            not a non-empty string.
    """
    data = tomllib.loads(text)
    modules: set[str] = set()
    paths: set[str] = set()
    attrs: set[str] = set()
    reasons: dict[str, str] = {}
    kinds = {"modules": modules, "paths": paths, "attrs": attrs}
    for name, group in data.get("groups", {}).items():
        reason = group.get("reason")
        if not isinstance(reason, str) or not reason.strip() or "\n" in reason:
            raise ValueError(f"allow-list group {name!r} needs a one-line reason")
        reasons[name] = reason
        for key, entries in group.items():
            if key == "reason":
                continue
            if key not in kinds:
                raise ValueError(f"allow-list group {name!r}: unknown key {key!r}")
            for entry in entries:
                if not isinstance(entry, str) or not entry or entry != entry.strip():
                    raise ValueError(f"allow-list group {name!r}: bad entry {entry!r}")
                kinds[key].add(entry)
    return Allowlist(frozenset(modules), frozenset(paths), frozenset(attrs), reasons)


@lru_cache(maxsize=1)
def load_allowlist() -> Allowlist:
    """The package's allow-list (read once)."""
    text = resources.files(__package__).joinpath(ALLOWLIST_FILE).read_text(encoding="utf-8")
    return parse_allowlist(text)


def is_allowed_attr(name: str) -> bool:
    """Whether ``name`` is an attribute name a bundle may use on any object (``view``,
    ``step``, ``vocab_size``). Names the bundle defines itself are allowed by the sandbox, not
    here."""
    return name in load_allowlist().attrs


def is_allowed_module(modname: str) -> bool:
    """Whether ``modname`` is listed under ``modules`` (every module is listed itself, its
    parent packages too; ``prism_challenge.evaluator.interface`` is the one harness module)."""
    return modname in load_allowlist().modules


@lru_cache(maxsize=8192)
def is_allowed_path(qualname: str) -> bool:
    """Whether the dotted path ``qualname`` on an allowed module is on the list.

    True for a listed module, a listed object, or a listed object followed by attribute names
    that are all allowed (:func:`is_allowed_attr`): ``torch.nn.Module.train``,
    ``itertools.chain.from_iterable``. A module's own attributes must be listed themselves:
    ``torch.ops`` is not allowed because ``torch`` is.
    """
    al = load_allowlist()
    if qualname in al.modules or qualname in al.paths:
        return True
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in al.paths:
            return all(p in al.attrs for p in parts[i:])
    return False


__all__ = [
    "ALLOWLIST_FILE",
    "NOT_ALLOWLISTED",
    "Allowlist",
    "is_allowed_attr",
    "is_allowed_module",
    "is_allowed_path",
    "load_allowlist",
    "parse_allowlist",
]
