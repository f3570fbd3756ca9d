"""Who sent a submission: the sr25519-signed headers of ``POST /v1/submissions``, or the bearer
token and vouched hotkey of the internal gateway. Every refusal is an
:class:`~prism_challenge.service.errors.ApiError` (400 malformed, 401 refused)."""

from __future__ import annotations

import hmac
import re
import time

from fastapi import Request

from prism_challenge.service.errors import ApiError
from prism_challenge.service.signing import SS58_PREFIX, SignatureError, message, ss58_decode, verify

NONCE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""A nonce: 1 to 128 characters of ``A-Z a-z 0-9 . _ : -`` (a UUID, a counter, hex)."""
VERIFIED_HOTKEY = "X-Verified-Hotkey"


def _header(request: Request, name: str) -> str:
    value = request.headers.get(name)
    if value is None or not value.strip():
        raise ApiError(400, "missing-header", f"{name}: required header is missing", stage="auth",
                       rule="prism:signed-request")
    return value.strip()


def hotkey_header(value: str, name: str, prefix: int = SS58_PREFIX) -> str:
    """``value`` when it is an SS58 address of network ``prefix`` (400 ``bad-hotkey``
    otherwise). One network only: the same key under another prefix is another string, which
    would count as another hotkey (its own rate limit, its own leaderboard entry)."""
    try:
        _, got = ss58_decode(value)
    except SignatureError as exc:
        raise ApiError(400, "bad-hotkey", f"{name}: {exc}", stage="auth", rule="prism:ss58") from None
    if got != prefix:
        raise ApiError(400, "bad-hotkey", f"{name}: an SS58 address of network {got}; this service takes network "
                       f"{prefix} addresses", stage="auth", rule="prism:ss58")
    return value


def signed_headers(request: Request, window_s: int, prefix: int = SS58_PREFIX,
                   now: float | None = None) -> tuple[str, str, str, int]:
    """``(hotkey, signature, nonce, timestamp)`` from the headers, the timestamp checked
    against ``now`` (Unix seconds) within ``window_s``.

    Raises:
        ApiError: 400 ``missing-header``/``bad-header``/``bad-hotkey``; 401 ``stale-timestamp``.
    """
    hotkey = hotkey_header(_header(request, "X-Hotkey"), "X-Hotkey", prefix)
    signature = _header(request, "X-Signature")
    nonce = _header(request, "X-Nonce")
    if not NONCE.fullmatch(nonce):
        raise ApiError(400, "bad-header", "X-Nonce: 1 to 128 characters of A-Z a-z 0-9 . _ : -", stage="auth",
                       rule="prism:signed-request")
    raw = _header(request, "X-Timestamp")
    if not re.fullmatch(r"[0-9]{1,12}", raw):
        raise ApiError(400, "bad-header", f"X-Timestamp: {raw[:40]!r} is not Unix seconds (an integer)",
                       stage="auth", rule="prism:signed-request")
    timestamp = int(raw)
    now = time.time() if now is None else now
    if abs(now - timestamp) > window_s:
        skew = timestamp - now  # > 0: the request's clock is ahead of the service's
        raise ApiError(401, "stale-timestamp", f"X-Timestamp {timestamp} is {abs(skew):.0f} s "
                       f"{'ahead of' if skew > 0 else 'behind'} the service's clock: outside the {window_s} s window",
                       stage="auth", rule="prism:timestamp-window")
    return hotkey, signature, nonce, timestamp


def check_signature(hotkey: str, signature: str, nonce: str, timestamp: int, body_sha256: str) -> None:
    """Verify the request's signature over ``prism:{hotkey}:{nonce}:{timestamp}:{body_sha256}``.

    Raises:
        ApiError: 401 ``bad-signature``.
    """
    try:
        verify(hotkey, signature, message(hotkey, nonce, timestamp, body_sha256))
    except SignatureError as exc:
        raise ApiError(401, "bad-signature", str(exc), stage="auth", rule="prism:signature") from None


def check_token(request: Request, token: str | None) -> None:
    """The internal routes' ``Authorization: Bearer <token>`` (compared in constant time).

    Raises:
        ApiError: 401 ``unauthorized`` (no token configured, none sent, or a wrong one).
    """
    if token is None:
        raise ApiError(401, "unauthorized", "the internal routes are disabled (no internal_token is configured)",
                       stage="auth", rule="prism:internal-token")
    sent = request.headers.get("Authorization", "")
    scheme, _, value = sent.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
        raise ApiError(401, "unauthorized", "Authorization: a valid 'Bearer <internal token>' is required",
                       stage="auth", rule="prism:internal-token", headers={"WWW-Authenticate": "Bearer"})


__all__ = ["NONCE", "VERIFIED_HOTKEY", "check_signature", "check_token", "hotkey_header", "signed_headers"]
