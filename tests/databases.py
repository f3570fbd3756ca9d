"""Databases for the service's tests: a SQLite file, and a fresh PostgreSQL database per test.

PostgreSQL comes from ``PRISM_TEST_POSTGRES_URL``, a SQLAlchemy URL of a role that may create
databases (``.ci/run`` installs Debian's ``postgresql``, starts it and sets the variable). Without
it the PostgreSQL cases skip; with it, a server that cannot be reached fails them.
"""

from __future__ import annotations

import contextlib
import os
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
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def postgres_admin_url() -> str | None:
    """``PRISM_TEST_POSTGRES_URL``, or ``None``."""
    return os.environ.get(POSTGRES_ENV) or None
