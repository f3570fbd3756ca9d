"""A result the dispatcher cannot store, and a claim it cannot launch (issue 18: one attempt's
trouble must not stall the others).

Two kinds of failure of a database call, told apart by :func:`unreachable`:

- **the database is unreachable** (a dropped or refused connection, a connection the pool
  invalidated, a pool that timed out): the call is retried as it is on the next round, for as
  long as it takes. The fenced write is idempotent, so a retry after a commit whose answer was
  lost changes nothing (``duplicate``).
- **anything else** (the database refuses a value: ``DataError``, ``IntegrityError``; a
  ``StatementError`` from a malformed field; a bug): the same call would fail the same way. It
  is tried on :data:`WRITE_TRIES` rounds; then the attempt ends as an ``infrastructure``
  failure at stage ``dispatch`` (:func:`stand_in`, :func:`reason`), written through the same
  fenced :meth:`Store.record <prism_challenge.service.store.Store.record>`, so the submission is
  retried per the retry policy with the reason on its attempt's row.

The replaced result's manifest is not lost: :func:`stand_in` logs it (logger
``prism_challenge.service``, error) and, with a blob store that has ``put``, keeps its JSON there
(content-addressed, like the bundles) and names the blob in the reason.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy import exc as sa_exc

from prism_challenge.failures import EvalFailure
from prism_challenge.profiles import Profile
from prism_challenge.manifest.results import EvalResult
from prism_challenge.service.store import Claim
from prism_challenge.service.worker import failure_result

log = logging.getLogger("prism_challenge.service")

WRITE_TRIES = 3  # rounds one result's write (or one claim's launch) may fail for another reason than an unreachable database
STORE_FAILED = "the attempt's result could not be stored"
LAUNCH_FAILED = "the attempt could not be launched"
REASON_CHARS = 300  # the error's first line is cut to this many characters in a reason
UNREACHABLE = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError)
"""The SQLAlchemy errors of a database that could not be reached (``TimeoutError``: the pool's)."""


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not be reached (retry the same call later),
    rather than that it refused the call (:data:`UNREACHABLE`, or a DBAPI error on a connection
    SQLAlchemy invalidated as disconnected)."""
    return isinstance(exc, UNREACHABLE) or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated)


def first_line(exc: BaseException) -> str:
    """``"<type>: <first line of the message>"``, the line cut to :data:`REASON_CHARS` characters."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[:REASON_CHARS]}"


def reason(what: str, exc: BaseException) -> str:
    """The reason stored for an attempt that ended because ``what`` kept failing with ``exc``."""
    return f"{what}: {first_line(exc)}"


def _manifest_json(result: EvalResult) -> str:
    """The result's manifest as JSON (sorted keys); the whole result's, or its ``repr``, if the
    manifest itself will not serialize (the bug that made the write fail may be there)."""
    for dump in (lambda: json.dumps(result.manifest.to_json_dict(), sort_keys=True),
                 lambda: result.model_dump_json()):
        try:
            return dump()
        except Exception:  # noqa: BLE001 - try the next, plainer form
            continue
    return repr(result)


def stand_in(claim: Claim, result: EvalResult, exc: BaseException, *, blobs: Any = None,
             profile: Profile | None = None) -> EvalResult:
    """The ``infrastructure`` failure (stage ``dispatch``) written in place of ``result``, whose
    write failed with ``exc`` on :data:`WRITE_TRIES` rounds.

    Its message is ``"the attempt's result could not be stored: <type>: <first line>"``, then
    where the original manifest is: ``"; its manifest is blob <sha256>"`` when ``blobs.put``
    stored its JSON, else ``"; its manifest is in the service's log"``. The manifest's JSON is
    logged either way (error), with the submission, attempt and blob.
    """
    doc = _manifest_json(result)
    key = None
    put = getattr(blobs, "put", None)
    if put is not None:
        try:
            key = put(doc.encode())
        except Exception:  # noqa: BLE001 - the log keeps it
            log.exception("submission %d: attempt %d's manifest could not be kept in the blob store",
                          claim.submission_id, claim.number)
    where = f"its manifest is blob {key}" if key else "its manifest is in the service's log"
    log.error("submission %d: attempt %d's %s result could not be stored on %d rounds (%s); written as an "
              "infrastructure failure instead; %s: %s", claim.submission_id, claim.number, result.status,
              WRITE_TRIES, first_line(exc), where, doc)
    message = f"{reason(STORE_FAILED, exc)}; {where}"
    return failure_result(EvalFailure("dispatch", message), profile=profile)


__all__ = ["LAUNCH_FAILED", "REASON_CHARS", "STORE_FAILED", "UNREACHABLE", "WRITE_TRIES", "first_line", "reason", "stand_in", "unreachable"]
