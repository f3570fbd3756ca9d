"""A private bundle directory made readable by a sandbox that runs as its own uid.

:func:`private_path` finds the first path other users cannot read; :func:`readable_copy` copies
the bundle, once, into a world-readable temporary directory (same paths and bytes, so the same
sha256).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from prism_challenge import scratch
from prism_challenge.intake.refusal import BundleError, IntakeLimits
from prism_challenge.intake.tree import SKIPPED_DIRS, _read_regular, check_tree


_OTHER_DIR = stat.S_IROTH | stat.S_IXOTH


def private_path(root: str | os.PathLike[str]) -> str | None:
    """The first path of a bundle directory that users other than its owner cannot read.

    A directory needs ``o+rx`` (list and enter), a file ``o+r``; ``__pycache__`` is skipped
    (bytecode is never imported). A sandbox that runs as its own unprivileged uid reads the
    bundle with exactly these "other" bits.

    Returns:
        the bundle-relative POSIX path (``"."`` for the directory itself), or ``None`` when
        everything is readable by others.
    """
    base = Path(root)
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        here = Path(dirpath)
        rel = here.relative_to(base).as_posix()
        if here.stat().st_mode & _OTHER_DIR != _OTHER_DIR:
            return rel
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            st = (here / name).lstat()
            if stat.S_ISREG(st.st_mode) and not st.st_mode & stat.S_IROTH:
                return (here / name).relative_to(base).as_posix()
    return None


def readable_copy(
    root: str | os.PathLike[str], limits: IntakeLimits = IntakeLimits()
) -> tuple[Path, Path]:
    """Copy a bundle directory, once, into a fresh world-readable temporary directory.

    For a sandbox that runs as its own uid (PRISM as root) when the bundle is private (see
    :func:`private_path`): directories are made 0755 and files 0644, the bundle-relative paths
    and contents are kept (so the bundle's sha256 is unchanged) and the copy keeps the folder's
    name. Files are read with ``O_NOFOLLOW`` and the intake limits hold while copying; the copy
    is checked again with :func:`check_tree`.

    Returns:
        (root of the copy, temporary directory): the caller owns the temporary directory and
        removes it (``shutil.rmtree``) when done with the bundle.

    Raises:
        BundleError: an intake rule (``prism:symlink``, ``prism:special-file``,
            ``prism:too-many-files``, ``prism:source-too-large``, ...) or
            ``prism:bundle-unreadable`` when a file cannot be read; nothing is left on disk.
    """
    src = Path(root)
    out = scratch.mkdtemp("prism-bundle-")
    try:
        out.chmod(0o755)
        dest = out / (src.name or "bundle")
        dest.mkdir()
        dest.chmod(0o755)
        count = total = 0
        # os.fwalk holds each directory open and opens its entries relative to it, checking that
        # a subdirectory it enters is the one it listed: a directory of the bundle swapped for a
        # symlink while this (root) process copies cannot redirect a read outside the bundle
        for dirpath, dirnames, filenames, dirfd in os.fwalk(src, follow_symlinks=False):
            here = Path(dirpath)
            there = dest / here.relative_to(src)
            kept = []
            for d in sorted(dirnames):
                if d in SKIPPED_DIRS:
                    continue
                if stat.S_ISLNK(os.stat(d, dir_fd=dirfd, follow_symlinks=False).st_mode):
                    rel = (here / d).relative_to(src).as_posix()
                    raise BundleError(f"{rel}: symlinks are not allowed in a bundle", "prism:symlink")
                (there / d).mkdir()
                (there / d).chmod(0o755)
                kept.append(d)
            dirnames[:] = kept
            for name in sorted(filenames):
                rel = (here / name).relative_to(src).as_posix()
                count += 1
                if count > limits.max_files:
                    raise BundleError(
                        f"{rel}: more than {limits.max_files} files in the bundle", "prism:too-many-files"
                    )
                data = _read_regular(name, rel, limits.max_source_bytes - total + 1, dir_fd=dirfd)
                total += len(data)
                if total > limits.max_source_bytes:
                    raise BundleError(
                        f"{rel}: bundle files exceed {limits.max_source_bytes} bytes in total",
                        "prism:source-too-large",
                    )
                fd = os.open(there / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), 0o644)
                    f.write(data)
        check_tree(dest, limits)
        return dest, out
    except BundleError:
        shutil.rmtree(out, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(out, ignore_errors=True)
        where = exc.filename or src
        raise BundleError(
            f"{where}: cannot copy the bundle ({exc.strerror or exc})", "prism:bundle-unreadable"
        ) from None
