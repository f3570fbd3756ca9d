"""Small helpers on qualified names shared by the sandbox's checks.

The root and private parts of a dotted name, what a name on the trusted modules is when looked
up on the real modules (a module, one of the classes the harness calls, a tensor subclass or a
metaclass; :mod:`prism_challenge.gates.live`), and how a finding names what an expression is.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from types import ModuleType

from prism_challenge.gates.astindex import CTX, TYPE
from prism_challenge.gates.live import live_object


def _root(q: str) -> str:
    return q.split(".")[0]


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))



@lru_cache(maxsize=4096)
def _is_live_module(q: str) -> bool:
    return isinstance(live_object(q), ModuleType)


@lru_cache(maxsize=4096)
def _harness_class(q: str) -> bool:
    """Whether ``q`` names ``torch.Tensor``, ``torch.nn.Module`` or ``torch.nn.Parameter``."""
    if q.startswith("<") or _root(q) != "torch":
        return False
    torch = sys.modules.get("torch")
    obj = live_object(q)
    return torch is not None and isinstance(obj, type) and obj in (torch.Tensor, torch.nn.Module, torch.nn.Parameter)


@lru_cache(maxsize=4096)
def _live_class_kind(q: str) -> str | None:
    """``"tensor"`` when ``q`` names a ``torch.Tensor`` subclass on the trusted modules,
    ``"meta"`` when it names ``type`` or a metaclass, else ``None``."""
    if q.startswith("<"):
        return None
    obj = live_object(q)
    if not isinstance(obj, type):
        return None
    if issubclass(obj, type):
        return "meta"
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(obj, torch.Tensor):
        return "tensor"
    return None


def _describe(qs: frozenset[str]) -> str:
    named = sorted(q for q in qs if not q.startswith("<"))
    if CTX in qs or any(q.startswith(CTX + ".") for q in qs):
        return "the context (ctx)"
    if TYPE in qs:
        return "a type (type(x))"
    return f"'{min(named, key=len)}'" if named else "an imported object"
