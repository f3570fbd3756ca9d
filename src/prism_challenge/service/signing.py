"""Request signatures: sr25519 hotkeys named by SS58 addresses (issue 17, item 3).

The signed message is the reference implementation's::

    prism:{hotkey}:{nonce}:{timestamp}:{sha256(body) hex}

(UTF-8), signed with the hotkey's sr25519 key under the signing context ``b"substrate"`` (the
one of ``py-sr25519-bindings``, ``substrate-interface`` and polkadot.js), and sent as 64 bytes
hex (``0x`` optional) in ``X-Signature``. As ``substrate-interface``'s ``Keypair.verify`` does, a
signature over the message wrapped in ``<Bytes>...</Bytes>`` (what polkadot.js's ``signRaw``
signs) is accepted too.

SS58 (https://docs.substrate.io/reference/address-formats/): base58 of
``prefix || public key (32 bytes) || checksum``, the checksum being the first 2 bytes of
BLAKE2b-512 over ``b"SS58PRE" || prefix || public key``; a one-byte prefix for network ids
0..63 (42 is the generic Substrate network, whose addresses start with ``5``), two bytes for
64..16383 only: a two-byte prefix below 64 is refused, so each key has exactly one address per
network (base58 of given bytes is unique), and a hotkey string names one identity.
"""

from __future__ import annotations

import hashlib
import re

import base58
import sr25519

SS58_PREFIX = 42
_CONTEXT = b"SS58PRE"
_HEX = re.compile(r"(0x)?[0-9a-fA-F]{128}")
WRAP = (b"<Bytes>", b"</Bytes>")
IDENTITY = bytes(32)
"""The compressed Ristretto255 identity (RFC 9496). As a public key A = 0, the Schnorr check
``s*B == R + k*A`` holds for R = s*B and any message, and ``sr25519.verify`` accepts it; so
:func:`ss58_decode` refuses its addresses (Ristretto's encoding is canonical and its group has
prime order: no other encoding of it and no other small-order key exist)."""


class SignatureError(ValueError):
    """A request whose hotkey, signature or fields cannot be verified (the message says which)."""


def ss58_decode(address: str) -> tuple[bytes, int]:
    """The 32-byte public key and the network prefix of an SS58 address.

    Raises:
        SignatureError: not base58, a length that is no account id, a reserved or non-canonical
            (two-byte, below 64) prefix, a bad checksum, or the identity key (:data:`IDENTITY`).
    """
    try:
        raw = base58.b58decode(address.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise SignatureError(f"hotkey {address!r}: not a base58 SS58 address") from None
    if len(raw) == 35:
        plen, prefix = 1, raw[0]
        if prefix > 63:
            raise SignatureError(f"hotkey {address!r}: SS58 prefix byte {prefix} is reserved")
    elif len(raw) == 36 and raw[0] & 0b0100_0000:
        plen = 2
        prefix = ((raw[0] & 0b0011_1111) << 2) | (raw[1] >> 6) | ((raw[1] & 0b0011_1111) << 8)
        if prefix < 64:  # the one-byte form's networks: a second string for one key and network
            raise SignatureError(f"hotkey {address!r}: a two-byte SS58 prefix {prefix} (two bytes are for "
                                 "networks 64..16383 only; write it with the one-byte prefix)")
    else:
        raise SignatureError(f"hotkey {address!r}: {len(raw)} bytes decoded, not an SS58 account id (35 or 36)")
    body, checksum = raw[:-2], raw[-2:]
    if hashlib.blake2b(_CONTEXT + body, digest_size=64).digest()[:2] != checksum:
        raise SignatureError(f"hotkey {address!r}: bad SS58 checksum")
    if body[plen:] == IDENTITY:
        raise SignatureError(f"hotkey {address!r}: the identity public key (32 zero bytes), for which anyone "
                             "can forge a signature: not a hotkey")
    return bytes(body[plen:]), prefix


def ss58_encode(public_key: bytes, prefix: int = SS58_PREFIX) -> str:
    """The SS58 address of a 32-byte public key under network ``prefix`` (0..16383).

    Raises:
        ValueError: a key that is not 32 bytes, or a prefix out of range.
    """
    if len(public_key) != 32:
        raise ValueError(f"a public key is 32 bytes, not {len(public_key)}")
    if 0 <= prefix <= 63:
        head = bytes([prefix])
    elif prefix <= 16383:
        head = bytes([((prefix & 0b1111_1100) >> 2) | 0b0100_0000, (prefix >> 8) | ((prefix & 0b11) << 6)])
    else:
        raise ValueError(f"SS58 prefix {prefix}: must be in 0..16383")
    body = head + public_key
    return base58.b58encode(body + hashlib.blake2b(_CONTEXT + body, digest_size=64).digest()[:2]).decode()


def message(hotkey: str, nonce: str, timestamp: int | str, body_sha256: str) -> bytes:
    """``prism:{hotkey}:{nonce}:{timestamp}:{body_sha256}`` as UTF-8 bytes."""
    return f"prism:{hotkey}:{nonce}:{timestamp}:{body_sha256}".encode()


def verify(hotkey: str, signature_hex: str, signed: bytes) -> None:
    """Check that ``signature_hex`` is ``hotkey``'s sr25519 signature of ``signed`` (or of it
    wrapped in ``<Bytes>``).

    Raises:
        SignatureError: a malformed hotkey or signature, or a signature that does not verify.
    """
    public, _ = ss58_decode(hotkey)
    if not isinstance(signature_hex, str) or not _HEX.fullmatch(signature_hex):
        raise SignatureError("X-Signature: must be 64 bytes as hex (128 hex digits, 0x optional)")
    signature = bytes.fromhex(signature_hex.removeprefix("0x"))
    for data in (signed, WRAP[0] + signed + WRAP[1]):
        if sr25519.verify(signature, data, public):
            return
    raise SignatureError(f"X-Signature: not a valid sr25519 signature by {hotkey} of the request")


def sign(seed: bytes, signed: bytes) -> str:
    """The hex sr25519 signature of ``signed`` by the key of the 32-byte ``seed`` (``0x``-prefixed)."""
    public, secret = sr25519.pair_from_seed(seed)
    return "0x" + sr25519.sign((public, secret), signed).hex()


def sign_request(seed: bytes, nonce: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The four headers of a signed submission of ``body`` by the key of ``seed``:
    ``X-Hotkey``, ``X-Signature``, ``X-Nonce``, ``X-Timestamp``."""
    public, _ = sr25519.pair_from_seed(seed)
    hotkey = ss58_encode(public)
    sig = sign(seed, message(hotkey, nonce, timestamp, hashlib.sha256(body).hexdigest()))
    return {"X-Hotkey": hotkey, "X-Signature": sig, "X-Nonce": nonce, "X-Timestamp": str(timestamp)}


__all__ = ["IDENTITY", "SS58_PREFIX", "SignatureError", "message", "sign", "sign_request", "ss58_decode", "ss58_encode",
           "verify"]
