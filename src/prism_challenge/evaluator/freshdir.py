"""Empty writable folders between two children of the submission.

The children that run the submission after the stream (the audit's re-scoring and blind probe,
the held-out scoring and its blind probe) all see ``ctx.artifacts_dir`` at the run's path, an
empty writable folder (the same string as the ranks'). A folder two of them share is a channel:
a child shown a batch's true rows can leave them there for the child that must not see them (the
``relay`` red-team bundle: every blind probe passed on a model that peeks at every target). So
each such child starts with the folder emptied, and no two of them run at the same time. The
folder's own metadata is a channel too (red team 9: a child stored the rows in the folder's
extended attributes, which deleting its entries keeps): it is reset as well, to nothing a child
chose (:func:`scrub_folder`). So is its size: ext4 never shrinks a directory, so a child that made
many entries leaves the emptied folder larger (4,096 bytes per block of names), which the next
child can read with ``os.stat``; such a folder is replaced by a new one (:func:`renew_if_grown`),
and a spare started on the old one is then not fed (:meth:`~prism_challenge.evaluator.jail.Jail.run`
compares the folder's inode).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterable


def empty_folders(folders: Iterable[str | os.PathLike[str]]) -> None:
    """Delete everything inside each folder (links are removed, never followed), then reset the
    folder's own metadata (:func:`scrub_folder`). The folder stays, unless it grew
    (:func:`renew_if_grown`: a new one replaces it). A folder that does not exist is skipped.

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
        renew_if_grown(folder)
        scrub_folder(folder)


FOLDER_MODE = 0o700  # the sandbox's own mode for a writable folder (isolation._chown_for)


def renew_if_grown(folder: str | os.PathLike[str]) -> bool:
    """Replace an empty ``folder`` by a new one at the same path (same owner and group, mode
    :data:`FOLDER_MODE`) when its own size differs from that of a folder just made beside it: a
    directory that held many entries keeps its blocks on ext4 once they are deleted. The new
    folder is made while the old one exists and renamed over it, so its inode number differs
    (a folder removed and made again can get the same number back, and a spare bound to the
    old one must not pass :meth:`~prism_challenge.evaluator.jail.Jail.run`'s check). Returns
    whether it was replaced.

    Raises:
        OSError: the folder is not empty, or a folder cannot be made, given its owner or renamed.
    """
    st = os.stat(folder, follow_symlinks=False)
    new = tempfile.mkdtemp(prefix=".fresh-", dir=os.path.dirname(os.path.abspath(folder)))
    try:
        if os.stat(new).st_size == st.st_size:
            return False
        os.chmod(new, FOLDER_MODE)
        os.chown(new, st.st_uid, st.st_gid)
        os.rename(new, folder)  # over the empty old folder, in one step
        return True
    finally:
        if os.path.isdir(new):
            os.rmdir(new)


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
