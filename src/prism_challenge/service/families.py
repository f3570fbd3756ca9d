"""Architecture families (issue 17, item 3): which submissions share a model's code.

A family is the model's code: the architecture file (``prism.yaml``'s ``architecture``
entrypoint) and every bundle module it imports, directly or through another bundle module
(its *closure*, :func:`architecture_closure`). Without the closure, a one-line
``architecture.py`` that imports its model from ``model.py`` would make every bundle with the
same stub one family (whoever sent the stub first would be the "author" of unrelated models),
and any author could leave their family by moving the model to another file.

:func:`family_sha256`: for a closure of the architecture file alone, the sha256 of its
normalized source (:func:`~prism_challenge.service.intake.normalized_python`); otherwise the
sha256 over the sorted lines ``path NUL sha256(normalized) LF`` of the closure, the
architecture file's path written as the empty string (its location is not part of the family;
the other modules' paths are, since imports name them).

Public families (:func:`public_families`): those of the architectures the project ships.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path, PurePosixPath


def _candidates(module: str) -> list[str]:
    """Bundle-relative files that may hold ``module`` (dotted) or its packages."""
    parts = module.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        stem = "/".join(parts[:i])
        out += [f"{stem}.py", f"{stem}/__init__.py"]
    return out


def _imported(tree: ast.Module, rel: str) -> list[str]:
    """The dotted names ``tree`` (the file ``rel``) imports, relative imports resolved against
    its package, ``from m import n`` giving both ``m`` and ``m.n`` (``n`` may be a module)."""
    package = list(PurePosixPath(rel).parent.parts)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package[:len(package) - (node.level - 1)] if node.level - 1 <= len(package) else None
                if up is None:
                    continue
                base = ".".join([*up, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            if base:
                names.append(base)
            names += [f"{base}.{a.name}" if base else a.name for a in node.names if a.name != "*"]
    return names


def architecture_closure(root: Path, architecture_file: str) -> list[str]:
    """The architecture file and every bundle ``.py`` file it imports, transitively (sorted,
    bundle-relative POSIX paths). A name that is no file of the bundle (``torch``) is ignored.

    Raises:
        SyntaxError, ValueError, RecursionError: a file cannot be parsed (the gates refuse it first).
    """
    root = Path(root)
    seen, todo = set(), [architecture_file]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        tree = ast.parse((root / rel).read_text(encoding="utf-8-sig"), filename=rel)
        for name in _imported(tree, rel):
            todo += [c for c in _candidates(name) if c not in seen and (root / c).is_file()]
    return sorted(seen)


def family_sha256(root: Path, architecture_file: str) -> str:
    """The family of the bundle at ``root`` whose architecture entrypoint is in
    ``architecture_file`` (see the module's docstring).

    Raises:
        prism_challenge.service.intake.IntakeRefused: a file of the closure cannot be normalized.
    """
    from prism_challenge.service.intake import normalized_python

    root = Path(root)
    try:
        files = architecture_closure(root, architecture_file)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        files = [architecture_file]  # normalized_python below refuses the file with its name
    normalized = {rel: normalized_python((root / rel).read_text(encoding="utf-8-sig"), rel) for rel in files}
    if files == [architecture_file]:
        return hashlib.sha256(normalized[architecture_file].encode()).hexdigest()
    h = hashlib.sha256()
    for rel in sorted(files, key=lambda r: "" if r == architecture_file else r):
        name = "" if rel == architecture_file else rel
        h.update(f"{name}\0{hashlib.sha256(normalized[rel].encode()).hexdigest()}\n".encode())
    return h.hexdigest()


SHIPPED_ARCHITECTURES = (Path(__file__).resolve().parents[1] / "templates" / "bundle" / "architecture.py.tmpl",
                         *sorted((Path(__file__).resolve().parents[3] / "examples").glob("*/architecture.py")))
"""The architectures the project publishes: ``prism init``'s template and, in a source checkout,
``examples/*/architecture.py``. Their families are public (:func:`public_families`)."""


@functools.lru_cache(maxsize=8)
def public_families(extra: tuple[Path, ...] = ()) -> frozenset[str]:
    """The :func:`family_sha256` of :data:`SHIPPED_ARCHITECTURES` and of ``extra`` (the
    settings' ``public_architectures``, each with its folder's modules). A bundle of a public
    family is nobody's training variant and makes nobody its author: otherwise the first to
    submit the stock architecture would be the "architecture author" of every later bundle that
    only changes its training, and take ``family_share`` of the weights for code they did not write.

    Raises:
        OSError: an ``extra`` file cannot be read.
        prism_challenge.service.intake.IntakeRefused: an ``extra`` file is not valid Python.
    """
    return frozenset(family_sha256(path.parent, path.name) for path in (*SHIPPED_ARCHITECTURES, *extra))


__all__ = ["SHIPPED_ARCHITECTURES", "architecture_closure", "family_sha256", "public_families"]
