"""The service's error answers: every refusal is ``{"error": {"code", "message", "stage", "rule"}}``.

:class:`ApiError` is raised by the routes; :func:`install` adds the exception handlers that turn
it, FastAPI's request validation errors and Starlette's HTTP errors (an unknown route, a wrong
method) into that body, so no malformed request gets FastAPI's default shapes, and an
unexpected exception gets a 500 with code ``internal`` (logged, no traceback in the answer).

Stages: ``request`` (the HTTP request itself: route, parameters, headers, body size), ``auth``
(signature, timestamp, nonce, token, rate limit), ``intake`` (the archive and the bundle's
files, duplicates) and ``gates`` (the static gates' findings).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("prism.service")


class ApiError(Exception):
    """An answer with an error body.

    Args:
        status: the HTTP status (4xx for every bad input).
        code: a short stable id (``bad-signature``, ``zip-bomb``, ``not-found``).
        message: what is wrong, naming the header, field, file or line.
        stage: see the module's docstring.
        rule: the rule id (``prism:...``), or ``None``.
        headers: extra response headers (``Retry-After``).
        extra: more keys of the ``error`` object (``findings``, ``duplicate_of``).
    """

    def __init__(self, status: int, code: str, message: str, *, stage: str = "request", rule: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.stage, self.rule = status, code, message, stage, rule
        self.headers, self.extra = headers or {}, extra

    def body(self) -> dict:
        """The JSON body: ``{"error": {"code", "message", "stage", "rule", ...extra}}``."""
        return {"error": {"code": self.code, "message": self.message, "stage": self.stage, "rule": self.rule,
                          **self.extra}}

    def response(self) -> JSONResponse:
        """The answer as a :class:`JSONResponse`."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_HTTP_CODES = {404: "not-found", 405: "method-not-allowed", 401: "unauthorized", 413: "body-too-large"}


def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = exc.errors()
    first = problems[0] if problems else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))
    return ApiError(422 if not where.startswith(("path", "query", "header")) else 400, "invalid-request", message,
                    rule="prism:request").response()


def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = _HTTP_CODES.get(exc.status_code, f"http-{exc.status_code}")
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"{request.method} {request.url.path}: no such route"
    return ApiError(exc.status_code, code, detail, rule="prism:request",
                    headers=dict(exc.headers or {})).response()


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s: unexpected error", request.method, request.url.path)
    return ApiError(500, "internal", f"{type(exc).__name__}: the service failed (see its log)",
                    stage="service").response()


def install(app: FastAPI) -> None:
    """Add the handlers of :class:`ApiError`, validation errors, HTTP errors and the rest."""
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)


__all__ = ["ApiError", "install"]
