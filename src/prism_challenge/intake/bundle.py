"""Bundle intake: locate a submission's two scripts and hash what will run.

A bundle is a directory (or a ``.zip`` of one, see :func:`extract_zip`) holding ``architecture.py`` (exposing ``build_model(ctx)``) and
``training.py`` (exposing ``train(ctx)``). An optional ``prism.yaml`` may declare::

    architecture:
      entrypoint: architecture.py:build_model   # or a mapping {file:, symbol:}
    training:
      entrypoint: training.py:train
    tokenizer: gpt2                              # or "bytes"
    scoring_autocast: bf16                       # or "fp16", "fp32" (no autocast); default: the profile's

Declared names are honoured exactly. The two entrypoints must be distinct files.

Intake rules (:func:`~prism_challenge.intake.tree.check_tree`,
:func:`~prism_challenge.intake.ziparchive.extract_zip`) refuse a bundle before the gates read
its source: only UTF-8 text files of the bundle's kinds (``.py``, ``.md``, ``.txt``,
``prism.yaml``; no NUL byte, no ``__pycache__``: see :mod:`prism_challenge.intake.bundlefiles`), ``.py``
paths made of identifiers, no top-level module or code folder named like a module importable
from elsewhere, no symlinks or special files, a cap on member count and on total source size,
and for archives no absolute or parent-relative member names, nothing resolving outside the
target, no duplicates and no zip bombs. A refusal is a :class:`BundleError` whose ``rule`` is a
stable id such as ``prism:zip-symlink``.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from prism_challenge.intake.readable import private_path, readable_copy
from prism_challenge.intake.refusal import BundleError, IntakeLimits
from prism_challenge.intake.spec import (  # SCORING_AUTOCAST: re-exported for profiles/, whose bytes are frozen
    DEFAULT_SCORING_AUTOCAST,
    SCORING_AUTOCAST,
    Entrypoint,
    read_spec_full,
)
from prism_challenge.intake.tree import check_tree, hash_tree
from prism_challenge.intake.ziparchive import extract_zip

__all__ = ["Bundle", "BundleError", "NOT_A_BUNDLE", "SCORING_AUTOCAST", "load_bundle", "open_bundle"]


@dataclass(frozen=True)
class Bundle:
    """A located bundle: its root, entrypoints, tokenizer and the sha256 of every file.

    ``file_hashes`` maps each bundle-relative path to its sha256 hex digest; ``sha256`` is the
    digest of the sorted ``path\\0digest\\n`` lines, so it changes when any file changes.
    """

    root: Path
    architecture: Entrypoint
    training: Entrypoint
    tokenizer: str
    file_hashes: dict[str, str] = field(default_factory=dict)
    scoring_autocast: str | None = DEFAULT_SCORING_AUTOCAST  # None: not declared (the profile's applies)

    @property
    def sha256(self) -> str:
        """Digest of the whole bundle (hex), from the per-file digests."""
        h = hashlib.sha256()
        for rel in sorted(self.file_hashes):
            h.update(f"{rel}\0{self.file_hashes[rel]}\n".encode())
        return h.hexdigest()


NOT_A_BUNDLE = "a bundle is a directory or a .zip holding architecture.py and training.py"
"""What a bundle is, for the message that refuses a path that is not one."""


def open_bundle(
    path: str | os.PathLike[str],
    limits: IntakeLimits = IntakeLimits(),
    *,
    readable_by_others: bool = False,
) -> tuple[Path, Path | None]:
    """Intake a bundle directory or ``.zip``: apply the intake rules and return its root.

    Args:
        path: the bundle directory or ``.zip`` file.
        limits: intake limits.
        readable_by_others: the bundle must be readable by users other than its owner (a
            sandbox that runs as its own uid): a directory bundle that is not (see
            :func:`private_path`) is evaluated from a :func:`readable_copy`. Zip bundles are
            always extracted world-readable.

    Returns:
        (bundle root, extraction directory or ``None`` for a directory bundle used in place).
        For a zip (or a copied directory) the extraction directory is a fresh temporary
        directory owned by the caller, who removes it (``shutil.rmtree``) when done with it.

    Raises:
        BundleError: ``prism:bundle-unreadable`` when the path is neither a directory nor a
            file, or is a file that is neither a zip nor named ``.zip`` (the message says what
            a bundle is, see :data:`NOT_A_BUNDLE`); ``prism:bad-zip`` for a ``.zip`` file
            that is not a valid zip; or the broken intake rule (see :func:`check_tree` and
            :func:`extract_zip`).
    """
    p = Path(path)
    if p.is_dir():
        root = p.resolve()
        check_tree(root, limits)
        if readable_by_others and private_path(root) is not None:
            return readable_copy(root, limits)
        return root, None
    if p.is_file():
        if p.suffix.lower() != ".zip" and not zipfile.is_zipfile(p):
            raise BundleError(f"{path}: not a bundle: {NOT_A_BUNDLE}", "prism:bundle-unreadable")
        return extract_zip(p, None, limits)
    if p.exists():  # a device, a FIFO, a socket
        raise BundleError(f"{path}: not a bundle (not a regular file or a directory): {NOT_A_BUNDLE}",
                          "prism:bundle-unreadable")
    raise BundleError(f"{path}: no such bundle directory or .zip file", "prism:bundle-unreadable")


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Locate a bundle directory and check that both entrypoint files exist.

    Raises:
        BundleError: the path is not a directory (``prism:bundle-unreadable``), ``prism.yaml``
            is malformed (``prism:spec``), or an entrypoint file is missing
            (``prism:missing-entrypoint``, the file is named).
    """
    root = Path(path).resolve()
    if not root.is_dir():
        raise BundleError(f"{path}: not a bundle directory", "prism:bundle-unreadable")
    arch, train, tokenizer, autocast = read_spec_full(root)
    for ep, what in ((arch, "architecture"), (train, "training")):
        if not (root / ep.file).is_file():
            raise BundleError(
                f"{ep.file}: missing {what} entrypoint file in bundle {root}",
                "prism:missing-entrypoint",
            )
    return Bundle(root, arch, train, tokenizer, hash_tree(root), autocast)
