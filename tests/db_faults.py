"""Database faults for the service's tests: a connection dropped while an attempt's result is
written (issue 18's fault "the database connection drops during a result write"), a result the
database refuses on every write, and a connection dropped on the read that follows a claim.

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
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.pool import NullPool

from prism_challenge.service.models import Attempt, Submission
from prism_challenge.service.store import Store

WHEN = ("before", "after")
HOW = ("refused", "bug", "dropped")


def _admin(store: Store):
    """A second engine on ``store``'s PostgreSQL server (``None`` on SQLite) to end its sessions."""
    if store.engine.dialect.name != "postgresql":
        return None
    return create_engine(store.url, poolclass=NullPool, isolation_level="AUTOCOMMIT")


def terminate(admin, pid: int) -> None:
    """End PostgreSQL server process ``pid`` from ``admin`` (waiting up to 10 s for it to be gone)."""
    with admin.connect() as c:
        gone = c.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid}).scalar()
    if not gone:
        raise AssertionError(f"pg_terminate_backend({pid}) did not end the server process within 10 s")


def _backend_pid(session) -> int:
    return session.connection().connection.dbapi_connection.info.backend_pid


class DroppedResultWrite:
    """Drop the connection of the first result write of each submission in ``faults``.

    Args:
        store: the store whose sessions are watched (the dispatcher's).
        faults: submission id -> ``"before"`` or ``"after"`` (the commit).
        run_index: only a write that ends an attempt of this run (0: the first, 1: the first
            confirmation run, issue 29); ``None``: any.

    Attributes:
        fired: ``(submission id, when, backend pid or None)`` of each drop made, in order.

    Raises:
        ValueError: a ``when`` that is not one of :data:`WHEN`.
    """

    def __init__(self, store: Store, faults: dict[int, str], *, run_index: int | None = None):
        bad = {sid: when for sid, when in faults.items() if when not in WHEN}
        if bad:
            raise ValueError(f"faults {bad}: each must be one of {WHEN}")
        self.store, self.faults, self.run_index = store, dict(faults), run_index
        self.fired: list[tuple[int, str, int | None]] = []
        self._lock = threading.Lock()
        self._postgres = store.engine.dialect.name == "postgresql"
        self._admin = _admin(store)
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
            if isinstance(obj, Attempt) and inspect(obj).attrs.outcome.history.added and (
                    self.run_index is None or obj.run_index == self.run_index):
                return obj.submission_id
        return None

    def _after_flush(self, session, _context) -> None:
        sid = self._finished(session)
        with self._lock:
            when = self.faults.pop(sid, None) if sid is not None else None
        if when is None:
            return
        pid = _backend_pid(session) if self._postgres else None
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
        terminate(self._admin, pid)


class RefusedResultWrite:
    """Fail every write (up to ``times``) that gives an attempt of a submission in ``sids`` the
    outcome ``outcome``, before its commit (the transaction is rolled back). ``how``:

    - ``"refused"``: the database refuses a value. On PostgreSQL the server really refuses a
      statement of the writer's transaction (a cast of ``'refused'`` to ``integer``: psycopg's
      ``InvalidTextRepresentation``, SQLAlchemy's ``DataError``); on SQLite a
      :class:`sqlalchemy.exc.DataError` is injected.
    - ``"bug"``: a ``KeyError`` from the write's own code (a harness bug), on both.
    - ``"dropped"``: the connection drops (PostgreSQL: its server process ended; SQLite: an
      injected ``OperationalError``), as :class:`DroppedResultWrite` ``"before"``.

    Attributes:
        fired: ``(submission id, attempt number)`` of each write failed, in order.

    Raises:
        ValueError: a ``how`` that is not one of :data:`HOW`.
    """

    def __init__(self, store: Store, sids: set[int], *, how: str = "refused", outcome: str = "completed",
                 times: int | None = None):
        if how not in HOW:
            raise ValueError(f"how = {how!r}: must be one of {HOW}")
        self.store, self.sids, self.how, self.outcome, self.left = store, set(sids), how, outcome, times
        self.fired: list[tuple[int, int]] = []
        self._admin = _admin(store)
        event.listen(store.sessions, "after_flush", self._after_flush)

    def remove(self) -> None:
        """Stop watching."""
        event.remove(self.store.sessions, "after_flush", self._after_flush)
        if self._admin is not None:
            self._admin.dispose()

    def _after_flush(self, session, _context) -> None:
        hit = next((a for a in session.dirty if isinstance(a, Attempt) and a.submission_id in self.sids
                    and self.outcome in inspect(a).attrs.outcome.history.added), None)
        if hit is None or self.left == 0:
            return
        if self.left is not None:
            self.left -= 1
        self.fired.append((hit.submission_id, hit.number))
        if self.how == "bug":
            raise KeyError("run_dir")
        if self._admin is None:
            if self.how == "dropped":
                raise OperationalError("COMMIT", {}, Exception("the database connection dropped before the commit"))
            raise DataError("INSERT INTO runs", {}, Exception("value out of range for the column"))
        if self.how == "dropped":
            terminate(self._admin, _backend_pid(session))  # the COMMIT that follows fails
            return
        session.connection().exec_driver_sql("SELECT CAST('refused' AS integer)")  # the server's DataError


class DroppedLaunchRead:
    """Drop the connection of the first ``times`` reads of a submission's row (``Session.get``,
    what :meth:`Store.submission` does) after each claim of a submission in ``sids``: the read a
    dispatcher makes to launch what it just claimed. On PostgreSQL the reader's server process is
    ended before the ``SELECT`` (psycopg's ``OperationalError``); on SQLite an
    :class:`sqlalchemy.exc.OperationalError` is injected.

    Attributes:
        fired: ``(submission id, backend pid or None)`` of each read dropped, in order.
    """

    def __init__(self, store: Store, sids: set[int], *, times: int = 1):
        self.store, self.sids, self.times = store, set(sids), times
        self.fired: list[tuple[int, int | None]] = []
        self._armed: dict[int, int] = {}  # submission id -> reads still to drop
        self._admin = _admin(store)
        event.listen(store.sessions, "after_flush", self._after_flush)
        event.listen(store.sessions, "after_commit", self._after_commit)
        event.listen(store.sessions, "do_orm_execute", self._execute)

    def remove(self) -> None:
        """Stop watching."""
        event.remove(self.store.sessions, "after_flush", self._after_flush)
        event.remove(self.store.sessions, "after_commit", self._after_commit)
        event.remove(self.store.sessions, "do_orm_execute", self._execute)
        if self._admin is not None:
            self._admin.dispose()

    def _after_flush(self, session, _context) -> None:
        for obj in session.new:  # a claim adds the attempt
            if isinstance(obj, Attempt) and obj.submission_id in self.sids:
                session.info["claimed"] = obj.submission_id

    def _after_commit(self, session) -> None:
        sid = session.info.pop("claimed", None)
        if sid is not None:
            self._armed[sid] = self.times

    def _execute(self, state) -> None:
        if not state.is_select or state.statement.column_descriptions[0].get("expr") is not Submission:
            return
        sid = next((v for v in (state.parameters or {}).values() if self._armed.get(v)), None)
        if sid is None:
            return
        self._armed[sid] -= 1
        pid = _backend_pid(state.session) if self._admin is not None else None
        self.fired.append((sid, pid))
        if pid is None:
            raise OperationalError("SELECT submissions", {}, Exception("the database connection dropped"))
        terminate(self._admin, pid)  # the SELECT that follows fails: the server closed the connection
