"""Databases for the service's tests: a SQLite file, and a fresh PostgreSQL database per test.

PostgreSQL comes from ``PRISM_TEST_POSTGRES_URL``, a SQLAlchemy URL of a role that may create
databases (``.ci/run`` installs Debian's ``postgresql``, starts it and sets the variable). Without
it the PostgreSQL cases skip; with it, a server that cannot be reached fails them.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

POSTGRES_ENV = "PRISM_TEST_POSTGRES_URL"
BACKENDS = ("sqlite", "postgresql")


def sqlite_url(folder: Path) -> str:
    """A SQLite file under ``folder`` (made by the store when it opens)."""
    return f"sqlite:///{folder / 'db' / 'prism.sqlite3'}"


@contextlib.contextmanager
def fresh_postgres(admin_url: str) -> Iterator[str]:
    """A new, empty database on ``admin_url``'s server for one test; dropped afterwards (its
    connections closed by force).

    Yields:
        the database's SQLAlchemy URL (``postgresql+psycopg://...``), password included.
    """
    name = f"prism_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop(admin, name)
        admin.dispose()


def _drop(admin, name: str, tries: int = 20) -> None:
    """Drop database ``name``: end this role's own connections to it, then a plain ``DROP
    DATABASE``, which also stops an autovacuum worker on it (``WITH (FORCE)`` instead refuses a
    role without ``pg_signal_backend`` when autovacuum happens to be there: "must be a member of
    the role whose process is being terminated"); retried while a connection is still closing."""
    from sqlalchemy.exc import OperationalError

    for attempt in range(tries):
        with admin.connect() as c:
            c.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n "
                           "AND usename = current_user AND pid <> pg_backend_pid()"), {"n": name})
            try:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
                return
            except OperationalError:  # "is being accessed by other users": a connection still closing
                if attempt == tries - 1:
                    raise
        time.sleep(0.25)


def postgres_admin_url() -> str | None:
    """``PRISM_TEST_POSTGRES_URL``, or ``None``."""
    return os.environ.get(POSTGRES_ENV) or None
