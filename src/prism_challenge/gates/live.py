"""What an attribute path on an allowed module really is, looked up on the trusted modules.

Allowed modules carry other modules as attributes: ``torch.os`` is :mod:`os`, ``dataclasses.
builtins`` is :mod:`builtins`, ``torch.nn.functional.np`` is numpy and ``F.torch.load`` is
``torch.load``. A purely textual check of ``torch.os.system`` would let those through, so
:func:`live_name` walks the path on the real, trusted modules (importing only the allowlisted
roots, never bundle code) and returns the canonical name of what it reaches: a module's own
``__name__``, ``builtins.NAME`` for a builtin, or the serialization functions by identity.

The walk reads module ``__dict__`` entries only (no ``getattr``, so no lazy-import hooks run)
and stops at the first object that is not a module.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import sys
from functools import lru_cache
from types import BuiltinFunctionType, FunctionType, ModuleType

LIVE_ROOTS = frozenset({"torch", "math", "typing", "dataclasses", "collections", "functools", "itertools"})
"""Roots :func:`live_name` may import (the allowlisted, trusted modules)."""

LIVE_HARNESS = "prism_challenge.evaluator.interface"
"""The one harness module a bundle may import, walked as well."""

_IDENTITIES = {
    "torch": ("load", "save"),
    "torch.jit": ("load", "save"),
    "torch.export": ("load", "save"),
}


@lru_cache(maxsize=None)
def _identity_names() -> dict[int, str]:
    out = {id(v): f"builtins.{k}" for k, v in vars(builtins).items() if callable(v)}
    for mod_name, names in _IDENTITIES.items():
        mod = sys.modules.get(mod_name)
        if mod is None:
            continue
        for n in names:
            obj = vars(mod).get(n)
            if obj is not None:
                out[id(obj)] = f"{mod_name}.{n}"
    return out


def _identity(obj: object) -> str | None:
    name = _identity_names().get(id(obj))
    if name is None and "torch" in sys.modules:
        _identity_names.cache_clear()  # torch.jit / torch.export may have been imported since
        name = _identity_names().get(id(obj))
    return name


def _start(qualname: str) -> tuple[object, str, int] | None:
    parts = qualname.split(".")
    if parts[0] in LIVE_ROOTS:
        start = 1
    elif qualname == LIVE_HARNESS or qualname.startswith(LIVE_HARNESS + "."):
        start = len(LIVE_HARNESS.split("."))
    else:
        return None
    try:
        return importlib.import_module(".".join(parts[:start])), ".".join(parts[:start]), start
    except ImportError:
        return None


_MISSING = object()


def live_object(qualname: str) -> object:
    """The object ``qualname`` names on the trusted modules, or ``None`` when the path does not
    start at an allowed root (or ``builtins``) or leaves module dictionaries before its end.

    Only module ``__dict__`` entries and already-imported submodules are read: no ``getattr``,
    so nothing runs.
    """
    parts = qualname.split(".")
    if parts[0] == "builtins" and len(parts) == 2:
        return vars(builtins).get(parts[1])
    first = _start(qualname)
    if first is None:
        return None
    obj, _, i = first
    while i < len(parts):
        if not isinstance(obj, ModuleType):
            return None
        nxt = vars(obj).get(parts[i], _MISSING)
        if nxt is _MISSING:
            nxt = sys.modules.get(f"{obj.__name__}.{parts[i]}", _MISSING)
        if nxt is _MISSING:
            return None
        obj = nxt
        i += 1
    return obj


@lru_cache(maxsize=4096)
def live_origin(qualname: str) -> str | None:
    """Where the function or class ``qualname`` names was defined (``module.qualname``), when
    that differs from ``qualname``: ``torch.utils.data.IterDataPipe`` ->
    ``torch.utils.data.datapipes.datapipe.IterDataPipe``. ``None`` for anything else (modules,
    instances, unknown paths)."""
    obj = live_object(qualname)
    if not isinstance(obj, (type, FunctionType, BuiltinFunctionType)):
        return None
    try:
        mod = obj.__module__
        name = obj.__qualname__
    except AttributeError:
        return None
    if not isinstance(mod, str) or not isinstance(name, str):
        return None
    full = f"{mod}.{name}"
    return None if full == qualname else full


@lru_cache(maxsize=4096)
def live_name(qualname: str) -> str | None:
    """The canonical name of what ``qualname`` reaches on the trusted modules.

    Returns ``None`` when the path does not start at an allowed root, cannot be followed, or
    its canonical name is the path itself; otherwise the canonical name, with the part after
    the first non-module object appended unchanged (``torch.functional.torch.load`` ->
    ``torch.load``; ``torch.os.system`` -> ``os.system``; ``dataclasses.builtins.eval`` ->
    ``builtins.eval``).
    """
    parts = qualname.split(".")
    first = _start(qualname)
    if first is None:
        return None
    obj, name, start = first
    i = start
    while i < len(parts) and isinstance(obj, ModuleType):
        part = parts[i]
        d = vars(obj)
        if part in d:
            obj = d[part]
            if isinstance(obj, ModuleType):
                name = obj.__name__
            else:
                name = _identity(obj) or f"{name}.{part}"
        else:
            sub = f"{obj.__name__}.{part}"
            if sub in sys.modules:
                obj = sys.modules[sub]
                name = sub
            else:
                try:
                    spec = importlib.util.find_spec(sub)
                except Exception:  # torch.classes.x: a module whose __path__ is not a list
                    spec = None
                if spec is None:
                    return None
                name = sub
                i += 1
                break
        i += 1
    full = ".".join([name, *parts[i:]])
    return None if full == qualname else full
