"""Unpacking a submitted zip safely, at the service's intake (issue 17, item 3).

The zip rules themselves are :func:`prism_challenge.intake.ziparchive.extract_zip`'s, defined once there and
shared with ``prism eval BUNDLE.zip`` (the stdlib :mod:`zipfile` reads the archive): every member
is checked from the central directory before a byte is written (member count, declared total
size, per-member compression ratio, absolute or parent-relative names, names another extractor
would resolve outside the target, symlinks and special files, duplicates, encrypted members),
then each regular file is inflated with ``O_EXCL | O_NOFOLLOW`` while the bytes actually read
are counted against its declared size and the total (a lying header is caught while streaming).
A single top-level folder is the bundle root. Then the bundle's text-only rules of
:mod:`prism_challenge.intake.bundlefiles` apply (UTF-8 text of the bundle's kinds, no bytecode, ...).

This module gives the service one error type with a short, stable ``code`` for the HTTP answer
(:data:`CODES`), keeping the bundle rule id (``prism:zip-ratio``) as ``rule``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from prism_challenge import scratch
from prism_challenge.intake.bundle import BundleError
from prism_challenge.intake.refusal import IntakeLimits
from prism_challenge.intake.ziparchive import extract_zip

CODES = {
    "not-a-zip": ("prism:bad-zip", "prism:bundle-unreadable"),
    "zip-bomb": ("prism:zip-ratio", "prism:zip-too-large"),
    "unsafe-path": ("prism:zip-absolute-path", "prism:zip-parent-path", "prism:zip-escape", "prism:bad-name"),
    "unsafe-member": ("prism:symlink", "prism:zip-symlink", "prism:special-file"),
    "duplicate-member": ("prism:zip-duplicate",),
    "too-many-files": ("prism:too-many-files",),
    "too-large": ("prism:source-too-large",),
}
"""An :class:`ArchiveError`'s ``code`` -> the bundle rule ids it stands for. Every other rule of
the bundle's intake (a file kind, encoding, bytecode, module name, ``prism.yaml``) is code
``bad-bundle``."""

_CODE_OF = {rule: code for code, rules in CODES.items() for rule in rules}
_LIMITS = IntakeLimits()


class ArchiveError(ValueError):
    """A submitted archive refused before its source is read.

    Attributes:
        code: one of :data:`CODES`'s keys, or ``bad-bundle``.
        message: what is wrong, naming the member.
        rule: the bundle's rule id (``prism:...``).
    """

    def __init__(self, code: str, message: str, rule: str = "prism:bundle") -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.rule = code, message, rule


def extract_bundle(data: bytes, dest: Path, *, max_files: int = _LIMITS.max_files,
                   max_bytes: int = _LIMITS.max_archive_bytes, max_ratio: float = _LIMITS.max_ratio) -> Path:
    """Unpack the zip ``data`` into ``dest`` and return the bundle root (``dest`` or its single
    top-level folder).

    Args:
        data: the zip's bytes.
        dest: a folder that is absent or empty (created, mode 0755 so a sandbox's uid can read).
        max_files: most members (folders included).
        max_bytes: most uncompressed bytes in all, declared and actually inflated.
        max_ratio: largest uncompressed/compressed ratio of one member over 1 KiB.

    Raises:
        ArchiveError: see :data:`CODES`; ``dest``'s contents are removed first.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    dest.chmod(0o755)
    if any(dest.iterdir()):
        raise ValueError(f"{dest}: not an empty folder")
    limits = IntakeLimits(max_files=max_files, max_archive_bytes=max_bytes, max_ratio=max_ratio,
                          max_source_bytes=min(_LIMITS.max_source_bytes, max_bytes))
    with tempfile.TemporaryDirectory(prefix="prism-intake-", dir=scratch.root()) as tmp:
        zpath = Path(tmp) / "bundle.zip"
        zpath.write_bytes(data)
        try:
            root, _ = extract_zip(zpath, dest, limits)
        except BundleError as exc:
            for child in dest.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            message = str(exc).replace(str(zpath), "bundle.zip").replace(str(dest) + "/", "")
            raise ArchiveError(_CODE_OF.get(exc.rule, "bad-bundle"), message, exc.rule) from None
    return root


__all__ = ["ArchiveError", "CODES", "extract_bundle"]
