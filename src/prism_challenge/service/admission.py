"""Admission limits (issue 27, item 2): what a hotkey, a client address and everyone together may
have accepted, counted from the ``submissions`` table (so a restart keeps every count, and a
refused request, a duplicate included, never counts: it made no row).

The limits, each a setting (:class:`~prism_challenge.service.settings.ServiceSettings`):

- ``max_in_flight``: submissions of one hotkey ``pending`` or ``running`` at once
  (429 ``too-many-in-flight``);
- ``rate_limit`` per ``rate_window_s``: submissions one hotkey had accepted in the window
  (429 ``rate-limited``);
- ``address_rate_limit`` per ``rate_window_s``: submissions accepted from one client address in
  the window (429 ``address-rate-limited``; a fresh hotkey is free, an address is not). The
  address is :func:`client_key` of the connection's peer, or of the client a trusted proxy names
  (``trusted_proxies``: uvicorn's ``ProxyHeadersMiddleware`` rewrites the peer, nothing here
  parses a header);
- ``max_queued``: ``pending`` submissions of every hotkey together (503 ``queue-full``).

:func:`admit` runs twice per submission: before the intake (read only: an over-limit request
costs no gates) and in the transaction that adds the row (on PostgreSQL under a transaction-level
advisory lock, so concurrent service processes cannot both take the last place; SQLite writers
are serialized by the database and, in one process, by the route's lock).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from prism_challenge.service.errors import ApiError
from prism_challenge.service.models import Submission, Submitter

ADVISORY_LOCK = 0x70726973  # "pris": the PostgreSQL advisory lock of the admission transaction
BUSY_RETRY_S = 60
"""``Retry-After`` (s) of the limits whose end no row can date: in flight, the queue."""
IN_FLIGHT = ("pending", "running")


@dataclass(frozen=True)
class Limits:
    """The admission limits (see the module docstring); ``window_s`` in seconds."""

    window_s: float
    per_hotkey: int
    per_address: int
    in_flight: int
    queued: int

    @classmethod
    def of(cls, settings) -> Limits:
        """The limits of a :class:`~prism_challenge.service.settings.ServiceSettings`."""
        return cls(window_s=settings.rate_window_s, per_hotkey=settings.rate_limit,
                   per_address=settings.address_rate_limit, in_flight=settings.max_in_flight,
                   queued=settings.max_queued)


def client_key(host: str | None, ipv6_prefix: int = 64) -> str | None:
    """The address a client is counted under: an IPv4 address as it is (an IPv4-mapped IPv6
    address as its IPv4 one), an IPv6 address as its ``/ipv6_prefix`` network (``2001:db8::/64``:
    one host usually holds a whole /64, so counting single addresses would let it rotate them),
    anything else (a Unix socket, a test client's name) as it is, cut to 64 characters; ``None``
    for no peer."""
    if not host:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, ipv6_prefix), strict=False))
    return str(address)


def admit(s: Session, hotkey: str, address: str | None, limits: Limits, now: datetime, *,
          lock: bool = False) -> None:
    """Refuse a submission of ``hotkey`` from ``address`` (``None``: the gateway's, not counted
    per address) that a limit does not admit now; checked in the order of the module docstring.

    Args:
        s: a session; with ``lock`` on PostgreSQL, its transaction takes :data:`ADVISORY_LOCK`
            (held until it ends: the caller adds the row in the same transaction).
        now: the current time, timezone-aware UTC.

    Raises:
        ApiError: 429 ``too-many-in-flight`` / ``rate-limited`` / ``address-rate-limited`` (with
            ``Retry-After``), 503 ``queue-full``.
    """
    if lock and s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ADVISORY_LOCK})
    of_hotkey = select(Submission.created_at).join(Submitter, Submitter.id == Submission.submitter_id).where(
        Submitter.hotkey == hotkey)
    busy = s.scalar(select(func.count()).select_from(of_hotkey.where(Submission.status.in_(IN_FLIGHT)).subquery()))
    if busy >= limits.in_flight:
        raise _refused(429, "too-many-in-flight", f"{hotkey} has {busy} submission(s) pending or running: at most "
                       f"{limits.in_flight} at once (max_in_flight); send the next when one ends", BUSY_RETRY_S)
    since = now - timedelta(seconds=limits.window_s)
    wait = _window_wait(s, of_hotkey, since, limits.per_hotkey, limits.window_s, now)
    if wait is not None:
        raise _refused(429, "rate-limited", f"{hotkey}: {limits.per_hotkey} submissions accepted in "
                       f"{limits.window_s:g} s already (rate_limit)", wait)
    if address is not None:
        of_address = select(Submission.created_at).where(Submission.client_address == address)
        wait = _window_wait(s, of_address, since, limits.per_address, limits.window_s, now)
        if wait is not None:
            raise _refused(429, "address-rate-limited", f"client {address}: {limits.per_address} submissions "
                           f"accepted in {limits.window_s:g} s already, whatever their hotkeys (address_rate_limit)",
                           wait)
    queued = s.scalar(select(func.count()).select_from(Submission).where(Submission.status == "pending"))
    if queued >= limits.queued:
        raise _refused(503, "queue-full", f"{queued} submissions are waiting to be evaluated: at most "
                       f"{limits.queued} (max_queued)", BUSY_RETRY_S)


def _window_wait(s: Session, rows, since: datetime, limit: int, window_s: float, now: datetime) -> float | None:
    """``None`` while fewer than ``limit`` of ``rows`` (a select of ``created_at``) are newer than
    ``since``; else the seconds until enough of them leave the window for one more."""
    recent = list(s.scalars(rows.where(Submission.created_at > since).order_by(Submission.created_at.desc())
                            .limit(limit)))
    if len(recent) < limit:
        return None
    return (recent[-1] + timedelta(seconds=window_s) - now).total_seconds()


RULES = {"too-many-in-flight": "prism:in-flight", "rate-limited": "prism:rate-limit",
         "address-rate-limited": "prism:address-rate-limit", "queue-full": "prism:queue-full"}
"""Each refusal's rule id (stage ``auth``, like the other refusals before the intake)."""


def _refused(status: int, code: str, message: str, wait_s: float) -> ApiError:
    after = str(max(1, math.ceil(wait_s)))
    return ApiError(status, code, f"{message}; retry in {after} s", stage="auth", rule=RULES[code],
                    headers={"Retry-After": after})


__all__ = ["ADVISORY_LOCK", "BUSY_RETRY_S", "Limits", "RULES", "admit", "client_key"]
