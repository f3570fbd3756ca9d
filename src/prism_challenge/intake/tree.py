"""The intake rules on a bundle directory, and the hashes of its files.

:func:`check_tree` refuses a directory that breaks an intake rule before the gates read its
source; :func:`hash_tree` gives the sha256 of every file that will run.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from prism_challenge.intake.bundlefiles import (
    BYTECODE_DIR,
    kind_problem,
    module_name_problem,
    name_problem,
    shadow_problem,
    text_problem,
)
from prism_challenge.intake.refusal import BundleError, IntakeLimits, _check_kind, _refuse


SKIPPED_DIRS = frozenset({BYTECODE_DIR})
"""Directory names :func:`hash_tree` and the copy helpers skip; :func:`check_tree` refuses them
(``prism:bytecode``), so a bundle that passed intake has none."""


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every regular file below ``root`` (bundle-relative POSIX paths).

    ``__pycache__`` folders are skipped: they are build output, not submission.
    """
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def check_tree(root: Path, limits: IntakeLimits = IntakeLimits()) -> int:
    """Apply the intake rules to a bundle directory; return the total size of its files (bytes).

    Every file is read (never through a symlink) and must be UTF-8 text of an allowed kind (see
    :mod:`prism_challenge.intake.bundlefiles`). A ``__pycache__`` folder is refused with a hint to
    delete it (``prism:bytecode``): nothing the gates did not read lies beside the bundle's
    code. Last, the top-level module and code-folder names are checked against the modules the
    interpreter finds elsewhere (one short probe interpreter).

    Raises:
        BundleError: the first broken rule, naming the bundle-relative path: ``prism:bad-name``,
            ``prism:symlink``, ``prism:special-file``, ``prism:bytecode``, ``prism:bad-suffix``,
            ``prism:module-name``, ``prism:too-many-files``, ``prism:source-too-large``,
            ``prism:bundle-unreadable`` (a file cannot be read), ``prism:binary-file`` (a NUL
            byte), ``prism:not-utf8`` (line and byte offset named) or ``prism:shadow-module``.
    """
    total = 0
    count = 0
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for d in sorted(dirnames):
            rel = (here / d).relative_to(root).as_posix()
            _refuse(name_problem(rel))
            if (here / d).is_symlink():
                raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink")
            if d == BYTECODE_DIR:
                _refuse(kind_problem(f"{rel}/"))
        dirnames.sort()
        for name in sorted(filenames):
            p = here / name
            rel = p.relative_to(root).as_posix()
            _refuse(name_problem(rel))
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink")
            if not stat.S_ISREG(st.st_mode):
                raise BundleError(f"{rel}: not a regular file", "prism:special-file")
            _check_kind(rel)
            _refuse(module_name_problem(rel))
            count += 1
            if count > limits.max_files:
                raise BundleError(
                    f"{rel}: more than {limits.max_files} files in the bundle",
                    "prism:too-many-files",
                )
            data = _read_regular(p, rel, limits.max_source_bytes - total + 1)
            total += len(data)
            if total > limits.max_source_bytes:
                raise BundleError(
                    f"{rel}: bundle files exceed {limits.max_source_bytes} bytes in total",
                    "prism:source-too-large",
                )
            _refuse(text_problem(rel, data))
            files.append(rel)
    _refuse(shadow_problem(files, root))
    return total


def _read_regular(path: Path | str, rel: str, most: int, dir_fd: int | None = None) -> bytes:
    """The bytes of a regular file (``path`` relative to ``dir_fd`` when given), never through a
    symlink, at most ``most`` of them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink") from None
        raise BundleError(f"{rel}: cannot read ({exc.strerror or exc})", "prism:bundle-unreadable") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BundleError(f"{rel}: not a regular file", "prism:special-file")
        _check_kind(rel)
        return f.read(max(most, 0))
