"""Content-addressed storage of bundle bytes on disk (issue 17, item 2).

A blob is stored once under its SHA-256 (hex, lower case) at ``root/ab/cd/<sha>``: the first two
and the next two hex digits name two levels of folders, so no folder grows past 65,536 entries.
A write goes to a temporary file in the blob's own folder, is flushed and fsynced, then renamed
into place with :func:`os.replace` (atomic on POSIX): a reader never sees a partial blob, and two
writers of the same bytes both succeed. Every read checks the hash again.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

_SHA = re.compile(r"[0-9a-f]{64}")


class BlobCorrupt(RuntimeError):
    """A stored blob whose bytes no longer hash to its name (disk corruption or tampering)."""


def default_root() -> Path:
    """``<platformdirs user_data_dir('prism-challenge')>/blobs`` (on Linux ``$XDG_DATA_HOME`` or
    ``~/.local/share``, then ``prism-challenge/blobs``)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("prism-challenge")) / "blobs"


class BlobStore:
    """Bytes on disk by SHA-256.

    Args:
        root: the folder of the blobs (created on first write); ``None``: :func:`default_root`.
    """

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_root()

    def path(self, sha256: str) -> Path:
        """Where the blob ``sha256`` lives: ``root/ab/cd/<sha256>``.

        Raises:
            ValueError: ``sha256`` is not 64 lower-case hex digits.
        """
        if not isinstance(sha256, str) or not _SHA.fullmatch(sha256):
            raise ValueError(f"{sha256!r}: a blob is named by 64 lower-case hex digits (SHA-256)")
        return self.root / sha256[:2] / sha256[2:4] / sha256

    def put(self, data: bytes) -> str:
        """Store ``data`` (idempotent); returns its SHA-256 hex."""
        sha = hashlib.sha256(data).hexdigest()
        dest = self.path(sha)
        if dest.is_file():
            return sha
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-", suffix=f"-{sha[:8]}")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return sha

    def get(self, sha256: str) -> bytes:
        """The bytes of blob ``sha256``.

        Raises:
            KeyError: no such blob (the message names the hash).
            BlobCorrupt: the stored bytes hash to something else.
            ValueError: ``sha256`` is not a SHA-256 hex name.
        """
        try:
            data = self.path(sha256).read_bytes()
        except FileNotFoundError:
            raise KeyError(f"blob {sha256}: not in {self.root}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise BlobCorrupt(f"blob {sha256} at {self.path(sha256)}: its bytes hash to {actual}")
        return data

    def __contains__(self, sha256: object) -> bool:
        return isinstance(sha256, str) and bool(_SHA.fullmatch(sha256)) and self.path(sha256).is_file()


__all__ = ["BlobCorrupt", "BlobStore", "default_root"]
