"""Development keys for ``prism keygen`` and ``prism submit``: an sr25519 key in a JSON file.

The file holds the keys a Bittensor hotkey file holds (``secretSeed``, ``publicKey``,
``accountId``, ``ss58Address``, hex with ``0x``), so a miner's existing hotkey file can be used
as it is: only ``secretSeed`` (the 32-byte mini-secret) is read, and the public key and address
the file states, when present, must be the seed's. ``prism keygen`` writes it with mode 0600
and never over an existing file.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import sr25519

from prism_challenge.service.signing import ss58_encode


class KeyfileError(ValueError):
    """A key file that cannot be used (the message names the file and the field)."""


def write_keyfile(path: Path, seed: bytes | None = None) -> str:
    """Write a new key (``seed``, default 32 random bytes from :mod:`secrets`) to ``path``
    (mode 0600, created exclusively); returns its SS58 address.

    Raises:
        FileExistsError: ``path`` exists.
    """
    seed = secrets.token_bytes(32) if seed is None else seed
    public, _ = sr25519.pair_from_seed(seed)
    address = ss58_encode(public)
    doc = {"secretSeed": "0x" + seed.hex(), "publicKey": "0x" + public.hex(), "accountId": "0x" + public.hex(),
           "ss58Address": address}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.chmod(path, 0o600)  # whatever the umask did
    return address


def read_keyfile(path: Path) -> tuple[bytes, str]:
    """The 32-byte seed and SS58 address of the key in ``path``.

    Raises:
        KeyfileError: unreadable, not JSON, no valid ``secretSeed``, or a ``publicKey`` /
            ``ss58Address`` that is not the seed's.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KeyfileError(f"{path}: cannot read the key file ({exc.strerror})") from None
    except ValueError as exc:
        raise KeyfileError(f"{path}: not JSON ({exc})") from None
    raw = doc.get("secretSeed") if isinstance(doc, dict) else None
    try:
        seed = bytes.fromhex(str(raw).removeprefix("0x"))
    except ValueError:
        seed = b""
    if len(seed) != 32:
        raise KeyfileError(f"{path}: secretSeed must be 32 bytes as hex (0x...)")
    public, _ = sr25519.pair_from_seed(seed)
    address = ss58_encode(public)
    if "publicKey" in doc and str(doc["publicKey"]).removeprefix("0x").lower() != public.hex():
        raise KeyfileError(f"{path}: publicKey is not the key of secretSeed")
    if "ss58Address" in doc and doc["ss58Address"] != address:
        raise KeyfileError(f"{path}: ss58Address {doc['ss58Address']} is not {address}, the address of secretSeed")
    return seed, address


__all__ = ["KeyfileError", "read_keyfile", "write_keyfile"]
