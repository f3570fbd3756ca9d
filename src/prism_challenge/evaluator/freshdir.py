"""Empty writable folders between two children of the submission.

The children that run the submission after the stream (the audit's re-scoring and blind probe,
the held-out scoring and its blind probe) all see ``ctx.artifacts_dir`` at the run's path, an
empty writable folder (the same string as the ranks'). A folder two of them share is a channel:
a child shown a batch's true rows can leave them there for the child that must not see them (the
``relay`` red-team bundle: every blind probe passed on a model that peeks at every target). So
each such child starts with the folder emptied, and no two of them run at the same time.
"""

from __future__ import annotations

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
