"""Alembic's environment for the service's database: migrations run on the connection the
store passes in ``config.attributes["connection"]`` (online only; no offline SQL scripts)."""

from alembic import context

from prism_challenge.service.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
