"""Empty writable folders between two children of the submission.

The children that run the submission after the stream (the audit's re-scoring and blind probe,
the held-out scoring and its blind probe) all see ``ctx.artifacts_dir`` at the run's path, an
empty writable folder (the same string as the ranks'). A folder two of them share is a channel:
a child shown a batch's true rows can leave them there for the child that must not see them (the
``relay`` red-team bundle: every blind probe passed on a model that peeks at every target). So
each such child starts with the folder emptied, and no two of them run at the same time. The
folder's own metadata is a channel too (red team 9: a child stored the rows in the folder's
extended attributes, which deleting its entries keeps): it is reset as well, to nothing a child
chose (:func:`scrub_folder`).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable


def empty_folders(folders: Iterable[str | os.PathLike[str]]) -> None:
    """Delete everything inside each folder (the folder itself stays; links are removed, never
    followed). A folder that does not exist is skipped.

    Raises:
        OSError: an entry cannot be removed (a child could then read what another left).
    """
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        scrub_folder(folder)


FOLDER_MODE = 0o700  # the sandbox's own mode for a writable folder (isolation._chown_for)


def scrub_folder(folder: str | os.PathLike[str]) -> None:
    """Reset a folder's own metadata: every extended attribute removed (``user.*``, POSIX ACLs:
    all a child without capabilities can set; ``security.*`` needs capabilities it lacks and is
    left), mode :data:`FOLDER_MODE`, access and modification times 0. Its owner is the harness's
    choice already; its change time becomes now.

    Raises:
        OSError: an attribute, the mode or the times cannot be reset.
    """
    try:
        names = os.listxattr(folder, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        names = []
    for name in names:
        if not name.startswith("security."):
            os.removexattr(folder, name, follow_symlinks=False)
    os.chmod(folder, FOLDER_MODE)
    os.utime(folder, ns=(0, 0), follow_symlinks=False)
