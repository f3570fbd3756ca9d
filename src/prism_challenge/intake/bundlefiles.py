"""What a bundle may hold: text files of the kinds the bundle format names, and module names
that the interpreter cannot import from anywhere else.

Each check returns ``None`` or a :data:`Problem`, ``(rule id, one-line message naming the
file)``; the intake rules (:mod:`~prism_challenge.intake.tree`, :mod:`~prism_challenge.intake.ziparchive`)
raise it as a ``BundleError`` (an intake refusal, :mod:`~prism_challenge.intake.refusal`).

* kinds (:func:`kind_problem`): ``.py``, ``.md``, ``.txt`` files and ``prism.yaml``;
  ``__pycache__`` folders and ``.pyc`` files are refused with a hint (``prism:bytecode``); a
  ``.py`` path must be made of identifiers (``prism:module-name``);
* content (:func:`text_problem`): UTF-8 without NUL bytes;
* names (:func:`name_problem`): every path valid UTF-8 without control characters;
* shadowing (:func:`shadow_problem`): no top-level module or code folder named like a module the
  interpreter finds elsewhere (standard library, installed packages, namespace packages).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import unicodedata
from collections.abc import Iterable
from pathlib import PurePosixPath

Problem = tuple[str, str]
"""(rule id, message): a broken intake rule."""

ALLOWED_SUFFIXES = frozenset({".py", ".md", ".txt"})
"""File suffixes a bundle may hold (compared in lower case), besides :data:`SPEC_NAMES`."""

SPEC_NAMES = frozenset({"prism.yaml"})
"""File names allowed whatever :data:`ALLOWED_SUFFIXES` says: the bundle's spec."""

BYTECODE_DIR = "__pycache__"

BYTECODE_HINT = (
    "bytecode is not accepted, a bundle is source only: delete the __pycache__ folders "
    "(find BUNDLE -name __pycache__ -prune -exec rm -r {} +; PYTHONDONTWRITEBYTECODE=1 stops "
    "Python writing them)"
)

_KINDS = "a bundle holds only .py, .md and .txt files and prism.yaml"

PROBE_TIMEOUT_S = 30.0

# run by a fresh interpreter of this environment (-P: no script or current directory on its
# path, cwd "/"): which names it finds, from every finder it has, once the bundle is off its path
_PROBE = r"""
import importlib.util, json, os, sys
req = json.load(sys.stdin)
root = os.path.realpath(req["root"])
def keep(p):
    r = os.path.realpath(p) if p else ""
    return bool(p) and r != root and not r.startswith(root + os.sep)
sys.path[:] = [p for p in sys.path if keep(p)]
out = {}
for name in req["names"]:
    try:
        spec = importlib.util.find_spec(name)
    except Exception as exc:
        out[name] = "a module this interpreter cannot look up (%s)" % type(exc).__name__
        continue
    if spec is None:
        continue
    if spec.loader is None or spec.origin in (None, "namespace"):
        out[name] = "the installed namespace package '%s'" % name
    elif spec.submodule_search_locations is not None:
        out[name] = "the installed package '%s'" % name
    else:
        out[name] = "the installed module '%s'" % name
print(json.dumps(out))
"""


def shown(rel: str) -> str:
    """``rel`` fit for a one-line message: as is when printable, else its ``repr``."""
    return rel if rel.isprintable() else repr(rel)


