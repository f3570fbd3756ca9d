"""``GET /health``, ``GET /version`` and ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from prism_challenge import __version__
from prism_challenge.service.watch import unowned

router = APIRouter(tags=["operations"])


@router.get("/health", summary="the database answers; whether the dispatcher runs")
def health(request: Request) -> JSONResponse:
    """200 ``{"status": "ok", ...}``; 503 ``unhealthy`` when the database does not answer, 503
    ``cannot-evaluate`` when the dispatcher cannot evaluate (``dispatch_problem`` says why: what
    it found missing at start with ``check_resources`` off, or the last attempt whose Ray lease
    ran out, until an attempt's actor starts again: :mod:`prism_challenge.service.capacity`).

    ``oldest_unowned``: the non-final submission that has been without an owner the longest
    (:func:`~prism_challenge.service.watch.unowned`: a running attempt whose heartbeat is stale,
    or a pending one while no dispatcher is live), ``{"submission", "status", "age_s"}``, or
    ``null`` when every non-final submission has an owner.
    """
    state = request.app.state
    oldest = None
    try:
        with state.store.engine.connect() as c:
            c.execute(text("SELECT 1"))
        db = "ok"
        found = unowned(state.store)
        if found:
            oldest = {"submission": found[0].submission_id, "status": found[0].status, "age_s": found[0].age_s}
    except Exception as exc:  # noqa: BLE001 - any failure of the database is "unhealthy"
        db = f"{type(exc).__name__}: {exc}"
    problem = getattr(state.dispatcher, "problem", None)
    status = "unhealthy" if db != "ok" else "cannot-evaluate" if problem else "ok"
    body = {"status": status, "database": db, "profile": state.profile.name,
            "dispatcher": "running" if state.dispatcher is not None else "off", "dispatch_problem": problem,
            "oldest_unowned": oldest}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/version", summary="the harness version and the profile evaluated under")
def version(request: Request) -> dict:
    """The package version, the API version, the challenge profile (name, version, sha256) and
    the key that signs every run manifest (``signing_public_key``: base64 of the raw ed25519
    key, ``signing_key_id``: its id; ``prism verify --service URL`` trusts it)."""
    p = request.app.state.profile
    return {"name": "prism-challenge", "version": __version__, "api": "v1",
            "profile": {"name": p.name, "version": p.version, "sha256": p.sha256}, **request.app.state.signing}


@router.get("/metrics", summary="Prometheus metrics")
def metrics(request: Request) -> Response:
    """The app's registry in the Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


__all__ = ["router"]
