"""``POST /v1/submissions`` (sr25519-signed) and ``POST /internal/v1/submissions`` (gateway).

The order of the checks, cheapest first, each answering its own code: the headers (400) and the
timestamp window (401), the body read while it streams and cut at the limit (413) or the body
timeout (408), the signature (401), the nonce (409: recorded only once the signature verified, so
a forged request cannot burn a nonce), the hotkey registry when the operator keeps one (403
``not-registered``: :mod:`prism_challenge.service.registry`), the hotkey's suspension (403
``suspended``, naming the finding and its end: :mod:`prism_challenge.service.findings`), the
admission limits (:mod:`prism_challenge.service.admission`: 429 with ``Retry-After``, 503
``queue-full``; after the nonce, so replaying a captured request cannot spend anything), then
the intake (:mod:`prism_challenge.service.intake`, off the event loop: 422 with the findings),
and, in one transaction, the duplicate check (409 with the earlier id), the admission limits
again and the new ``pending`` row (202). The limits count accepted rows only: a refused request
(a duplicate included) never counts. The bundle's bytes are stored
(:class:`~prism_challenge.service.blobs.BlobStore`) before its row, under the sha256 of the zip,
which is the row's ``bundle_sha256``: a dispatcher that sees the row finds the bytes.

The client address of the per-address limit is the connection's peer (rewritten by uvicorn's
``ProxyHeadersMiddleware`` only for a peer in ``trusted_proxies``); the gateway's route names no
client address (the gateway answers for its clients: the other limits still hold).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from datetime import timedelta

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prism_challenge.evaluator.isolation import IsolationError
from prism_challenge.service.admission import Limits, admit, client_key
from prism_challenge.service.errors import ApiError
from prism_challenge.service.families import public_families
from prism_challenge.service.intake import Intake, IntakeRefused, run_intake
from prism_challenge.service.models import utcnow
from prism_challenge.service.queries import duplicate_of, family_root, prune_nonces
from prism_challenge.service.routes.auth import (
    VERIFIED_HOTKEY,
    check_signature,
    check_token,
    hotkey_header,
    signed_headers,
)
from prism_challenge.service.store import NonceReused

router = APIRouter(tags=["submissions"])
_REGISTER = threading.Lock()  # duplicate check + insert, one at a time in this process
PRUNE_EVERY = 100
"""Nonces older than twice the signature window are deleted after every this many recorded."""
_recorded = itertools.count(1)
_ZIP_BODY = {"requestBody": {"required": True, "content": {"application/zip": {
    "schema": {"type": "string", "format": "binary"}}}}}
_SIGNED = {**_ZIP_BODY, "parameters": [
    {"name": name, "in": "header", "required": True, "schema": {"type": "string"}, "description": text}
    for name, text in (("X-Hotkey", "SS58 address"), ("X-Signature", "hex sr25519 signature of "
                       "prism:{hotkey}:{nonce}:{timestamp}:{sha256(body) hex}"), ("X-Nonce", "never reused"),
                       ("X-Timestamp", "Unix seconds"))]}
_GATEWAY = {**_ZIP_BODY, "parameters": [
    {"name": "X-Verified-Hotkey", "in": "header", "required": True, "schema": {"type": "string"}}]}


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, refused (413 ``body-too-large``) as soon as more than ``limit`` bytes
    are declared (``Content-Length``) or have arrived, before the rest is read, and (408
    ``body-timeout``) when it has not all arrived ``timeout_s`` seconds after the headers: a
    client trickling its body a byte at a time holds a connection and its buffer no longer."""
    declared = request.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    with anyio.move_on_after(timeout_s) as scope:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, partial=True)
            chunks.append(chunk)
    if scope.cancelled_caught:
        raise ApiError(408, "body-timeout", f"{size:,} bytes of the body arrived in {timeout_s:g} s: the whole body "
                       "must arrive within body_timeout_s", stage="request", rule="prism:body-timeout",
                       headers={"Connection": "close"})
    if size == 0:
        raise ApiError(400, "empty-body", "the request has no body: send the bundle's zip", stage="request",
                       rule="prism:body")
    return b"".join(chunks)


