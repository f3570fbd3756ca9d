"""Slow clients (issue 27, item 2): a deadline on a request's headers.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) and the size of a request
head (``h11_max_incomplete_event_size``), but not the time a head may take to arrive: a client
that opens a connection and sends one header byte every few seconds holds it, and one of the
``max_connections`` places, for ever. :func:`header_timeout_protocol` makes uvicorn's own h11
protocol close a connection whose next request head has not fully arrived ``seconds`` after the
connection opened or after the previous response ended. A request's body has its own deadline
(``body_timeout_s``, :func:`prism_challenge.service.routes.submit.read_body`); a reverse proxy in
front (docs/operator.md, *Behind a reverse proxy*) adds its own.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderDeadline(H11Protocol):
    """:class:`H11Protocol` with a deadline on each request head (:attr:`header_timeout_s`)."""

    header_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not before:  # a whole head arrived: its request runs
            self._cancel_head()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is cycle:  # no pipelined request started: wait for one
            self._arm_head()

    def _arm_head(self) -> None:
        self._cancel_head()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol (``uvicorn.Config(http=...)``) closing a connection whose request
    head has not arrived ``seconds`` after it opened or after its previous response."""
    return type("HeaderDeadlineH11Protocol", (_HeaderDeadline,), {"header_timeout_s": float(seconds)})


__all__ = ["header_timeout_protocol"]
