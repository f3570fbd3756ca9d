"""The secret-salted train / val / test partition, and the salt file that keys it.

Each document's split is a pure function of a secret salt (32 random bytes) and the document's
``id``: the first 8 bytes of ``HMAC-SHA256(salt, id as UTF-8)``, read as a big-endian integer
``u`` in ``[0, 2**64)``, fall in

* ``train`` when ``u < 2**64 * 95 / 100``,
* ``val``   when ``u < 2**64 * 975 / 1000``,
* ``test``  otherwise,

so the buckets hold 95 / 2.5 / 2.5 % of the documents. Without the salt, nobody can tell which
public documents are held out; with it, anyone can recompute the partition. The data MANIFEST
records only the salt's commitment ``sha256(salt bytes)``.

The salt file is 64 lowercase hex digits and a newline, created with mode 0600. It lives outside
the data directory (default: ``DIR.salt`` beside ``DIR``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from prism_challenge.data.manifest import DataError

SALT_BYTES = 32
SPLITS = ("train", "val", "test")
TRAIN_LIMIT = (1 << 64) * 95 // 100
VAL_LIMIT = (1 << 64) * 975 // 1000
PARTITION_METHOD = "hmac-sha256(salt, utf8(id))[:8] as big-endian u64: train < 0.95*2^64 <= val < 0.975*2^64 <= test"


def split_key(salt: bytes, doc_id: str) -> int:
    """The partition key of ``doc_id``: the first 8 bytes of HMAC-SHA256(salt, id) as a u64."""
    return int.from_bytes(hmac.new(salt, doc_id.encode("utf-8"), hashlib.sha256).digest()[:8], "big")


def split_of_key(key: int) -> str:
    """The split (``train``, ``val`` or ``test``) of a partition key from :func:`split_key`."""
    if key < TRAIN_LIMIT:
        return "train"
    if key < VAL_LIMIT:
        return "val"
    return "test"


def split_of(salt: bytes, doc_id: str) -> str:
    """The split of document ``doc_id`` under ``salt``: ``train`` (95 %), ``val`` or ``test``."""
    return split_of_key(split_key(salt, doc_id))


def salt_commitment(salt: bytes) -> str:
    """Hex sha256 of the salt bytes: what the MANIFEST records instead of the salt."""
    return hashlib.sha256(salt).hexdigest()


def new_salt() -> bytes:
    """32 fresh random bytes from the operating system's CSPRNG."""
    return secrets.token_bytes(SALT_BYTES)


def default_salt_path(out: Path) -> Path:
    """Default salt file of data directory ``out``: the sibling ``<out>.salt``."""
    out = Path(out)
    return out.parent / f"{out.name}.salt"


def parse_salt(text: str, origin: str = "salt") -> bytes:
    """Decode a salt written as 64 hex digits (surrounding whitespace ignored).

    Raises:
        DataError: not exactly 64 hex digits (``origin`` names where it came from).
    """
    s = text.strip()
    try:
        salt = bytes.fromhex(s)
    except ValueError:
        salt = b""
    if len(salt) != SALT_BYTES or len(s) != 2 * SALT_BYTES:
        raise DataError(f"{origin}: a salt must be {2 * SALT_BYTES} hex digits")
    return salt


def read_salt_file(path: Path) -> bytes:
    """Read a salt file.

    Raises:
        DataError: the file cannot be read or does not hold 64 hex digits.
    """
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read salt file ({exc})") from None
    return parse_salt(text, str(path))


def write_salt_file(path: Path, salt: bytes) -> None:
    """Create the salt file ``path`` (mode 0600, never overwriting an existing file).

    Written to a temporary sibling first and linked into place, so the file is never seen
    half-written.

    Raises:
        DataError: ``path`` already exists or cannot be written.
    """
    path = Path(path)
    if len(salt) != SALT_BYTES:
        raise DataError(f"a salt must be {SALT_BYTES} bytes, got {len(salt)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(salt.hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)  # in case the umask or filesystem widened it
            try:
                os.link(tmp, path)  # fails if path exists: never replace a salt
            except FileExistsError:
                raise
            except OSError:  # a filesystem without hard links
                if path.exists():
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except FileExistsError:
        raise DataError(f"{path}: salt file already exists") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot write salt file ({exc})") from None


def load_or_create_salt(path: Path) -> tuple[bytes, bool]:
    """The salt in ``path`` if the file exists, else a new salt written there (mode 0600).

    Returns:
        ``(salt, created)``.

    Raises:
        DataError: an existing file is not a valid salt, or a new one cannot be written.
    """
    path = Path(path)
    if path.exists():
        return read_salt_file(path), False
    salt = new_salt()
    write_salt_file(path, salt)
    return salt, True