def _too_large(size: int, limit: int, partial: bool = False) -> ApiError:
    what = f"{size:,} bytes arrived so far" if partial else f"Content-Length {size:,}"
    return ApiError(413, "body-too-large", f"{what}: the limit is {limit:,} bytes", stage="request",
                    rule="prism:body-limit")


def _check_suspended(state, hotkey: str) -> None:
    """403 ``suspended`` when a finding suspends ``hotkey`` now: the finding (kind, submission,
    run, batch, figures) and the suspension's end in the message and the ``finding`` and
    ``suspended_until`` keys."""
    from prism_challenge.service import findings as fnd

    s = fnd.suspension(state.store, hotkey, state.clock(), state.settings.suspension_s)
    if not s.suspended:
        return
    until = s.until.isoformat() if s.until is not None else None
    how_long = f"until {until}" if until else "until an operator lifts it"
    raise ApiError(403, "suspended", f"{hotkey} is suspended {how_long}: {fnd.describe(s.findings[0])}; "
                   f"see GET /v1/hotkeys/{hotkey}", stage="auth", rule="prism:suspended",
                   finding=fnd.finding_view(s.findings[0]), suspended_until=until)


def _check_listed(state, hotkey: str) -> None:
    """403 ``not-registered`` when the operator keeps a hotkey registry that does not list ``hotkey``."""
    registry = state.registry
    if registry is not None and hotkey not in registry:
        raise ApiError(403, "not-registered", f"{hotkey} is not in this service's hotkey registry: only registered "
                       "hotkeys may submit (ask the operator, or register the hotkey on the chain they follow)",
                       stage="auth", rule="prism:registry")


def _admissible(state, hotkey: str, address: str | None) -> None:
    """The registry, the suspension and the admission limits (read only), before the intake."""
    _check_listed(state, hotkey)
    _check_suspended(state, hotkey)
    with state.store.sessions() as s:
        admit(s, hotkey, address, Limits.of(state.settings), utcnow())


def _address(request: Request) -> str | None:
    """The client's counted address (:func:`~prism_challenge.service.admission.client_key`)."""
    return client_key(request.client.host if request.client else None, request.app.state.settings.ipv6_prefix)


@router.post("/v1/submissions", status_code=202, summary="submit a bundle (zip body), signed by an sr25519 hotkey",
             openapi_extra=_SIGNED)
async def submit(request: Request) -> JSONResponse:
    """Headers ``X-Hotkey`` (SS58), ``X-Signature`` (hex sr25519 over
    ``prism:{hotkey}:{nonce}:{timestamp}:{sha256(body)}``), ``X-Nonce``, ``X-Timestamp`` (Unix s)."""
    settings = request.app.state.settings
    hotkey, signature, nonce, timestamp = signed_headers(request, settings.signature_window_s, settings.ss58_prefix)
    body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    check_signature(hotkey, signature, nonce, timestamp, hashlib.sha256(body).hexdigest())
    await anyio.to_thread.run_sync(_use_nonce, request.app.state.store, hotkey, nonce, timestamp,
                                   settings.signature_window_s)  # database writes: off the event loop
    address = _address(request)
    await anyio.to_thread.run_sync(_admissible, request.app.state, hotkey, address)  # after the nonce: a replay
    return await _accept(request, hotkey, body, address)  # spends nothing


def _use_nonce(store, hotkey: str, nonce: str, timestamp: int, window_s: int) -> None:
    """Record the nonce (409 ``nonce-reused`` when the hotkey used it); every
    :data:`PRUNE_EVERY` nonces, delete those older than twice the window."""
    try:
        store.use_nonce(hotkey, nonce, timestamp)
    except NonceReused as exc:
        raise ApiError(409, "nonce-reused", str(exc), stage="auth", rule="prism:nonce") from None
    if next(_recorded) % PRUNE_EVERY == 0:
        prune_nonces(store, utcnow() - timedelta(seconds=2 * window_s))