def name_problem(rel: str) -> Problem | None:
    """``prism:bad-name`` when a bundle path is not valid UTF-8 or holds a control character."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "prism:bad-name", f"{shown(rel)}: the name is not valid UTF-8"
    if not rel.isprintable():
        return "prism:bad-name", f"{shown(rel)}: the name holds a control or unprintable character"
    return None


def kind_problem(rel: str) -> Problem | None:
    """The rule a file at bundle-relative ``rel`` breaks by its name alone, or ``None``.

    ``prism:bytecode`` for anything in a ``__pycache__`` folder or a ``.pyc``/``.pyo`` file;
    ``prism:bad-suffix`` for any other kind than :data:`ALLOWED_SUFFIXES` and
    :data:`SPEC_NAMES` (``prism.yml`` is refused with a hint: only ``prism.yaml`` is read).
    """
    path = PurePosixPath(rel)
    suffix = path.suffix.lower()
    if BYTECODE_DIR in path.parts or suffix in (".pyc", ".pyo"):
        return "prism:bytecode", f"{rel}: {BYTECODE_HINT}"
    if path.name in SPEC_NAMES or suffix in ALLOWED_SUFFIXES:
        return None
    if path.name == "prism.yml":
        return "prism:bad-suffix", f"{rel}: PRISM reads its spec only from prism.yaml; rename the file"
    return "prism:bad-suffix", f"{rel}: file kind {suffix or '(no suffix)'!r} is not allowed: {_KINDS}"


def module_name_problem(rel: str) -> Problem | None:
    """``prism:module-name`` when the bundle-relative ``.py`` path ``rel`` is not an importable
    module path (every folder and the file's stem a Python identifier in NFKC form, the form
    the parser gives an imported name, so the gate's module names are what imports look up),
    else ``None``."""
    if not rel.endswith(".py"):
        return None
    parts = rel[: -len(".py")].split("/")
    bad = [p for p in parts if not p.isidentifier() or unicodedata.normalize("NFKC", p) != p]
    if bad:
        return "prism:module-name", (
            f"{rel}: not an importable module path ({bad[0]!r} is not a Python identifier in NFKC "
            "form): rename it, e.g. with underscores"
        )
    return None


def text_problem(rel: str, data: bytes) -> Problem | None:
    """``prism:binary-file`` for a NUL byte, ``prism:not-utf8`` for bytes that are not UTF-8
    (the line and byte offset named), else ``None``."""
    nul = data.find(b"\0")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        return "prism:binary-file", (
            f"{rel} line {line}: NUL byte at byte offset {nul}: a bundle holds text files only"
        )
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        return "prism:not-utf8", (
            f"{rel} line {line}: not valid UTF-8 at byte offset {exc.start} "
            f"(byte 0x{data[exc.start]:02x}: {exc.reason}): a bundle holds UTF-8 text only"
        )
    return None


def top_level_names(rels: Iterable[str]) -> dict[str, str]:
    """Import names a bundle puts at the top of ``sys.path``: each top-level ``.py`` file's
    stem and each top-level folder that holds a ``.py`` file at any depth, mapped to how to
    name it (``json.py``, ``numpy/``). Names that are not identifiers are left out (no import
    statement can reach them; :func:`module_name_problem` refuses them as modules)."""
    out: dict[str, str] = {}
    for rel in sorted(rels):
        if not rel.endswith(".py"):
            continue
        first, sep, _ = rel.partition("/")
        name = first if sep else first[: -len(".py")]
        if name.isidentifier() and name != "__init__":
            out.setdefault(name, f"{first}/" if sep else first)
    return out


def importable_elsewhere(names: Iterable[str], root: str | os.PathLike[str]) -> dict[str, str]:
    """Which of ``names`` the interpreter can import without the bundle at ``root``.

    Standard-library and built-in names and ``__main__`` are answered here; the rest by a fresh
    interpreter of this environment (``sys.executable -P`` from ``/``: no script or current
    directory on its path, every entry inside ``root`` removed), which asks each of its finders
    (``importlib.util.find_spec``: regular and namespace packages on its path, editable-install
    finders). The answer does not depend on the caller's current directory or ``sys.path``.

    Returns:
        name -> what it would shadow (``"the standard library module 'json'"``), for the names
        found; a name the interpreter failed to look up counts as found.

    Raises:
        OSError: the probe interpreter could not be run, or timed out, or answered nonsense
            (``subprocess.SubprocessError`` and ``ValueError`` are turned into it).
    """
    out: dict[str, str] = {}
    rest = []
    for name in sorted(set(names)):
        if name in sys.stdlib_module_names or name in sys.builtin_module_names:
            out[name] = f"the standard library module '{name}'"
        elif name == "__main__":
            out[name] = "the running program's main module '__main__'"
        else:
            rest.append(name)
    if rest:
        env = tuple(os.environ.get(k) for k in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONNOUSERSITE"))
        out.update(_probe(tuple(rest), os.path.realpath(root), sys.executable, env))
    return out


@functools.lru_cache(maxsize=64)  # a run takes its bundle in twice (eval, then the gates)
def _probe(names: tuple[str, ...], root: str, executable: str, env: tuple) -> dict[str, str]:
    """The fresh interpreter's answer for ``names`` (``env``: the variables that shape its path,
    part of the cache key only)."""
    request = json.dumps({"root": root, "names": list(names)})
    try:
        res = subprocess.run([executable, "-P", "-c", _PROBE], input=request, capture_output=True,
                             text=True, timeout=PROBE_TIMEOUT_S, cwd="/", check=True)
        found = json.loads(res.stdout)
    except (subprocess.SubprocessError, ValueError) as exc:
        raise OSError(f"the module-name probe failed ({type(exc).__name__})") from None
    if not isinstance(found, dict):
        raise OSError("the module-name probe answered no mapping")
    return {str(k): str(v) for k, v in found.items() if k in names}


def shadow_problem(rels: Iterable[str], root: str | os.PathLike[str]) -> Problem | None:
    """``prism:shadow-module`` for the first top-level bundle module or code folder (see
    :func:`top_level_names`) named like a module the interpreter finds elsewhere (see
    :func:`importable_elsewhere`), else ``None``. A probe that cannot run refuses the bundle
    with the same rule (fail closed)."""
    names = top_level_names(rels)
    if not names:
        return None
    try:
        found = importable_elsewhere(names, root)
    except OSError as exc:
        return "prism:shadow-module", f"cannot check the bundle's module names: {exc}"
    for name, where in sorted(names.items()):
        if name in found:
            what = "bundle folder" if where.endswith("/") else "bundle module"
            return "prism:shadow-module", (
                f"{where}: the {what} '{name}' clashes with {found[name]} "
                f"(an import of '{name}' could load either): rename it"
            )
    return None
