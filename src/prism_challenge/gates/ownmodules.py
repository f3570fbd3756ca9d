"""Which ``.py`` files are the bundle's own modules, and ``prism:not-a-package``.

The bundle's root goes first on ``sys.path`` when it runs. Its own modules are the ``.py`` files
at the root and the ``.py`` files inside packages whose every folder, from the root down, holds an
``__init__.py``. A folder without ``__init__.py`` is not a package: Python would import it as a
namespace package, whose portions merge with same-named folders anywhere on ``sys.path``, so the
gate could not know what such an import loads. Its files are not indexed, and an import that
reaches into it (or an entrypoint inside it) is a ``prism:not-a-package`` finding.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable

from prism_challenge.gates.astindex import BundleIndex
from prism_challenge.gates.findings import Finding
from prism_challenge.gates.scopes import absolute_module

RULE = "prism:not-a-package"


def folders(files: Iterable[str]) -> set[str]:
    """Every folder (bundle-relative POSIX path) that holds one of ``files``, at any depth."""
    out: set[str] = set()
    for rel in files:
        parts = rel.split("/")[:-1]
        out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def loose_folder(rel: str, files: Collection[str]) -> str | None:
    """The first folder on the path of bundle file ``rel`` that has no ``__init__.py`` among
    ``files`` (``None`` when ``rel`` is at the root or inside a package)."""
    parts = rel.split("/")[:-1]
    for i in range(len(parts)):
        folder = "/".join(parts[: i + 1])
        if f"{folder}/__init__.py" not in files:
            return folder
    return None


def is_own_module(rel: str, files: Collection[str]) -> bool:
    """Whether the bundle's ``.py`` file ``rel`` is one of its own modules (see module doc)."""
    return rel.endswith(".py") and loose_folder(rel, files) is None


def _message(folder: str) -> str:
    return (
        f"'{folder.replace('/', '.')}' is the bundle folder {folder}/, which has no __init__.py: "
        f"a folder without __init__.py is not a package of the bundle (add {folder}/__init__.py)"
    )


def _loose_prefix(modname: str, files: Collection[str], dirs: Collection[str]) -> str | None:
    """The bundle folder without ``__init__.py`` that importing ``modname`` goes through, if any.

    Walks the dotted path as Python does from the bundle root: a module file ends the walk (it
    is own, or the import fails), a package continues it, a folder without ``__init__.py`` is
    the answer, anything else is not the bundle's.
    """
    parts = [p for p in modname.split(".") if p]
    for i in range(len(parts)):
        path = "/".join(parts[: i + 1])
        if f"{path}/__init__.py" in files:
            continue
        if f"{path}.py" in files or path not in dirs:
            return None
        return path
    return None


def with_not_a_package(findings: list[Finding], index: BundleIndex, files: Collection[str],
                       entrypoints: Iterable[tuple[str, str]]) -> list[Finding]:
    """``findings`` plus the ``prism:not-a-package`` findings: each import in the bundle's own
    modules that reaches into a bundle folder without ``__init__.py``, and each entrypoint file
    inside one. They replace the sandbox's generic ``prism:import-not-allowed`` at an import
    statement whose every target is in such a folder (refused either way; this says why).

    Args:
        findings: the findings so far (the sandbox's among them).
        index: the bundle's own modules.
        files: every bundle-relative file path.
        entrypoints: ``(file, what)`` pairs (``("net/arch.py", "architecture")``).
    """
    found, loose_only = _scan(index, files, entrypoints)
    kept = [f for f in findings if not (f.rule == "prism:import-not-allowed" and (f.file, f.line, f.col) in loose_only)]
    return kept + found


def _scan(index: BundleIndex, files: Collection[str], entrypoints: Iterable[tuple[str, str]]
          ) -> tuple[list[Finding], set[tuple[str, int, int]]]:
    dirs = folders(files)
    loose_only: set[tuple[str, int, int]] = set()
    out: list[Finding] = []
    for file, what in entrypoints:
        folder = loose_folder(file, files)
        if folder is not None:
            out.append(Finding(RULE, "prism.yaml", 0, 0, f"the {what} entrypoint {file}: {_message(folder)}"))
    for info in sorted(index.modules.values(), key=lambda m: m.rel):
        for node in info.walk():
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = absolute_module(node, info)
                targets = [base] + [f"{base}.{a.name}" for a in node.names if a.name != "*"]
            else:
                continue
            line, col = info.position(node)
            loose = {t: _loose_prefix(t, files, dirs) for t in targets}
            hit = next(((t, f) for t, f in loose.items() if f is not None), None)
            if hit is None:
                continue
            out.append(Finding(RULE, info.rel, line, col, f"import of '{hit[0]}': {_message(hit[1])}"))
            heads = [alias.name for alias in node.names] if isinstance(node, ast.Import) else targets[:1]
            if all(loose[t] is not None for t in heads):
                loose_only.add((info.rel, line, col))
    return out, loose_only