@router.post("/internal/v1/submissions", status_code=202, summary="submit for a hotkey a trusted gateway verified",
             openapi_extra=_GATEWAY)
async def submit_internal(request: Request) -> JSONResponse:
    """``Authorization: Bearer <internal token>`` and ``X-Verified-Hotkey`` (SS58)."""
    settings = request.app.state.settings
    check_token(request, settings.internal_token.get_secret_value() if settings.internal_token else None)
    raw = request.headers.get(VERIFIED_HOTKEY, "").strip()
    if not raw:
        raise ApiError(400, "missing-header", f"{VERIFIED_HOTKEY}: required header is missing", stage="auth",
                       rule="prism:internal-token")
    hotkey = hotkey_header(raw, VERIFIED_HOTKEY, settings.ss58_prefix)
    body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    await anyio.to_thread.run_sync(_admissible, request.app.state, hotkey, None)
    return await _accept(request, hotkey, body, None)


async def _accept(request: Request, hotkey: str, body: bytes, address: str | None) -> JSONResponse:
    state = request.app.state
    t0 = time.monotonic()
    try:
        intake: Intake = await anyio.to_thread.run_sync(run_intake, body, state.settings, state.profile,
                                                        limiter=state.intake_limiter)
    except IntakeRefused as exc:
        raise ApiError(422, exc.code, exc.message, stage=exc.stage, rule=exc.rule, findings=exc.findings) from None
    except IsolationError as exc:  # intake_parameter_check on a host without strict isolation: ours, not theirs
        raise ApiError(503, "isolation-unavailable", f"the intake's parameter check cannot run here: {exc}",
                       stage="service", rule="prism:isolation") from None
    finally:
        state.metrics.intake_seconds.observe(time.monotonic() - t0)
    sid, variant_of = await anyio.to_thread.run_sync(_register, state, hotkey, body, intake, address)
    state.metrics.intake.labels("accepted").inc()
    if state.dispatcher is not None and hasattr(state.dispatcher, "wake"):
        state.dispatcher.wake()  # claimed now, not at the end of an idle dispatcher's poll
    return JSONResponse(status_code=202, content={
        "id": sid, "status": "pending", "hotkey": hotkey, "profile": state.profile.name,
        "bundle_sha256": hashlib.sha256(body).hexdigest(), "source_sha256": intake.source_sha256,
        "family_sha256": intake.family_sha256, "variant_of": variant_of, "findings": intake.findings,
    })


def _register(state, hotkey: str, body: bytes, intake: Intake, address: str | None) -> tuple[int, int | None]:
    """Store the bytes, then the row (a duplicate refused, then the admission limits checked in
    the row's transaction); returns ``(id, variant_of)``."""
    profile, limits = state.profile.name, Limits.of(state.settings)
    with _REGISTER:
        earlier = duplicate_of(state.store, intake.source_sha256, profile)
        if earlier is not None:
            raise ApiError(409, "duplicate", f"the same normalized source as submission {earlier} (comments, "
                           "docstrings and layout aside)", stage="intake", rule="prism:duplicate",
                           duplicate_of=earlier)
        public = public_families(tuple(state.settings.public_architectures))
        variant_of = None if intake.family_sha256 in public else family_root(state.store, intake.family_sha256, profile)
        with state.store.sessions() as s:  # this process's last word before the bytes are kept (no orphan blob)
            admit(s, hotkey, address, limits, utcnow())
        sha = state.blobs.put(body)
        sid = state.store.submit(hotkey, sha, max_attempts=state.settings.max_attempts,
                                 source_sha256=intake.source_sha256, family_sha256=intake.family_sha256,
                                 variant_of=variant_of, profile=profile, client_address=address,
                                 admit=lambda s: admit(s, hotkey, address, limits, utcnow(), lock=True))
    return sid, variant_of


__all__ = ["read_body", "router"]
