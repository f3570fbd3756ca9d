"""The challenge service's application: :func:`create_app` (issue 17, item 2).

``app.state`` holds what the routes share: ``settings`` (:class:`ServiceSettings`), ``profile``
(the loaded challenge profile every submission is evaluated under), ``store`` (the database,
migrated when the app is made), ``blobs`` (the bundles' bytes), ``registry`` (the listed
hotkeys, :class:`~prism_challenge.service.registry.HotkeyRegistry`, or ``None``),
``intake_limiter`` (intakes at once, off the event loop), ``metrics``, ``plots`` (the pages'
rendered curves), ``dispatcher`` (the Ray dispatcher while it runs, else ``None``) and ``clock``
(the current UTC time, ``models.utcnow``: when suspensions end; tests set their own).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi_offline import FastAPIOffline

from prism_challenge import __version__
from prism_challenge.profiles import load_profile
from prism_challenge.service import errors
from prism_challenge.service.blobs import BlobStore
from prism_challenge.service.metrics import ServiceMetrics, method_label
from prism_challenge.service.models import utcnow
from prism_challenge.service.registry import HotkeyRegistry
from prism_challenge.service.routes import ops, pages, read, submit
from prism_challenge.service.settings import ServiceSettings, publish_key
from prism_challenge.service.slowclients import header_timeout_protocol
from prism_challenge.service.store import Store
from prism_challenge.score.verdict import Policy

log = logging.getLogger("prism.service")
INTAKES_AT_ONCE = max(1, min(4, (os.cpu_count() or 2) // 2))
"""Intakes (unpack, gates, hashes: CPU work in threads) run at once; the rest wait their turn."""
DISPATCH_MODULE = "prism_challenge.service.dispatch"


def check_dispatcher(settings: ServiceSettings) -> None:
    """Refuse settings whose dispatcher cannot start, before the server does (``prism serve``
    says so in one line instead of uvicorn's traceback of a failed startup).

    Raises:
        RuntimeError: ``dispatch`` is on and :data:`DISPATCH_MODULE` is not installed.
    """
    if settings.dispatch and importlib.util.find_spec(DISPATCH_MODULE) is None:
        raise RuntimeError(f"the Ray dispatcher ({DISPATCH_MODULE}) is not installed, so this service could "
                           "accept submissions but never evaluate them; run with --no-dispatch "
                           "(PRISM_DISPATCH=false) to serve intake and reading only")


def start_dispatcher(app: FastAPI) -> None:
    """The hook where the Ray dispatcher starts (``settings.dispatch``): it sets
    ``app.state.dispatcher`` to an object whose ``stop()`` the lifespan calls at shutdown.

    Raises:
        RuntimeError: ``dispatch`` is on and :data:`DISPATCH_MODULE` is not installed (a service
            that accepted submissions it never evaluates would lose them silently).
    """
    check_dispatcher(app.state.settings)
    module = importlib.import_module(DISPATCH_MODULE)
    app.state.dispatcher = module.start(app.state)  # the lead wires the dispatcher's interface here


def preload_gate_imports() -> threading.Thread:
    """Import, in a daemon thread, what the intake's first static gate run would import itself:
    torch (the sandbox gate checks the live origin of each imported name, which imports its
    module). The first submission after start then waits about 0.3 s, not 4-6 s
    (``bench/service_e2e.py``, cold). Nothing of a submission runs here. Returns the thread."""
    def run() -> None:
        with contextlib.suppress(Exception):  # a missing or broken torch: the gates report it themselves
            importlib.import_module("torch")

    thread = threading.Thread(target=run, name="prism-preload", daemon=True)
    thread.start()
    return thread


def stop_dispatcher(app: FastAPI) -> None:
    """Stop the dispatcher if one runs (its ``stop()``), and forget it."""
    dispatcher, app.state.dispatcher = app.state.dispatcher, None
    if dispatcher is not None:
        dispatcher.stop()


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    """The FastAPI app of the service; its database is opened and migrated here.

    Raises:
        prism_challenge.profiles.ProfileError: the settings' profile cannot be loaded.
        sqlalchemy.exc.ArgumentError: a malformed database URL.
    """
    settings = settings or ServiceSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        preload_gate_imports()
        if settings.dispatch and app.state.dispatcher is None:  # prism serve starts it before the server
            start_dispatcher(app)
        log.info("prism service %s: profile %s (%s), database %s", __version__, app.state.profile.name,
                 app.state.profile.sha256[:12], app.state.store.url)
        try:
            yield
        finally:
            stop_dispatcher(app)
            app.state.store.close()

    # /docs and /redoc: Swagger UI and ReDoc served from the fastapi-offline package's own copies
    # (under /static-offline-docs), never a CDN, so they render on a host with no internet
    app = FastAPIOffline(title="PRISM challenge service", version=__version__, lifespan=lifespan,
                  description="Signed submissions, the same gates at intake, evaluation under one profile, "
                              "a leaderboard and weights.")
    profile = load_profile(settings.profile)
    store = Store(settings.database_url)
    app.state.settings, app.state.profile, app.state.store = settings, profile, store
    app.state.blobs = BlobStore(settings.blob_root)
    app.state.registry = (HotkeyRegistry(settings.hotkey_registry, settings.ss58_prefix,
                                         settings.hotkey_registry_refresh_s)
                          if settings.hotkey_registry is not None else None)
    app.state.intake_limiter = anyio.CapacityLimiter(INTAKES_AT_ONCE)
    app.state.metrics = ServiceMetrics(store, profile.name)
    app.state.dispatcher = None
    app.state.plots = OrderedDict()  # routes/pages.py: rendered curve PNGs by run id
    app.state.clock = utcnow  # service/findings.py: when a timed suspension ends
    app.state.significance_p = profile.options.get("policy", Policy()).significance_p  # the crown rule's level
    app.state.signing = publish_key(settings)  # routes/ops.py: GET /version; the pages' header
    errors.install(app)
    app.add_exception_handler(errors.ApiError, _counted)
    for module in (submit, read, ops, pages):
        app.include_router(module.router)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        app.state.metrics.requests.labels(method_label(request.method), getattr(route, "path", "unmatched"),
                                          str(response.status_code)).inc()
        return response

    if settings.trusted_proxies:  # the client a trusted proxy names; never a header of anyone else
        from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=list(settings.trusted_proxies))
    return app


def server_config(app: FastAPI, settings: ServiceSettings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn configuration of the service: ``settings``' host and port,
    ``limit_concurrency = settings.max_connections`` (past it, uvicorn answers 503 before the
    app reads a byte, so at most that many bodies are buffered at once), the slow-client limits
    (``keep_alive_s``, ``max_header_bytes``, ``header_timeout_s``:
    :mod:`~prism_challenge.service.slowclients`), and uvicorn's own forwarded-header handling
    off (it trusts 127.0.0.1 by default: the app adds it for ``trusted_proxies`` only).
    ``overrides`` are more :class:`uvicorn.Config` arguments (``log_level``, a test's ``port=0``)."""
    given = {"host": settings.host, "port": settings.port, "limit_concurrency": settings.max_connections,
             "log_level": "info", "proxy_headers": False, "timeout_keep_alive": settings.keep_alive_s,
             "h11_max_incomplete_event_size": settings.max_header_bytes,
             "http": header_timeout_protocol(settings.header_timeout_s), **overrides}
    return uvicorn.Config(app, **given)


class Server(uvicorn.Server):
    """uvicorn's server, where SIGTERM (systemd's, Docker's, Kubernetes' stop) and SIGINT are
    both a clean stop: uvicorn's own handlers stop it (the lifespan ends: the dispatcher and its
    Ray stop), and the signal is then not raised again (uvicorn re-raises it after the
    shutdown, which the default SIGTERM handler, or Ray's, turns into a death or a traceback).
    ``stopped_by``: the signal numbers that stopped it, in order."""

    stopped_by: list[int]

    @contextlib.contextmanager
    def capture_signals(self):
        self.stopped_by = []
        with super().capture_signals():
            try:
                yield
            finally:
                self.stopped_by = list(self._captured_signals)
                self._captured_signals.clear()


def _counted(request: Request, exc: errors.ApiError):
    """:class:`ApiError`'s answer, a refused submission counted by its code first."""
    if request.method == "POST" and request.url.path.endswith("/submissions"):
        request.app.state.metrics.intake.labels(exc.code).inc()
    return exc.response()


__all__ = ["Server", "check_dispatcher", "create_app", "preload_gate_imports", "server_config", "start_dispatcher",
           "stop_dispatcher"]
