"""The signed run certificate: an ed25519 signature over the run manifest's canonical form.

The harness signs every manifest it writes (scored, failed, cancelled) just before writing it:

* **canonical form**: ``rfc8785.dumps(manifest without "certificate")``, the JSON
  Canonicalization Scheme of RFC 8785 (sorted keys, no whitespace, ECMAScript number
  formatting, UTF-8): the same bytes for the same JSON value, so the file's own layout (indent,
  key order) does not matter and any change of a value does;
* **signature**: Ed25519 (RFC 8032, section 5.1: PureEdDSA over edwards25519, 32-byte public
  key, 64-byte signature) by :mod:`cryptography`;
* **record** (the manifest's top-level ``certificate``)::

      {"alg": "ed25519", "canonicalization": "RFC 8785",
       "public_key": base64(raw 32-byte public key), "key_id": sha256(raw public key)[:16 hex],
       "signature": base64(64-byte signature)}

Everything else in the manifest is covered: the bundle's and the data's hashes, the revealed
``run_secret``, every audited batch's snapshot and inputs hashes, the curve and the verdict.

**Keys.** ``prism eval`` signs with the user's key, created on first use at
``platformdirs.user_config_dir("prism")/signing-key.pem`` (PKCS8 PEM, mode 0600, its folder
0700; :func:`user_key`); the service with its operator key (``PRISM_SIGNING_KEY_FILE``, or a
key it creates in its state directory). A private key file that its group or others may read is
refused (:func:`load_private_key`). ``prism verify`` trusts the keys it is named (``--key``),
the key a service publishes at ``GET /version`` (``--service``), or else the user's own.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALG = "ed25519"
CANONICALIZATION = "RFC 8785"
FIELD = "certificate"
KEY_FILE_NAME = "signing-key.pem"
KEY_ID_HEX = 16
_BASE64_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")
"""Hex characters of ``sha256(raw public key)`` in a key id (64 bits: a name, not a secret)."""


class CertificateError(ValueError):
    """A key that cannot be used, or a manifest whose certificate does not hold (the message
    names the file or the key id and the rule broken)."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_raw: bytes) -> str:
    """The first :data:`KEY_ID_HEX` hex characters of ``sha256(raw 32-byte public key)``."""
    return hashlib.sha256(public_raw).hexdigest()[:KEY_ID_HEX]


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The raw 32-byte public key (RFC 8032, 5.1.5) of ``key``, base64 (what ``--key`` and
    ``GET /version``'s ``signing_public_key`` hold)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(_raw_public(pub)).decode("ascii")


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read an ed25519 private key (PEM, PKCS8, unencrypted).

    Raises:
        CertificateError: the file is missing or unreadable, its mode lets its group or others
            read it (it must be 0600 or stricter: ``chmod 600 FILE``), or it holds no ed25519
            private key.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        raise CertificateError(f"{p}: the signing key file cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CertificateError(f"{p}: the signing key is not a regular file")
    if st.st_mode & 0o077:
        raise CertificateError(f"{p}: the signing key file has mode {stat.S_IMODE(st.st_mode):04o}; its group and "
                               f"others must have no access (chmod 600 {p})")
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CertificateError(f"{p}: not an unencrypted PEM (PKCS8) private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise CertificateError(f"{p}: the signing key must be ed25519, not {type(key).__name__}")
    return key


def create_key_file(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Create ``path`` holding a new ed25519 key (PKCS8 PEM), mode 0600, atomically: the file is
    opened with ``O_CREAT | O_EXCL``, so a file that exists is never overwritten (the key
    already there is loaded instead, by :func:`load_private_key`). The folder is made 0700 when
    it is created here.

    Raises:
        CertificateError: the folder or file cannot be made, or the existing key is unusable.
    """
    p = Path(path)
    try:
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CertificateError(f"{p.parent}: cannot create the signing key's folder ({exc.strerror})") from None
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_private_key(p)
    except OSError as exc:
        raise CertificateError(f"{p}: cannot create the signing key file ({exc.strerror})") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        p.unlink(missing_ok=True)
        raise CertificateError(f"{p}: cannot write the signing key file ({exc.strerror})") from None
    return key


def user_key_path() -> Path:
    """``platformdirs.user_config_dir("prism")/signing-key.pem`` (honours ``XDG_CONFIG_HOME``)."""
    import platformdirs

    return Path(platformdirs.user_config_dir("prism")) / KEY_FILE_NAME


def user_key() -> tuple[Ed25519PrivateKey, Path]:
    """The user's signing key and its file, created (mode 0600, folder 0700) on first use.

    Raises:
        CertificateError: see :func:`create_key_file` and :func:`load_private_key`.
    """
    path = user_key_path()
    if path.exists() or path.is_symlink():
        return load_private_key(path), path
    return create_key_file(path), path


def canonical(manifest: dict[str, Any]) -> bytes:
    """RFC 8785 canonical form of ``manifest`` without its ``certificate`` field.

    Raises:
        CertificateError: a value JSON cannot hold canonically (NaN, an integer past 2^53).
    """
    body = {k: v for k, v in manifest.items() if k != FIELD}
    try:
        return rfc8785.dumps(body)
    except rfc8785.CanonicalizationError as exc:
        raise CertificateError(f"the manifest has no RFC 8785 canonical form: {exc}") from None


def sign_manifest(manifest: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """A copy of ``manifest`` with its ``certificate`` (see the module docstring): an Ed25519
    signature (RFC 8032) over :func:`canonical`.

    Raises:
        CertificateError: the manifest has no canonical form.
    """
    raw = _raw_public(key.public_key())
    signature = key.sign(canonical(manifest))
    out = copy.deepcopy({k: v for k, v in manifest.items() if k != FIELD})
    out[FIELD] = {"alg": ALG, "canonicalization": CANONICALIZATION, "public_key": base64.b64encode(raw).decode(),
                  "key_id": key_id(raw), "signature": base64.b64encode(signature).decode()}
    return out


def parse_public_key(text: str) -> bytes:
    """A trusted public key as raw 32 bytes, from its base64 text or a PEM file (public or
    private key; a private key file is read with :func:`load_private_key`'s rules).

    Raises:
        CertificateError: neither 32 bytes of base64 nor a readable ed25519 PEM file.
    """
    p = Path(text)
    if p.is_file():
        try:
            data = p.read_bytes()
        except OSError as exc:
            raise CertificateError(f"--key {text}: cannot read the key file ({exc.strerror})") from None
        if b"PRIVATE KEY" in data:
            return _raw_public(load_private_key(p).public_key())
        try:
            pub = serialization.load_pem_public_key(data)
        except ValueError as exc:
            raise CertificateError(f"--key {text}: not a PEM public key ({exc})") from None
        if not isinstance(pub, Ed25519PublicKey):
            raise CertificateError(f"--key {text}: the key must be ed25519, not {type(pub).__name__}")
        return _raw_public(pub)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        if p.exists():
            why = "not a regular file"
        elif raw:
            why = f"its base64 decodes to {len(raw)} bytes, not 32"
        elif len(text) >= 40 and set(text) <= _BASE64_CHARS:
            why = "not valid base64: a 32-byte key is 44 characters, the last '='"
        else:
            why = "no such file"
        raise CertificateError(f"--key {text}: neither a key file nor the base64 of a raw 32-byte ed25519 public key, "
                               f"as GET /version's signing_public_key ({why})")
    return raw


def trusted_keys(trusted: list[str] | None) -> list[bytes]:
    """The raw public keys of ``trusted`` (:func:`parse_public_key`), or for ``None`` the user's
    own (:func:`user_key_path`; none when it does not exist: verifying never creates a key).

    Raises:
        CertificateError: a key that cannot be read.
    """
    if trusted is not None:
        return [parse_public_key(t) for t in trusted]
    path = user_key_path()
    return [_raw_public(load_private_key(path).public_key())] if path.exists() else []


def check_certificate(manifest: dict[str, Any], trusted: list[str] | None) -> str:
    """Check ``manifest``'s certificate; returns its key id.

    ``trusted``: the public keys to trust (base64 of the raw key, or PEM files, see
    :func:`parse_public_key`); ``None``: the user's own key (:func:`trusted_keys`), the key of
    ``prism eval`` runs.

    Raises:
        CertificateError: no certificate; an algorithm or canonicalization other than ed25519
            and RFC 8785; a key that is not one of the trusted keys ("signed by an untrusted
            key"); a signature that does not verify over the manifest's canonical form
            ("signature does not match"); a trusted key that cannot be read.
    """
    cert = manifest.get(FIELD)
    if not isinstance(cert, dict):
        raise CertificateError("certificate: the manifest is unsigned (no certificate)")
    if cert.get("alg") != ALG or cert.get("canonicalization") != CANONICALIZATION:
        raise CertificateError(f"certificate: alg {cert.get('alg')!r} and canonicalization "
                               f"{cert.get('canonicalization')!r}; expected {ALG!r} and {CANONICALIZATION!r}")
    try:
        raw = base64.b64decode(str(cert.get("public_key")), validate=True)
        signature = base64.b64decode(str(cert.get("signature")), validate=True)
    except (binascii.Error, ValueError):
        raise CertificateError("certificate: public_key or signature is not base64") from None
    kid = key_id(raw)
    if len(raw) != 32 or len(signature) != 64:
        raise CertificateError(f"certificate (key {kid}): a 32-byte public key and a 64-byte signature expected")
    if cert.get("key_id") != kid:
        raise CertificateError(f"certificate: key_id {cert.get('key_id')!r} is not its public key's ({kid})")
    keys = trusted_keys(trusted)
    if raw not in keys:
        names = ", ".join(key_id(k) for k in keys) or "none: you have no key yet; pass --key or --service"
        raise CertificateError(f"certificate: signed by an untrusted key {kid} (trusted: {names})")
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(signature, canonical(manifest))
    except InvalidSignature:
        raise CertificateError(f"certificate: the signature does not match the manifest (key {kid})") from None
    return kid
