"""The bundle frozen at intake: one read-only copy that every stage uses, checked after the run.

:func:`freeze` copies a bundle directory (or extracts a ``.zip``) once, through the intake rules
(:func:`prism_challenge.intake.bundle.open_bundle`, :func:`~prism_challenge.intake.readable.readable_copy`), into
a fresh temporary directory owned by the trusted side, and makes it read-only: directories
``0555``, files ``0444``. Submitted code reads it (as "other" when it runs as the sandbox uid)
but cannot write it: the sandbox binds it read-only, the audit hook refuses writes to it, and
the modes refuse the sandbox uid. The gates, the parameter child, every rank, the held-out child
and the blind probe import this copy, so the manifest's hashes (taken from it) are the hashes of
the code that ran. After the run, :meth:`FrozenBundle.changes` lists every path and content of
the copy again; a run whose copy changed fails.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from prism_challenge.intake.bundle import open_bundle
from prism_challenge.intake.readable import readable_copy
from prism_challenge.intake.refusal import IntakeLimits
from prism_challenge.scratch import remove_tree  # re-exported: frozen.remove_tree (a read-only tree)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry below ``root``, ``__pycache__`` included: ``{relative path: sha256 of a file,
    "dir" for a directory, "link"/"other" for anything else}``."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in dirnames:
            p = here / name
            out[p.relative_to(root).as_posix()] = "dir" if not p.is_symlink() else "link"
        for name in filenames:
            p = here / name
            rel = p.relative_to(root).as_posix()
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "link" if stat.S_ISLNK(st.st_mode) else "other"
    return out


@dataclass
class FrozenBundle:
    """A frozen bundle copy.

    Attributes:
        root: the copy's bundle root (what every process imports).
        holder: the temporary directory that holds it (removed by :meth:`remove`).
        source: the bundle as the user named it.
        at_intake: :func:`snapshot` of the copy when it was made.
    """

    root: Path
    holder: Path
    source: str
    at_intake: dict[str, str] = field(default_factory=dict)

    def changes(self) -> list[str]:
        """Paths added, removed or changed in the copy since intake (sorted; empty: unchanged)."""
        try:
            now = snapshot(self.root)
        except OSError as exc:
            return [f"{exc.filename or self.root}: {exc.strerror or exc}"]
        keys = set(now) | set(self.at_intake)
        return sorted(k for k in keys if now.get(k) != self.at_intake.get(k))

    def remove(self) -> None:
        """Delete the copy (:func:`prism_challenge.scratch.remove_tree`)."""
        remove_tree(self.holder)


def _seal(root: Path) -> None:
    """Make a tree read-only for everyone: directories 0555, files 0444 (deepest first)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444, follow_symlinks=False)
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o555)
    os.chmod(root, 0o555)


def freeze(path: str | os.PathLike[str], limits: IntakeLimits = IntakeLimits()) -> FrozenBundle:
    """Intake ``path`` (a bundle directory or ``.zip``) into a fresh read-only copy.

    Raises:
        prism_challenge.intake.bundle.BundleError: an intake rule is broken (nothing is left on disk).
    """
    root, holder = open_bundle(path, limits)
    if holder is None:  # a directory used in place: copy it
        root, holder = readable_copy(root, limits)
    try:
        os.chmod(holder, 0o755)
        _seal(root)
        return FrozenBundle(root, holder, str(path), snapshot(root))
    except OSError:
        FrozenBundle(root, holder, str(path)).remove()
        raise
