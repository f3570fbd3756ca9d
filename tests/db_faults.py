"""A database connection dropped while an attempt's result is written (issue 18's fault "the
database connection drops during a result write"), for the service's tests.

:class:`DroppedResultWrite` watches a :class:`~prism_challenge.service.store.Store`'s sessions
and fails the first transaction that writes an outcome for an attempt of each chosen
submission, once per submission:

- ``"before"``: the drop comes after the statements were sent and before the commit: the
  transaction is lost (rolled back) and the writer gets an error.
- ``"after"``: the commit has landed, then the connection drops before the writer hears back:
  the result is stored, the writer gets an error all the same (so it retries a write that is
  already there).

On PostgreSQL the connection is really dropped: its server process is ended with
``pg_terminate_backend`` from a second connection (the server closes the socket; the next
statement, the ``COMMIT``, fails with psycopg's ``OperationalError``). After the commit the
writer's error is raised by the hook itself besides (a connection ended after its commit
answered would go unnoticed by the writer: it is returned to the pool). SQLite has no
connection to drop: both are an injected :class:`sqlalchemy.exc.OperationalError`, the error a
dropped connection raises.
"""

from __future__ import annotations

import threading

from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from prism_challenge.service.models import Attempt
from prism_challenge.service.store import Store

WHEN = ("before", "after")


class DroppedResultWrite:
    """Drop the connection of the first result write of each submission in ``faults``.

    Args:
        store: the store whose sessions are watched (the dispatcher's).
        faults: submission id -> ``"before"`` or ``"after"`` (the commit).

    Attributes:
        fired: ``(submission id, when, backend pid or None)`` of each drop made, in order.

    Raises:
        ValueError: a ``when`` that is not one of :data:`WHEN`.
    """

    def __init__(self, store: Store, faults: dict[int, str]):
        bad = {sid: when for sid, when in faults.items() if when not in WHEN}
        if bad:
            raise ValueError(f"faults {bad}: each must be one of {WHEN}")
        self.store, self.faults = store, dict(faults)
        self.fired: list[tuple[int, str, int | None]] = []
        self._lock = threading.Lock()
        self._postgres = store.engine.dialect.name == "postgresql"
        self._admin = create_engine(store.url, poolclass=NullPool, isolation_level="AUTOCOMMIT") \
            if self._postgres else None
        event.listen(store.sessions, "after_flush", self._after_flush)
        event.listen(store.sessions, "after_commit", self._after_commit)

    def remove(self) -> None:
        """Stop watching (faults not fired yet stay unfired)."""
        event.remove(self.store.sessions, "after_flush", self._after_flush)
        event.remove(self.store.sessions, "after_commit", self._after_commit)
        if self._admin is not None:
            self._admin.dispose()

    def _finished(self, session) -> int | None:
        """The submission of an attempt this flush gives an outcome, or ``None``."""
        for obj in session.dirty:
            if isinstance(obj, Attempt) and inspect(obj).attrs.outcome.history.added:
                return obj.submission_id
        return None

    def _after_flush(self, session, _context) -> None:
        sid = self._finished(session)
        with self._lock:
            when = self.faults.pop(sid, None) if sid is not None else None
        if when is None:
            return
        pid = session.connection().connection.dbapi_connection.info.backend_pid if self._postgres else None
        if when == "after":  # after the commit: see _after_commit
            session.info["drop_after"] = (sid, pid)
            return
        self.fired.append((sid, "before", pid))
        if pid is None:
            raise OperationalError("COMMIT", {}, Exception("the database connection dropped before the commit"))
        self._terminate(pid)  # the COMMIT that follows fails: the server closed the connection

    def _after_commit(self, session) -> None:
        dropped = session.info.pop("drop_after", None)
        if dropped is None:
            return
        sid, pid = dropped
        self.fired.append((sid, "after", pid))
        if pid is not None:
            self._terminate(pid)
        raise OperationalError("COMMIT", {}, Exception("the database connection dropped after the commit, "
                                                       "before its answer"))

    def _terminate(self, pid: int) -> None:
        """End PostgreSQL server process ``pid`` (waiting up to 10 s for it to be gone)."""
        with self._admin.connect() as c:
            gone = c.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid}).scalar()
        if not gone:
            raise AssertionError(f"pg_terminate_backend({pid}) did not end the server process within 10 s")
